"""bench/run_time.py: a record's wall time split into its parts, the base evaluation read as
run or reused, medians per recipe."""

from __future__ import annotations

import json
import math


def _record(variant: str, wall: float, base_eval: float) -> dict:
    return {
        "variant": variant,
        "steps": 10,
        "config": "configs/other.yaml",  # not the recipe sweep's: named as recorded
        "wall_seconds": wall,
        "step_seconds": 3.0,
        "generate_seconds": 1.0,
        "update_seconds": 1.5,
        "base_eval_seconds": base_eval,
        "final_eval_seconds": 4.0,
    }


def test_a_runs_wall_time_splits_into_parts_that_add_up():
    from bench import run_time as rt

    p = rt.parts(_record("a", 60.0, 5.0))
    assert (p["generate"], p["update"], p["step other"]) == (10.0, 15.0, 5.0)
    assert math.isclose(p["rest"], 60.0 - 30.0 - 5.0 - 4.0)
    assert math.isclose(sum(p[k] for k in rt.PARTS), p["wall"])


def test_recipes_are_grouped_by_whether_the_base_evaluation_ran_and_take_medians(tmp_path):
    from bench import run_time as rt

    recs = [_record("a", w, 5.0) for w in (50.0, 60.0, 90.0)] + [_record("a", 40.0, 0.002)]
    recs.append({"variant": "old", "steps": 10, "config": "configs/other.yaml"})  # untimed
    for i, r in enumerate(recs):
        (tmp_path / f"k{i}.json").write_text(json.dumps(r))
    rows = rt.table(rt.load(10, "configs/other.yaml", tmp_path))
    assert [(r["variant"], r["base_eval"], r["runs"]) for r in rows] == [
        ("a", "run", 3),
        ("a", "reused", 1),
    ]
    assert rows[0]["wall"] == 60.0 and rows[0]["base eval"] == 5.0
    md = rt.markdown(rows)
    assert "| a | run | 3 | 60 | 10 (17%) | 15 (25%) |" in md
