"""GenEval's rule, exact: the official evaluator's box selection and ``evaluate`` as a pure
function (Ghosh et al., 2023; ``evaluation/evaluate_images.py`` of djghosh13/geneval, read at
commit af4902f). NumPy and plain Python only: the worlds import it without torch.

The signature (keyword defaults are the evaluator's; its ``--options`` keys are the names)::

    decide(
        detections: Mapping[str, Sequence[box] | ndarray [N, >=5]],  # class -> raw boxes
        metadata: Mapping[str, Any],                                 # one metadata line
        colour_fn: Callable[[str, list[box]], Sequence[str]],
        *,
        threshold: float = 0.3,            # THRESHOLD
        counting_threshold: float = 0.9,   # COUNTING_THRESHOLD (tag "counting")
        max_objects: int = 16,             # MAX_OBJECTS
        max_overlap: float = 1.0,          # NMS_THRESHOLD (1: no NMS)
        position_threshold: float = 0.1,   # POSITION_THRESHOLD
    ) -> tuple[bool, str]                  # (correct, reason)

``detections``: every raw box of the detector, in any order, before any threshold. A box is
``(x0, y0, x1, y1, score, *extra)`` in pixels (a tuple, list, array row or any object indexable
so); what follows the score is the caller's (a mask, a colour) and is never read here. Its five
numbers are read into one array per class, dtype kept (pass the detector's float32 to compare in
float32, as the evaluator does on mmdetection's arrays). ``colour_fn(classname, boxes)`` returns
one colour name per box, in order; it is called exactly where the evaluator classifies colours
(a colour clause whose count holds), on the clause's ``count`` most confident kept boxes, most
confident first, with the very objects given in ``detections`` (so a scorer carries each box's
mask as a trailing field and crops with it). The result: ``correct`` (a Python bool) and
``reason``, the evaluator's own text (its messages joined by ``"\\n"``; empty when correct).

Box selection (``evaluate_image``), per class: ``order = argsort(score)[::-1]`` (NumPy's default
sort, not stable: equal scores come out as NumPy orders that very array), keep scores ``>``
the threshold (the counting threshold for tag ``counting``), cut to ``max_objects``, then greedy
NMS in that order (a box is dropped when its IoU, with the evaluator's ``+1`` pixel areas, with a
kept one is ``>= max_overlap``; none when ``max_overlap == 1``). ``evaluate``: includes with AND
(``count`` kept boxes; a colour on all of the ``count`` most confident; each of those in the
relation to every object of the target include, the relation from box centres minus a dead zone
of ``position_threshold x`` both boxes' size per axis; a failed include has no group, and a
relation to it fails "no target"), excludes with OR (``count`` or more kept boxes fail).

The arithmetic is the evaluator's text run by the NumPy installed here; the evaluator's own
environment had NumPy 1.x, whose scalar promotion differs only in ``compute_iou`` (float32 box
scalars plus a Python int: float64 there, float32 under NumPy 2), so with NMS on and float32
boxes an IoU within a float32 rounding of ``max_overlap`` may be cut differently. A reason that
lists two relations joins a Python set, as the evaluator does: its order follows the process's
string hashes (``PYTHONHASHSEED``), in the evaluator too.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from maskgrpo_ray.errors import UserError

# the evaluator's COLORS, in its order (a colour reason lists the colours found in this order)
COLORS = ("red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white")
# the evaluator's defaults (its --options keys: threshold, counting_threshold, max_objects,
# max_overlap, position_threshold)
THRESHOLD = 0.3
COUNTING_THRESHOLD = 0.9
MAX_OBJECTS = 16
NMS_THRESHOLD = 1.0
POSITION_THRESHOLD = 0.1

Box = Any  # (x0, y0, x1, y1, score, *extra): indexable, items 0-4 numbers
ColourFn = Callable[[str, list[Any]], Sequence[str]]
Kept = tuple[np.ndarray, Any]  # (the box's five numbers [5], the caller's box object)


class GenEvalRuleError(UserError, ValueError):
    """Input the official evaluator could not score (it would raise)."""


def rule_options(options: Mapping[str, str]) -> dict[str, Any]:
    """The keyword arguments of :func:`decide` from the evaluator's ``--options key=value``
    strings, parsed as the evaluator parses them (its ``model``, ``clip_model``, ``bgcolor`` and
    ``crop`` keys are the detector's and the colour classifier's, not the rule's)."""
    return {
        "threshold": float(options.get("threshold", THRESHOLD)),
        "counting_threshold": float(options.get("counting_threshold", COUNTING_THRESHOLD)),
        "max_objects": int(options.get("max_objects", MAX_OBJECTS)),
        "max_overlap": float(options.get("max_overlap", NMS_THRESHOLD)),
        "position_threshold": float(options.get("position_threshold", POSITION_THRESHOLD)),
    }


def compute_iou(box_a: Any, box_b: Any) -> Any:
    """The evaluator's ``compute_iou`` (its text): areas count ``x1 - x0 + 1`` pixels."""

    def area_fn(box: Any) -> Any:
        return max(box[2] - box[0] + 1, 0) * max(box[3] - box[1] + 1, 0)

    i_area = area_fn(
        [
            max(box_a[0], box_b[0]),
            max(box_a[1], box_b[1]),
            min(box_a[2], box_b[2]),
            min(box_a[3], box_b[3]),
        ]
    )
    u_area = area_fn(box_a) + area_fn(box_b) - i_area
    return i_area / u_area if u_area else 0


def relative_position(
    box_a: Any, box_b: Any, position_threshold: float = POSITION_THRESHOLD
) -> set[str]:
    """Where box A is relative to box B (``x0, y0, x1, y1[, ...]`` numbers, y down): the
    evaluator's ``relative_position`` (its text). Per axis the centre offset loses
    ``position_threshold x`` (A's size + B's size) towards 0 (a dead zone); no relation when
    both shrunk offsets are under 1e-3; else a direction holds when the shrunk offset over the
    full offset's length passes 0.5 (so a diagonal gives two relations)."""
    boxes = np.array([box_a, box_b])[:, :4].reshape(2, 2, 2)
    center_a, center_b = boxes.mean(axis=-2)
    dim_a, dim_b = np.abs(np.diff(boxes, axis=-2))[..., 0, :]
    offset = center_a - center_b
    revised_offset = np.maximum(np.abs(offset) - position_threshold * (dim_a + dim_b), 0) * np.sign(
        offset
    )
    if np.all(np.abs(revised_offset) < 1e-3):
        return set()
    dx, dy = revised_offset / np.linalg.norm(offset)
    relations = set()
    if dx < -0.5:
        relations.add("left of")
    if dx > 0.5:
        relations.add("right of")
    if dy < -0.5:
        relations.add("above")
    if dy > 0.5:
        relations.add("below")
    return relations


def _numbers(classname: str, boxes: Sequence[Box]) -> np.ndarray:
    """The five numbers of each box, ``[N, 5]``, dtype as NumPy infers it from them."""
    if isinstance(boxes, np.ndarray) and boxes.ndim == 2 and boxes.dtype.kind in "fiu":
        arr = boxes
    else:
        try:
            arr = np.array([[b[0], b[1], b[2], b[3], b[4]] for b in boxes])
        except (TypeError, IndexError, ValueError) as err:
            raise GenEvalRuleError(
                f"detections[{classname!r}]: a box must be (x0, y0, x1, y1, score, ...) "
                f"numbers ({err}); pass one such sequence per detected object"
            ) from None
    if arr.ndim != 2 or arr.shape[1] < 5 or arr.dtype.kind not in "fiu":
        raise GenEvalRuleError(
            f"detections[{classname!r}]: boxes read as shape {arr.shape}, dtype {arr.dtype}; "
            "each box needs x0, y0, x1, y1, score as numbers"
        )
    return arr


def select_kept(
    detections: Mapping[str, Sequence[Box]],
    tag: str,
    *,
    threshold: float = THRESHOLD,
    counting_threshold: float = COUNTING_THRESHOLD,
    max_objects: int = MAX_OBJECTS,
    max_overlap: float = NMS_THRESHOLD,
) -> dict[str, list[Kept]]:
    """The evaluator's box selection (``evaluate_image``): class -> kept ``(numbers, box)``,
    most confident first; a class with nothing kept is absent."""
    confidence_threshold = threshold if tag != "counting" else counting_threshold
    detected: dict[str, list[Kept]] = {}
    for classname, raw in detections.items():
        boxes = list(raw)
        if not boxes:
            continue
        bbox = _numbers(classname, raw if isinstance(raw, np.ndarray) else boxes)
        order = np.argsort(bbox[:, 4])[::-1]
        order = order[bbox[order, 4] > confidence_threshold]  # Threshold
        ordering: list[int] = order[:max_objects].tolist()  # Limit number of objects per class
        kept: list[Kept] = []
        while ordering:  # greedy NMS, most confident first
            max_obj = ordering.pop(0)
            kept.append((bbox[max_obj], boxes[max_obj]))
            ordering = [
                obj
                for obj in ordering
                if max_overlap == 1 or compute_iou(bbox[max_obj], bbox[obj]) < max_overlap
            ]
        if kept:
            detected[classname] = kept
    return detected


def select_boxes(
    detections: Mapping[str, Sequence[Box]], tag: str, **options: Any
) -> dict[str, list[Box]]:
    """:func:`select_kept` with the caller's box objects only: class -> kept boxes, most
    confident first (the objects :func:`decide` judges)."""
    return {
        c: [box for _, box in kept] for c, kept in select_kept(detections, tag, **options).items()
    }


def decide(
    detections: Mapping[str, Sequence[Box]],
    metadata: Mapping[str, Any],
    colour_fn: ColourFn,
    *,
    threshold: float = THRESHOLD,
    counting_threshold: float = COUNTING_THRESHOLD,
    max_objects: int = MAX_OBJECTS,
    max_overlap: float = NMS_THRESHOLD,
    position_threshold: float = POSITION_THRESHOLD,
) -> tuple[bool, str]:
    """GenEval's decision on one image: ``(correct, reason)`` exactly as the official evaluator
    gives them from the same raw detections (see the module docstring for the arguments).

    Raises:
        GenEvalRuleError: where the evaluator would raise: no ``tag``, a ``position`` naming no
            earlier include, an exclude of a class with no kept box and ``count < 1``, boxes that
            are not numbers, or a ``colour_fn`` answer of the wrong length.
    """
    if "tag" not in metadata:
        raise GenEvalRuleError(
            "GenEval metadata has no field 'tag' (the evaluator reads it to pick the "
            "threshold); add one of single_object, two_object, counting, colors, position, "
            "color_attr"
        )
    objects = select_kept(
        detections,
        metadata["tag"],
        threshold=threshold,
        counting_threshold=counting_threshold,
        max_objects=max_objects,
        max_overlap=max_overlap,
    )
    return _evaluate(objects, metadata, colour_fn, position_threshold)


def _evaluate(
    objects: Mapping[str, list[Kept]],
    metadata: Mapping[str, Any],
    colour_fn: ColourFn,
    position_threshold: float,
) -> tuple[bool, str]:
    """The evaluator's ``evaluate`` (its text, comments included, colour classification by
    ``colour_fn``) on kept objects, most confident first."""
    correct = True
    reason: list[str] = []
    matched_groups: list[list[Kept] | None] = []
    # Check for expected objects
    for req in metadata.get("include", []):
        classname = req["class"]
        matched = True
        found_objects = objects.get(classname, [])[: req["count"]]
        if len(found_objects) < req["count"]:
            correct = matched = False
            reason.append(f"expected {classname}>={req['count']}, found {len(found_objects)}")
        else:
            if "color" in req:
                # Color check
                colors = _colours(colour_fn, classname, found_objects)
                if colors.count(req["color"]) < req["count"]:
                    correct = matched = False
                    reason.append(
                        f"expected {req['color']} {classname}>={req['count']}, found "
                        + f"{colors.count(req['color'])} {req['color']}; and "
                        + ", ".join(f"{colors.count(c)} {c}" for c in COLORS if c in colors)
                    )
            if "position" in req and matched:
                # Relative position check
                expected_rel, target_group = req["position"]
                if not -len(matched_groups) <= target_group < len(matched_groups):
                    raise GenEvalRuleError(
                        f"include {classname!r}: position {req['position']!r} names include "
                        f"{target_group}, not an earlier one (the evaluator raises IndexError)"
                    )
                group = matched_groups[target_group]
                if group is None:
                    correct = matched = False
                    reason.append(f"no target for {classname} to be {expected_rel}")
                else:
                    for obj in found_objects:
                        for target_obj in group:
                            true_rels = relative_position(obj[0], target_obj[0], position_threshold)
                            if expected_rel not in true_rels:
                                correct = matched = False
                                reason.append(
                                    f"expected {classname} {expected_rel} target, found "
                                    + f"{' and '.join(true_rels)} target"
                                )
                                break
                        if not matched:
                            break
        if matched:
            matched_groups.append(found_objects)
        else:
            matched_groups.append(None)
    # Check for non-expected objects
    for req in metadata.get("exclude", []):
        classname = req["class"]
        if len(objects.get(classname, [])) >= req["count"]:
            correct = False
            if classname not in objects:
                raise GenEvalRuleError(
                    f"exclude {classname!r}: count {req['count']!r} < 1 fails with no box "
                    "(the evaluator raises KeyError); an exclude count is at least 1"
                )
            reason.append(f"expected {classname}<{req['count']}, found {len(objects[classname])}")
    return correct, "\n".join(reason)


def _colours(colour_fn: ColourFn, classname: str, found: list[Kept]) -> list[str]:
    """``colour_fn`` on the caller's box objects; one colour name per box."""
    colors = list(colour_fn(classname, [box for _, box in found]))
    if len(colors) != len(found):
        raise GenEvalRuleError(
            f"colour_fn({classname!r}, boxes) returned {len(colors)} colours for {len(found)} "
            "boxes; it must return one colour name per box, in order"
        )
    return colors
