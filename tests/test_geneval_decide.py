"""GenEval's rule, exact (:func:`maskgrpo_ray.evaluation.geneval.decide`): the official
evaluator's box selection and ``evaluate`` (djghosh13/geneval ``evaluation/evaluate_images.py``),
edge case by edge case with the derivation from its text, then differentially against a
transcription of that text (``tests/geneval_transcription.py``, clearly labelled, NumPy as the
original) on random detections."""

from __future__ import annotations

import numpy as np
import pytest
from geneval_transcription import reference_decide

from maskgrpo_ray.evaluation.geneval import (
    COLORS,
    GenEvalRuleError,
    decide,
    relative_position,
    rule_options,
    select_boxes,
)


def colour_at(box) -> str:
    """A stand-in colour classifier: the colour named by the box's 6th field."""
    return box[5]


def recording(calls: list):
    def fn(classname, boxes):
        calls.append((classname, list(boxes)))
        return [colour_at(b) for b in boxes]

    return fn


def meta(tag="single_object", include=(), exclude=None):
    out = {"tag": tag, "include": [dict(c) for c in include], "prompt": "p"}
    if exclude is not None:
        out["exclude"] = [dict(c) for c in exclude]
    return out


DOG1 = [{"class": "dog", "count": 1}]


# ----------------------------------------------------------------------------- box selection


def test_threshold_is_strictly_greater():
    # `bbox[ordering, 4] > confidence_threshold`: a score of exactly 0.3 is dropped, and the
    # include then finds 0 of 1 -> "expected dog>=1, found 0"
    assert decide({"dog": [(0, 0, 9, 9, 0.3)]}, meta(include=DOG1), None) == (
        False,
        "expected dog>=1, found 0",
    )
    assert decide({"dog": [(0, 0, 9, 9, 0.30001)]}, meta(include=DOG1), None) == (True, "")
    # float32 scores compare in float32 (NumPy compares a float32 array with a Python float in
    # float32): float32(0.3) is not > float32(0.3), though it is 0.30000001192 > 0.3 in float64
    f32 = np.array([[0, 0, 9, 9, 0.3]], dtype=np.float32)
    assert decide({"dog": f32}, meta(include=DOG1), None)[0] is False
    f64 = np.array([[0, 0, 9, 9, np.float32(0.3)]], dtype=np.float64)
    assert decide({"dog": f64}, meta(include=DOG1), None)[0] is True


def test_counting_tag_uses_the_counting_threshold():
    # tag "counting" keeps scores > 0.9 only: of 0.95, 0.9, 0.5 one box is kept, so
    # "two dogs" fails with found 1; any other tag keeps all three (> 0.3)
    boxes = {"dog": [(0, 0, 9, 9, 0.95), (20, 0, 29, 9, 0.9), (40, 0, 49, 9, 0.5)]}
    two = [{"class": "dog", "count": 2}]
    assert decide(boxes, meta("counting", two), None) == (False, "expected dog>=2, found 1")
    assert decide(boxes, meta("two_object", two), None) == (True, "")
    assert decide(boxes, meta("counting", two), None, counting_threshold=0.4)[0] is True


def test_colour_judged_on_the_count_most_confident_in_score_order():
    # boxes given out of order: scores 0.4 (blue), 0.8 (red), 0.6 (red). The 1 most confident
    # is the 0.8 one (red): "a red dog" holds although a blue dog is also there; the colour
    # classifier sees that box only. "a blue dog" fails on it: found 0 blue; and 1 red
    boxes = {
        "dog": [
            (0, 0, 9, 9, 0.4, "blue"),
            (20, 0, 29, 9, 0.8, "red"),
            (40, 0, 49, 9, 0.6, "red"),
        ]
    }
    calls: list = []
    red = [{"class": "dog", "count": 1, "color": "red"}]
    assert decide(boxes, meta("colors", red), recording(calls)) == (True, "")
    assert calls == [("dog", [boxes["dog"][1]])]  # the very object given, most confident first
    blue = [{"class": "dog", "count": 1, "color": "blue"}]
    assert decide(boxes, meta("colors", blue), recording(calls)) == (
        False,
        "expected blue dog>=1, found 0 blue; and 1 red",
    )
    # count 2: the two most confident, 0.8 and 0.6, both red, passed in that order
    calls.clear()
    red2 = [{"class": "dog", "count": 2, "color": "red"}]
    assert decide(boxes, meta("colors", red2), recording(calls)) == (True, "")
    assert calls == [("dog", [boxes["dog"][1], boxes["dog"][2]])]


