"""GenEval's metadata schema (Ghosh et al., 2023): the tags, the relations, the check of a
metadata line, and the rule that scores detected objects against one. Plain Python (no torch),
so prompt loading, generation and the toy world read it without the evaluation's dependencies.

A metadata line: ``tag`` (one of :data:`TAGS`), ``include`` (objects that must be there:
``class``, ``count``, optional ``color``, optional ``position = [relation, index of an
earlier include]``, ``relation`` one of :data:`RELATIONS`), optional ``exclude`` (``class``,
``count``: fewer than ``count`` of the class), ``prompt``.

The rule (:func:`evaluate_objects`, after the official ``evaluate``): every include clause
holds (at least ``count`` objects; ``color`` on ``count`` of them; every one of them in
``relation`` to every object of the target include) and no exclude clause is met. The folder
layout the official evaluator reads is :mod:`maskgrpo_ray.evaluation.geneval`.
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


# ----------------------------------------------------------------------------- the rule


def relations(a: tuple[float, float], b: tuple[float, float]) -> set[str]:
    """Where ``a`` is relative to ``b`` (centres ``(x, y)``, y down), as the official
    ``relative_position`` with exact boxes: a direction counts when the unit offset's component
    passes 0.5."""
    dx, dy = a[0] - b[0], a[1] - b[1]
    norm = (dx * dx + dy * dy) ** 0.5
    if norm == 0:
        return set()
    dx, dy = dx / norm, dy / norm
    out = set()
    if dx < -0.5:
        out.add("left of")
    if dx > 0.5:
        out.add("right of")
    if dy < -0.5:
        out.add("above")
    if dy > 0.5:
        out.add("below")
    return out


Obj = dict[str, Any]  # {"color": str, "xy": (x, y), "region": set of halves it lies in}


def evaluate_objects(objects: Mapping[str, list[Obj]], meta: Mapping[str, Any]) -> bool:
    """GenEval's rule on detected ``objects`` (class -> objects): includes with AND, excludes
    with OR. With exact detection, a colour clause counts the objects of that colour."""
    matched: list[list[Obj] | None] = []
    correct = True
    for req in meta["include"]:
        found = objects.get(req["class"], [])
        if "color" in req:
            found = [o for o in found if o["color"] == req["color"]]
        ok = len(found) >= req["count"]
        if ok and "region" in req:
            ok = all(req["region"] in o["region"] for o in found)
        if ok and "position" in req:
            relation, target = req["position"]
            group = matched[target]
            ok = group is not None and all(
                relation in relations(o["xy"], t["xy"]) for o in found for t in group
            )
        matched.append(found if ok else None)
        correct = correct and ok
    for req in meta.get("exclude", []):
        if len(objects.get(req["class"], [])) >= req["count"]:
            correct = False
    return correct
