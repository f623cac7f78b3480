"""``eval.reuse_base_evaluation``: a batch of recipes on one seed evaluates the base once.

The second run with the same base, settings and seed reads the first's base evaluation and its
step-0 monitor probe (and says so in the log); a run with another seed or another evaluation setting evaluates again;
and what a run learns is the same with and without the reuse (its training rows equal)."""

from __future__ import annotations

import json
import logging

import pytest
from tiny_runs import NO_GRIDS, tiny_toy

from maskgrpo_ray.cli import main
from maskgrpo_ray.loop import held_out as base_eval

STEPS = tiny_toy(3, 2, NO_GRIDS, "eval.every_steps=0", "run.export_final_policy=false")
SKIP = ("time/", "step_seconds", "samples_per_second", "learner_busy_fraction", "bytes/")


def _train(run, *extra):
    args = ["train", "--backend", "local", "--run-dir", str(run)]
    for s in [*STEPS, *extra]:
        args += ["--set", s]
    assert main(args) == 0
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run / "summary.json").read_text())
    return [{k: v for k, v in r.items() if not k.startswith(SKIP)} for r in rows], summary


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MASKGRPO_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "base_eval"


def test_the_second_run_reuses_and_learns_the_same(tmp_path, cache, caplog, monkeypatch):
    plain_rows, plain = _train(tmp_path / "plain")
    assert not cache.exists()  # off by default: nothing kept
    hashed = []
    digest = base_eval.weights_digest
    monkeypatch.setattr(base_eval, "weights_digest", lambda s: hashed.append(1) or digest(s))
    first_rows, first = _train(tmp_path / "a", "eval.reuse_base_evaluation=true")
    assert len(hashed) == 1  # the evaluation's key and the probe's share one digest
    assert len(list(cache.glob("probe-*.json"))) == 1  # the monitors' probe of the base
    assert len(list(cache.glob("*.json"))) == 2
    caplog.set_level(logging.INFO, logger=base_eval.__name__)
    second_rows, second = _train(tmp_path / "b", "eval.reuse_base_evaluation=true")
    said = [r.getMessage() for r in caplog.records]
    assert any("held-out evaluation reused" in m for m in said)
    assert any("monitor probe reused" in m for m in said)
    assert second["base_eval"] == first["base_eval"] == plain["base_eval"]
    # the summary says which run read them back (the lab's records carry it, bench/run_time.py)
    assert (plain["base_eval_reused"], plain["probe_reused"]) == (False, False)
    assert (first["base_eval_reused"], first["probe_reused"]) == (False, False)
    assert (second["base_eval_reused"], second["probe_reused"]) == (True, True)
    # the evaluation draws from its own seeded generators: the training is untouched, and the
    # probe read back is the probe drawn (its figures, the base's standard errors among them)
    assert any(k.startswith("probe/se/") for k in second_rows[0])
    assert plain_rows == first_rows == second_rows
    assert second["final_eval"] == plain["final_eval"]


def test_another_seed_or_evaluation_setting_evaluates_again(tmp_path, cache):
    _train(tmp_path / "a", "eval.reuse_base_evaluation=true")
    _train(tmp_path / "b", "eval.reuse_base_evaluation=true", "run.seed=1")
    _train(tmp_path / "c", "eval.reuse_base_evaluation=true", "eval.samples_per_prompt=2")
    assert len(list(cache.glob("*.json"))) == 3 * 2
    # the probe's own settings: a new probe, the held-out evaluation reused
    _train(tmp_path / "d", "eval.reuse_base_evaluation=true", "logging.monitors.probe_prompts=4")
    assert len(list(cache.glob("probe-*.json"))) == 4
    assert len(list(cache.glob("*.json"))) == 3 * 2 + 1


def test_the_key_sees_the_weights():
    import torch

    a = {"w": torch.zeros(3)}
    b = {"w": torch.tensor([0.0, 0.0, 1e-7])}
    assert base_eval.weights_digest(a) != base_eval.weights_digest(b)
    assert base_eval.weights_digest(a) == base_eval.weights_digest({"w": torch.zeros(3)})