def test_colour_reason_lists_the_found_colours_in_the_evaluators_order():
    # "; and " + counts of every colour of COLORS present, in COLORS order (white after red)
    boxes = {"cat": [(0, 0, 9, 9, 0.9, "white"), (20, 0, 29, 9, 0.8, "red")]}
    green = [{"class": "cat", "count": 2, "color": "green"}]
    assert decide(boxes, meta("colors", green), lambda c, b: [x[5] for x in b]) == (
        False,
        "expected green cat>=2, found 0 green; and 1 red, 1 white",
    )
    assert COLORS.index("red") < COLORS.index("white")


def test_colour_fn_not_called_when_the_count_fails():
    calls: list = []
    red2 = [{"class": "dog", "count": 2, "color": "red"}]
    got = decide({"dog": [(0, 0, 9, 9, 0.8, "red")]}, meta("colors", red2), recording(calls))
    assert got == (False, "expected dog>=2, found 1") and calls == []


def test_ties_follow_numpys_argsort_of_the_same_array():
    # equal scores: the order is np.argsort(scores)[::-1] of that very array; the colour
    # clause sees the first `count` of it
    boxes = [(i * 20, 0, i * 20 + 9, 9, 0.5, COLORS[i]) for i in range(5)]
    first = int(np.argsort(np.array([0.5] * 5))[::-1][0])
    calls: list = []
    one = [{"class": "dog", "count": 1, "color": COLORS[first]}]
    assert decide({"dog": boxes}, meta("colors", one), recording(calls)) == (True, "")
    assert calls == [("dog", [boxes[first]])]


def test_max_objects_cuts_after_the_threshold_before_nms():
    # 20 boxes: 4 at 0.1 (dropped by the threshold), 16 at 0.5..0.95; MAX_OBJECTS keeps the 16
    # most confident above the threshold, so an exclude of 16 fails with found 16 (not 20),
    # and with max_objects=3 a "four dogs" include finds 3
    boxes = [(i * 20, 0, i * 20 + 9, 9, 0.1) for i in range(4)]
    boxes += [(i * 20, 30, i * 20 + 9, 39, 0.5 + 0.03 * i) for i in range(16)]
    ex = meta("two_object", DOG1, exclude=[{"class": "dog", "count": 16}])
    assert decide({"dog": boxes}, ex, None) == (
        False,
        "expected dog<16, found 16",
    )
    four = [{"class": "dog", "count": 4}]
    assert decide({"dog": boxes}, meta("two_object", four), None, max_objects=3) == (
        False,
        "expected dog>=4, found 3",
    )
    # the cut comes before NMS: of 3 kept, two overlap; NMS (max_overlap 0.5) then drops one,
    # leaving 2 -- it does not refill from the boxes past max_objects
    same = [(0, 0, 9, 9, 0.9), (0, 0, 9, 9, 0.8), (50, 50, 59, 59, 0.7), (80, 0, 89, 9, 0.6)]
    got = select_boxes({"dog": same}, "two_object", max_objects=3, max_overlap=0.5)
    assert got == {"dog": [same[0], same[2]]}


def test_nms_is_off_by_default_and_greedy_when_enabled():
    # default max_overlap 1.0: two identical boxes both stay (IoU 1 is never < 1, but the
    # evaluator skips the test when NMS_THRESHOLD == 1)
    twin = [(0, 0, 9, 9, 0.9), (0, 0, 9, 9, 0.8)]
    assert select_boxes({"dog": twin}, "two_object") == {"dog": twin}
    # enabled, IoU with the evaluator's +1 areas: A = [0,0,9,9] (100 px), B = [5,0,14,9]
    # (100 px) overlap [5,0,9,9] = 5 x 10 = 50 px, IoU = 50 / 150 = 1/3. Kept when 1/3 < t
    a, b = (0, 0, 9, 9, 0.9), (5, 0, 14, 9, 0.8)
    assert select_boxes({"dog": [b, a]}, "two_object", max_overlap=0.34) == {"dog": [a, b]}
    assert select_boxes({"dog": [b, a]}, "two_object", max_overlap=0.33) == {"dog": [a]}
    # greedy: C = [10,0,19,9] overlaps B by 1/3 and A not at all; at 0.3, A drops B, C stays
    c = (10, 0, 19, 9, 0.7)
    assert select_boxes({"dog": [a, b, c]}, "two_object", max_overlap=0.3) == {"dog": [a, c]}


# ----------------------------------------------------------------------------- position


