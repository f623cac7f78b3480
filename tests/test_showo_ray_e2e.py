"""A tiny random Show-o (the real classes) through the whole Ray system on the CPU."""

from __future__ import annotations

import json

import pytest

from maskgrpo_ray.cli import main


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_tiny_random_showo_runs_through_the_ray_system(tmp_path, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    run = tmp_path / "run"
    code = main(
        [
            "train",
            "--config",
            "configs/showo_tiny_random.yaml",
            "--run-dir",
            str(run),
            "--set",
            "logging.progress_bar=false",
        ]
    )
    assert code == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["backend"] == "ray" and summary["policy_version"] == 2
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    assert all(r["groups_trained"] > 0 and r["rollout_actors"] == 1 for r in rows)
    assert (run / "samples" / "step_000000.png").exists()
