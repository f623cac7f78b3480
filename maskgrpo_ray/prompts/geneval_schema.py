"""GenEval's metadata schema (Ghosh et al., 2023): the tags, the relations, the class names and
the check of a metadata line. Plain Python (no torch), so prompt loading, generation and the
worlds read it without the evaluation's dependencies.

A metadata line: ``tag`` (one of :data:`TAGS`), ``include`` (objects that must be there:
``class``, ``count``, optional ``color``, optional ``position = [relation, index of an
earlier include]``, ``relation`` one of :data:`RELATIONS`), optional ``exclude`` (``class``,
``count``: fewer than ``count`` of the class), ``prompt``.

The rule that judges detections against a line is the official evaluator's, exact:
:func:`maskgrpo_ray.prompts.geneval_rule.decide` (re-exported by
:mod:`maskgrpo_ray.evaluation.geneval`, with the folder layout the official evaluator reads).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from maskgrpo_ray.errors import UserError

TAGS = ("single_object", "two_object", "counting", "colors", "position", "color_attr")
RELATIONS = ("left of", "right of", "above", "below")
# GenEval's 80 object classes (the COCO names of its detector), in the order of the evaluator's
# evaluation/object_names.txt (djghosh13/geneval): the only class names it detects
GENEVAL_CLASSES: tuple[str, ...] = (
    "person",
    "bicycle",
    "car",
    "motorcycle",
    "airplane",
    "bus",
    "train",
    "truck",
    "boat",
    "traffic light",
    "fire hydrant",
    "stop sign",
    "parking meter",
    "bench",
    "bird",
    "cat",
    "dog",
    "horse",
    "sheep",
    "cow",
    "elephant",
    "bear",
    "zebra",
    "giraffe",
    "backpack",
    "umbrella",
    "handbag",
    "tie",
    "suitcase",
    "frisbee",
    "skis",
    "snowboard",
    "sports ball",
    "kite",
    "baseball bat",
    "baseball glove",
    "skateboard",
    "surfboard",
    "tennis racket",
    "bottle",
    "wine glass",
    "cup",
    "fork",
    "knife",
    "spoon",
    "bowl",
    "banana",
    "apple",
    "sandwich",
    "orange",
    "broccoli",
    "carrot",
    "hot dog",
    "pizza",
    "donut",
    "cake",
    "chair",
    "couch",
    "potted plant",
    "bed",
    "dining table",
    "toilet",
    "tv",
    "laptop",
    "computer mouse",
    "tv remote",
    "computer keyboard",
    "cell phone",
    "microwave",
    "oven",
    "toaster",
    "sink",
    "refrigerator",
    "book",
    "clock",
    "vase",
    "scissors",
    "teddy bear",
    "hair drier",
    "toothbrush",
)


class GenEvalMetadataError(UserError, ValueError):
    """A metadata line that the GenEval evaluator could not read."""


def check_metadata(meta: Any, where: str, classes: Sequence[str] | None = None) -> None:
    """Raise :class:`GenEvalMetadataError` naming ``where`` (file:line), the field and the fix
    unless ``meta`` is a GenEval metadata object.

    ``classes``: the class names a clause may name (:data:`GENEVAL_CLASSES` for a real model's
    prompts, which the official evaluator's detector scores); None: any name (the toy and shapes
    worlds detect their own classes: dot, circle, square...)."""
    fix = "see docs/evaluation.md (GenEval metadata) or `maskgrpo prompts make --kind geneval`"
    if not isinstance(meta, Mapping):
        raise GenEvalMetadataError(f"{where}: a GenEval metadata line must be an object; {fix}")
    if "tag" not in meta:
        raise GenEvalMetadataError(
            f"{where}: field 'tag' is missing (the evaluator picks its detection threshold by "
            f"it); add one of {list(TAGS)}; {fix}"
        )
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
        if classes is not None and clause["class"] not in classes:
            known = (
                "GenEval's 80 detector classes (its evaluation/object_names.txt, e.g. "
                "'teddy bear', 'dining table')"
                if tuple(classes) == GENEVAL_CLASSES
                else f"the classes {list(classes)}"
            )
            raise GenEvalMetadataError(
                f"{where}: field {field}.class is {clause['class']!r}, not one of {known}; "
                f"name one of them; {fix}"
            )
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