def test_position_dead_zone_gives_no_relation_and_fails():
    # A = [0,0,10,10], B = [11,0,21,10]: centre offset x = 5 - 16 = -11, sizes 10 + 10,
    # dead zone 0.1 * 20 = 2 -> revised -9; y offset 0. dx = -9 / 11 = -0.82 < -0.5: left of
    assert relative_position((0, 0, 10, 10), (11, 0, 21, 10)) == {"left of"}
    # B = [1,0,11,10]: offset -1, |offset| - 2 < 0 -> 0 on both axes: no relation at all
    assert relative_position((0, 0, 10, 10), (1, 0, 11, 10)) == set()
    # so "a cat left of a dog" fails with the empty relation set in the reason
    dets = {"dog": [(1, 0, 11, 10, 0.9)], "cat": [(0, 0, 10, 10, 0.9)]}
    inc = [{"class": "dog", "count": 1}, {"class": "cat", "count": 1, "position": ["left of", 0]}]
    assert decide(dets, meta("position", inc), None) == (
        False,
        "expected cat left of target, found  target",
    )


def test_position_direction_cut_and_diagonals():
    # offset (-20, -20), sizes 10 + 10 each axis, dead zone 2: revised (-18, -18) / 28.28 =
    # -0.636 on both axes: left of AND above
    assert relative_position((0, 0, 10, 10), (20, 20, 30, 30)) == {"left of", "above"}
    # offset (-20, -8): revised (-18, -6) / 21.54 = (-0.836, -0.279): left of only
    assert relative_position((0, 0, 10, 10), (20, 8, 30, 18)) == {"left of"}
    # offset (-12, -12): revised (-10, -10) / 16.97 = -0.589 each: both; with position
    # threshold 0.2 (dead zone 4): (-8, -8) / 16.97 = -0.471: neither passes 0.5, yet not
    # under 1e-3: no relation
    assert relative_position((0, 0, 10, 10), (12, 12, 22, 22)) == {"left of", "above"}
    assert relative_position((0, 0, 10, 10), (12, 12, 22, 22), 0.2) == set()
    dets = {"dog": [(12, 12, 22, 22, 0.9)], "cat": [(0, 0, 10, 10, 0.9)]}
    inc = [{"class": "dog", "count": 1}, {"class": "cat", "count": 1, "position": ["above", 0]}]
    assert decide(dets, meta("position", inc), None) == (True, "")
    assert decide(dets, meta("position", inc), None, position_threshold=0.2)[0] is False


def test_position_cut_is_strict_and_the_1e3_test_applies_to_the_shrunk_offset():
    # A = [0,0,10,10], B = [4,0,14,10]: offset (-4, 0), dead zone 0.1 * 20 = 2, revised (-2, 0),
    # dx = -2 / 4 = -0.5 exactly: not < -0.5, so no relation
    assert relative_position((0, 0, 10, 10), (4, 0, 14, 10)) == set()
    assert relative_position((0, 0, 10, 10), (4.01, 0, 14.01, 10)) == {"left of"}
    # zero-size boxes (no dead zone): an offset of 5e-4 is under 1e-3 -> no relation, though
    # its direction is exactly "right of"; 2e-3 -> right of
    assert relative_position((5.0005, 5, 5.0005, 5), (5, 5, 5, 5)) == set()
    assert relative_position((5.002, 5, 5.002, 5), (5, 5, 5, 5)) == {"right of"}


def test_position_without_target_group():
    # the target include failed (no dog) -> its group is None -> "no target ..." after the
    # dog's own reason, joined by a newline
    inc = [{"class": "dog", "count": 1}, {"class": "cat", "count": 1, "position": ["left of", 0]}]
    got = decide({"cat": [(0, 0, 10, 10, 0.9)]}, meta("position", inc), None)
    assert got == (False, "expected dog>=1, found 0\nno target for cat to be left of")


def test_relation_against_every_object_of_the_target_group():
    # two dogs (count 2) at x 40 and x 0; the cat at x 20 is right of the dog at 0 but left of
    # the one at 40: "right of" must hold against both, so it fails on the first target (the
    # more confident dog, at 40): found "left of"
    dets = {
        "dog": [(0, 0, 10, 10, 0.8), (40, 0, 50, 10, 0.9)],
        "cat": [(20, 0, 30, 10, 0.9)],
    }
    inc = [{"class": "dog", "count": 2}, {"class": "cat", "count": 1, "position": ["right of", 0]}]
    assert decide(dets, meta("position", inc), None) == (
        False,
        "expected cat right of target, found left of target",
    )
    # a third dog below the threshold is not in the group: with only the dog at 0 kept, holds
    dets["dog"][1] = (40, 0, 50, 10, 0.2)
    inc[0]["count"] = 1
    assert decide(dets, meta("position", inc), None) == (True, "")


