"""TRANSCRIPTION of the official GenEval evaluator, for tests/test_geneval_decide.py only.

The reference the project's :func:`maskgrpo_ray.evaluation.geneval.decide` is checked against,
case by case; never imported by the package.
"""

# ruff: noqa: E501, E701, E731

import numpy as np

COLORS = ["red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white"]

# ============================================================================================
# TRANSCRIPTION of the official evaluator, djghosh13/geneval evaluation/evaluate_images.py
# (commit af4902f): compute_iou, relative_position, evaluate and evaluate_image's box selection,
# verbatim but for (1) the option globals set per call, (2) color_classification(image, bboxes,
# classname) calling a colour function on the boxes of the (box, mask) pairs, (3) the detector's
# result given as `bbox` (one float32 [N, 5] array per class, mmdetection's) with `segm` None,
# (4) `image` unused. This is the check's reference only; the project's code is decide().
# ============================================================================================

COLOR_FN = None
THRESHOLD = COUNTING_THRESHOLD = MAX_OBJECTS = NMS_THRESHOLD = POSITION_THRESHOLD = None


def color_classification(image, bboxes, classname):
    return COLOR_FN(classname, [box for box, _ in bboxes])


def compute_iou(box_a, box_b):
    area_fn = lambda box: max(box[2] - box[0] + 1, 0) * max(box[3] - box[1] + 1, 0)  # noqa: E731
    i_area = area_fn([
        max(box_a[0], box_b[0]), max(box_a[1], box_b[1]),
        min(box_a[2], box_b[2]), min(box_a[3], box_b[3])
    ])  # fmt: skip
    u_area = area_fn(box_a) + area_fn(box_b) - i_area
    return i_area / u_area if u_area else 0


def ref_relative_position(obj_a, obj_b):
    """Give position of A relative to B, factoring in object dimensions"""
    boxes = np.array([obj_a[0], obj_b[0]])[:, :4].reshape(2, 2, 2)
    center_a, center_b = boxes.mean(axis=-2)
    dim_a, dim_b = np.abs(np.diff(boxes, axis=-2))[..., 0, :]
    offset = center_a - center_b
    #
    revised_offset = np.maximum(np.abs(offset) - POSITION_THRESHOLD * (dim_a + dim_b), 0) * np.sign(offset)  # noqa: E501  # fmt: skip
    if np.all(np.abs(revised_offset) < 1e-3):
        return set()
    #
    dx, dy = revised_offset / np.linalg.norm(offset)
    relations = set()
    if dx < -0.5: relations.add("left of")  # noqa: E701  # fmt: skip
    if dx > 0.5: relations.add("right of")  # noqa: E701  # fmt: skip
    if dy < -0.5: relations.add("above")  # noqa: E701  # fmt: skip
    if dy > 0.5: relations.add("below")  # noqa: E701  # fmt: skip
    return relations


def evaluate(image, objects, metadata):
    correct = True
    reason = []
    matched_groups = []
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
                colors = color_classification(image, found_objects, classname)
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
                if matched_groups[target_group] is None:
                    correct = matched = False
                    reason.append(f"no target for {classname} to be {expected_rel}")
                else:
                    for obj in found_objects:
                        for target_obj in matched_groups[target_group]:
                            true_rels = ref_relative_position(obj, target_obj)
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
            reason.append(f"expected {classname}<{req['count']}, found {len(objects[classname])}")
    return correct, "\n".join(reason)  # fmt: skip


def evaluate_image(bbox, segm, classnames, metadata):
    detected = {}
    # Determine bounding boxes to keep
    confidence_threshold = THRESHOLD if metadata["tag"] != "counting" else COUNTING_THRESHOLD
    for index, classname in enumerate(classnames):
        ordering = np.argsort(bbox[index][:, 4])[::-1]
        ordering = ordering[bbox[index][ordering, 4] > confidence_threshold]  # Threshold  # noqa: E261,E501  # fmt: skip
        ordering = ordering[:MAX_OBJECTS].tolist()  # Limit number of detected objects per class  # noqa: E261,E501  # fmt: skip
        detected[classname] = []
        while ordering:
            max_obj = ordering.pop(0)
            detected[classname].append((bbox[index][max_obj], None if segm is None else segm[index][max_obj]))  # noqa: E501  # fmt: skip
            ordering = [
                obj for obj in ordering
                if NMS_THRESHOLD == 1 or compute_iou(bbox[index][max_obj], bbox[index][obj]) < NMS_THRESHOLD  # noqa: E501
            ]  # fmt: skip
        if not detected[classname]:
            del detected[classname]
    # Evaluate
    return evaluate(None, detected, metadata)


def reference_decide(dets, metadata, colour_fn, options):
    """The transcription on ``dets`` (class -> float32 [N, 5]) with the evaluator's options."""
    global COLOR_FN, THRESHOLD, COUNTING_THRESHOLD, MAX_OBJECTS, NMS_THRESHOLD, POSITION_THRESHOLD
    COLOR_FN = colour_fn
    THRESHOLD = options["threshold"]
    COUNTING_THRESHOLD = options["counting_threshold"]
    MAX_OBJECTS = options["max_objects"]
    NMS_THRESHOLD = options["max_overlap"]
    POSITION_THRESHOLD = options["position_threshold"]
    classnames = list(dets)
    return evaluate_image([dets[c] for c in classnames], None, classnames, metadata)
