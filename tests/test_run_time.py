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
    assert math.isnan(p["probes"]) and math.isnan(p["in-run evals"])  # untimed: in the rest
    assert math.isclose(p["rest"], 60.0 - 30.0 - 5.0 - 4.0)
    timed = {**_record("a", 60.0, 5.0), "in_run_eval_seconds": 6.0, "probe_seconds": 2.5}
    q = rt.parts(timed)
    assert math.isclose(q["rest"], 60.0 - 30.0 - 5.0 - 4.0 - 6.0 - 2.5)
    assert math.isclose(sum(q[k] for k in rt.PARTS), q["wall"])


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
    assert "| a | run | 3 | 60 | 10 (17%) | 15 (25%) | 5 (8%) | 5 (8%) | - | - | 4 (7%) |" in md


def test_a_runs_rows_time_its_in_run_evaluations(tmp_path, monkeypatch):
    """The rows a step evaluated the held-out prompts on carry ``time/eval`` (what the lab sums
    into ``in_run_eval_seconds``); the other rows do not."""
    from tiny_runs import NO_GRIDS, tiny_toy

    from maskgrpo_ray.cli import main

    monkeypatch.setenv("MASKGRPO_CACHE_DIR", str(tmp_path / "cache"))
    run = tmp_path / "run"
    args = ["train", "--backend", "local", "--run-dir", str(run)]
    for s in tiny_toy(4, 2, NO_GRIDS, "eval.every_steps=2", "run.export_final_policy=false"):
        args += ["--set", s]
    assert main(args) == 0
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    timed = [r["step"] for r in rows if "time/eval" in r]
    assert timed == [r["step"] for r in rows if "eval_accuracy" in r or "eval_reward" in r] == [1]
    assert all(r["time/eval"] > 0 for r in rows if "time/eval" in r)