def test_exclude_counts_every_kept_detection():
    # exclude {dog, 3}: fails when 3 or more dogs are kept (>=), whatever the include asks
    dets = {"dog": [(i * 20, 0, i * 20 + 9, 9, 0.95) for i in range(3)]}
    ex = meta("counting", [{"class": "dog", "count": 2}], exclude=[{"class": "dog", "count": 3}])
    assert decide(dets, ex, None) == (False, "expected dog<3, found 3")
    dets["dog"][2] = (40, 0, 49, 9, 0.5)  # under the counting threshold: 2 kept
    assert decide(dets, ex, None) == (True, "")


def test_missing_include_and_multi_line_reason():
    # no 'include': metadata.get('include', []) -> only the excludes decide
    assert decide({}, {"tag": "single_object", "prompt": "p"}, None) == (True, "")
    # every failing clause adds a line, in clause order, includes before excludes
    dets = {"dog": [(0, 0, 9, 9, 0.9), (20, 0, 29, 9, 0.9)], "cat": []}
    m = meta(
        "two_object",
        [{"class": "cat", "count": 1}, {"class": "bird", "count": 2}],
        exclude=[{"class": "dog", "count": 1}],
    )
    assert decide(dets, m, None) == (
        False,
        "expected cat>=1, found 0\nexpected bird>=2, found 0\nexpected dog<1, found 2",
    )


def test_failures_where_the_evaluator_raises():
    with pytest.raises(GenEvalRuleError, match="'tag'"):
        decide({}, {"include": DOG1}, None)
    bad = [{"class": "cat", "count": 1, "position": ["left of", 1]}]
    with pytest.raises(GenEvalRuleError, match="IndexError"):
        decide({"cat": [(0, 0, 9, 9, 0.9)]}, meta("position", bad), None)
    with pytest.raises(GenEvalRuleError, match="one colour name per box"):
        red = meta("colors", [DOG1[0] | {"color": "red"}])
        decide({"dog": [(0, 0, 9, 9, 0.9)]}, red, lambda c, b: [])
    with pytest.raises(GenEvalRuleError, match="detections\\['dog'\\]"):
        decide({"dog": [(0, 0, 9)]}, meta(include=DOG1), None)


def test_rule_options_parse_as_the_evaluator():
    assert rule_options({}) == {
        "threshold": 0.3,
        "counting_threshold": 0.9,
        "max_objects": 16,
        "max_overlap": 1.0,
        "position_threshold": 0.1,
    }
    assert rule_options({"max_overlap": "0.5", "max_objects": "8"})["max_overlap"] == 0.5


# ----------------------------------------------------------------------------- differential


def random_case(rng: np.random.Generator, tag: str):
    """Random raw detections over three classes (float32 arrays as mmdetection gives, scores on
    a coarse grid so ties and the exact thresholds occur) and a metadata line of ``tag``."""
    classes = ["cat", "dog", "bird"]
    grid = np.array([0.2, 0.3, 0.5, 0.7, 0.9, 0.95, 1.0], dtype=np.float32)
    dets = {}
    for c in classes:
        n = int(rng.choice([0, 1, 2, 3, 5, 8, 20], p=[0.15, 0.25, 0.2, 0.15, 0.1, 0.1, 0.05]))
        x0 = rng.integers(0, 480, n)
        y0 = rng.integers(0, 480, n)
        w, h = rng.integers(4, 120, n), rng.integers(4, 120, n)
        score = grid[rng.integers(len(grid), size=n)] if rng.random() < 0.7 else rng.random(n)
        arr = np.stack([x0, y0, x0 + w, y0 + h, score], axis=1).astype(np.float32)
        dets[c] = arr.reshape(n, 5)
    for arr in dets.values():  # overlapping neighbours, for NMS: shifted copies
        for i in range(1, len(arr)):
            if rng.random() < 0.5:
                shift = rng.integers(0, arr[i - 1, 2] - arr[i - 1, 0] + 2)
                arr[i, :4] = arr[i - 1, :4] + np.array([shift, 0, shift, 0], dtype=np.float32)
    a, b = rng.choice(classes, 2, replace=False).tolist()
    if tag == "position" and len(dets[a]) and len(dets[b]) and rng.random() < 0.4:
        edge_case(rng, dets[a], dets[b])
    col = lambda: str(rng.choice(COLORS[:3]))  # noqa: E731  (few colours: both outcomes occur)
    n = int(rng.integers(1, 5))
    rel = str(rng.choice(["left of", "right of", "above", "below"]))
    include = {
        "single_object": [{"class": a, "count": 1}],
        "two_object": [{"class": a, "count": 1}, {"class": b, "count": 1}],
        "counting": [{"class": a, "count": n}],
        "colors": [{"class": a, "count": 1, "color": col()}],
        "position": [
            {"class": b, "count": int(rng.integers(1, 3))},
            {"class": a, "count": int(rng.integers(1, 3)), "position": [rel, 0]},
        ],
        "color_attr": [
            {"class": a, "count": 1, "color": col()},
            {"class": b, "count": int(rng.integers(1, 3)), "color": col()},
        ],
    }[tag]
    exclude = [{"class": a, "count": n + 1}] if tag == "counting" else None
    return dets, meta(tag, include, exclude)


