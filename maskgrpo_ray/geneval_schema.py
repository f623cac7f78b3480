"""GenEval's metadata schema (Ghosh et al., 2023): the tags, the relations and the check of a
metadata line. Plain Python (no torch), so prompt loading and generation read it without the
evaluation's dependencies.

A metadata line: ``tag`` (one of :data:`TAGS`), ``include`` (objects that must be there:
``class``, ``count``, optional ``color``, optional ``position = [relation, index of an
earlier include]``, ``relation`` one of :data:`RELATIONS`), optional ``exclude`` (``class``,
``count``: fewer than ``count`` of the class), ``prompt``. The rule that scores it lives in
:mod:`maskgrpo_ray.evaluation.geneval`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from maskgrpo_ray.errors import UserError

TAGS = ("single_object", "two_object", "counting", "colors", "position", "color_attr")
RELATIONS = ("left of", "right of", "above", "below")


class GenEvalMetadataError(UserError, ValueError):
    """A metadata line that the GenEval evaluator could not read."""


def check_metadata(meta: Any, where: str) -> None:
    """Raise :class:`GenEvalMetadataError` naming ``where`` (file:line), the field and the fix
    unless ``meta`` is a GenEval metadata object."""
    fix = "see docs/evaluation.md (GenEval metadata) or `maskgrpo prompts make --kind geneval`"
    if not isinstance(meta, Mapping):
        raise GenEvalMetadataError(f"{where}: a GenEval metadata line must be an object; {fix}")
    if meta.get("tag") not in TAGS:
        raise GenEvalMetadataError(
            f"{where}: field 'tag' is {meta.get('tag')!r}; GenEval metadata needs one of "
            f"{list(TAGS)}; {fix}"
        )
    if not isinstance(meta.get("prompt"), str) or not meta["prompt"].strip():
        raise GenEvalMetadataError(f"{where}: field 'prompt' is missing or empty; {fix}")
    include = meta.get("include")
    if not isinstance(include, list) or not include:
        raise GenEvalMetadataError(
            f"{where}: field 'include' must be a non-empty list of objects; {fix}"
        )
    for k, clause in enumerate([*include, *meta.get("exclude", [])]):
        field = f"include[{k}]" if k < len(include) else f"exclude[{k - len(include)}]"
        if not isinstance(clause, Mapping) or not isinstance(clause.get("class"), str):
            raise GenEvalMetadataError(f"{where}: field {field}.class is missing; {fix}")
        count = clause.get("count")
        if not isinstance(count, int) or count < 1:
            raise GenEvalMetadataError(
                f"{where}: field {field}.count is {count!r}; it must be an integer >= 1; {fix}"
            )
        pos = clause.get("position")
        if pos is not None and not (
            isinstance(pos, list)
            and len(pos) == 2
            and pos[0] in RELATIONS
            and isinstance(pos[1], int)
            and 0 <= pos[1] < min(k, len(include))
        ):
            raise GenEvalMetadataError(
                f"{where}: field {field}.position is {pos!r}; expected [relation, index of an "
                f"earlier include] with relation in {list(RELATIONS)}; {fix}"
            )