def edge_case(rng: np.random.Generator, obj: np.ndarray, target: np.ndarray) -> None:
    """Move ``obj``'s boxes onto the relation's edges against ``target``'s first box: a centre
    offset on one axis of exactly twice the dead zone (a direction of exactly 0.5), the dead
    zone plus under or over 1e-3, or zero-size boxes 5e-4 to 2e-3 apart."""
    t = target[0].astype(np.float64)
    for row in obj:
        w, h = row[2] - row[0], row[3] - row[1]
        zone = 0.1 * (w + (t[2] - t[0]))
        shift = float(rng.choice([2 * zone, zone + 5e-4, zone + 2e-3, zone, -2 * zone]))
        cx, cy = (t[0] + t[2]) / 2 + shift, (t[1] + t[3]) / 2 + float(rng.choice([0, 1e-4, 3]))
        if rng.random() < 0.2:  # zero-size boxes
            x = t[0] + float(rng.choice([5e-4, 8e-4, 2e-3]))
            row[:4] = [x, t[1], x, t[1]]
            target[0, :4] = [t[0], t[1], t[0], t[1]]
            continue
        row[:4] = [cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2]


def colour_of(box) -> str:
    """A deterministic colour classifier of a box's numbers (the same for both sides)."""
    return COLORS[int(box[0] + 3 * box[1]) % 3]


@pytest.mark.parametrize(
    "tag", ["single_object", "two_object", "counting", "colors", "position", "color_attr"]
)
def test_decide_equals_the_transcribed_evaluator(tag):
    # 3000 random cases per tag, a third with NMS on and fewer objects, a third with no dead
    # zone and a higher threshold; every other case passes the boxes as tuples of float32
    # numbers carrying a mask object after the score (what a scorer gives): decide must return
    # the transcription's (correct, reason) and call the colour function on the same boxes in
    # the same order (on the caller's very objects)
    rng = np.random.default_rng(sorted(TAGS).index(tag))
    outcomes = [0, 0]
    for k in range(3000):
        dets, m = random_case(rng, tag)
        nms = {"max_overlap": float(rng.choice([0.3, 0.5, 0.75])), "max_objects": 4}
        opts: dict = [{}, nms, {"position_threshold": 0.0}][k % 3]
        given: dict = dets
        if k % 2:
            given = {c: [(*a, f"mask{c}{i}") for i, a in enumerate(arr)] for c, arr in dets.items()}
        mine: list = []
        theirs: list = []

        def fn(c, boxes, log=mine, odd=k % 2):
            log.append((c, [tuple(float(v) for v in b[:5]) for b in boxes]))
            if odd:
                assert all(isinstance(b, tuple) and b[5].startswith(f"mask{c}") for b in boxes)
            return [colour_of(b) for b in boxes]

        def ref_fn(c, boxes, log=theirs):
            log.append((c, [tuple(float(v) for v in b[:5]) for b in boxes]))
            return [colour_of(b) for b in boxes]

        got = decide(given, m, fn, **opts)
        want = reference_decide(dets, m, ref_fn, rule_options({k: str(v) for k, v in opts.items()}))
        assert got == want and mine == theirs, (k, dets, m, opts, got, want)
        assert isinstance(got[0], bool) and isinstance(got[1], str)
        outcomes[got[0]] += 1
    # both outcomes occur often enough for the comparison to mean something
    assert min(outcomes) > 100, outcomes


TAGS = ("single_object", "two_object", "counting", "colors", "position", "color_attr")
