"""Checkpoints are atomic and retained; an interrupted run resumes to the same metrics."""

from __future__ import annotations

import json

import pytest

from maskgrpo_ray.checkpoint import latest_checkpoint, save_checkpoint
from maskgrpo_ray.cli import main
from maskgrpo_ray.step import driver

SMALL = [
    "model.toy.pretrain_steps=20",
    "train.steps=6",
    "train.prompts_per_step=3",
    "rollout.unmasking_steps=4",
    "eval.samples_per_prompt=1",
    "filter.warmup_groups=2",
    "run.checkpoint_every_steps=2",
    "run.keep_checkpoints=2",
    "logging.progress_bar=false",
]
COMPARED = (
    "reward_mean",
    "reward_std",
    "accuracy",
    "loss",
    "ratio_mean",
    "grad_norm",
    "groups_dropped",
    "filter_threshold",
    "policy_version",
    "learning_rate",
)


def _args(run, backend="local"):
    out = ["train", "--backend", backend, "--run-dir", str(run)]
    for s in SMALL:
        out += ["--set", s]
    return out


def _rows(run):
    return {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


def test_interrupted_run_resumes_to_identical_metrics(tmp_path, monkeypatch):
    monkeypatch.setenv("MASKGRPO_CACHE_DIR", str(tmp_path / "cache"))
    full, cut = tmp_path / "full", tmp_path / "cut"
    assert main(_args(full)) == 0

    real_run_step = driver.run_step

    def crashing(ex, cfg, step, *args, **kw):
        if step == 5:  # after the checkpoint taken at the end of step 3 (next_step = 4)
            raise KeyboardInterrupt("simulated preemption")
        return real_run_step(ex, cfg, step, *args, **kw)

    monkeypatch.setattr(driver, "run_step", crashing)
    with pytest.raises(KeyboardInterrupt):
        main(_args(cut))
    monkeypatch.setattr(driver, "run_step", real_run_step)
    assert latest_checkpoint(cut).name == "step_000004"
    assert sorted(_rows(cut)) == [0, 1, 2, 3, 4]  # step 4 ran but is after the checkpoint
    assert main(["train", "--resume", str(cut)]) == 0
    a, b = _rows(full), _rows(cut)
    assert sorted(b) == list(range(6))
    for step in range(6):
        for key in COMPARED:
            assert a[step].get(key) == pytest.approx(b[step].get(key), rel=1e-6, abs=1e-7), (
                step,
                key,
            )
    # retention: only the newest two checkpoints are kept
    kept = sorted(p.name for p in (cut / "checkpoints").glob("step_*"))
    assert kept == ["step_000004", "step_000006"]
    summary = json.loads((cut / "summary.json").read_text())
    assert summary["start_step"] == 4 and summary["base_accuracy"] is not None


def test_crash_while_writing_keeps_previous_latest(tmp_path):
    save_checkpoint(tmp_path, 1, lambda d: (d / "a.txt").write_text("one"), keep=3)

    def broken(folder):
        (folder / "a.txt").write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError):
        save_checkpoint(tmp_path, 2, broken, keep=3)
    latest = latest_checkpoint(tmp_path)
    assert latest.name == "step_000001" and (latest / "a.txt").read_text() == "one"


def test_resume_without_checkpoint_is_a_clear_error(tmp_path, capsys):
    assert main(["train", "--resume", str(tmp_path)]) == 2
    assert "no complete checkpoint" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.ci
@pytest.mark.timeout(900)
def test_ray_backend_resumes_to_identical_metrics(tmp_path, monkeypatch):
    """The same drill on the Ray backend: DeepSpeed checkpoint per learner rank, filter actor
    state, policy version; each `main` starts and stops its own local cluster."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    extra = [
        "--set",
        "rollout.num_actors=1",
        "--set",
        "learner.num_workers=1",
        "--set",
        "train.steps=4",
        "--set",
        "rollout.num_cpus_per_actor=0.25",
        "--set",
        "reward.num_cpus_per_actor=0.25",
        "--set",
        "learner.num_cpus_per_worker=0.25",
    ]
    full, cut = tmp_path / "full", tmp_path / "cut"
    assert main(_args(full, "ray") + extra) == 0
    real_run_step = driver.run_step

    def crashing(ex, cfg, step, *args, **kw):
        if step == 3:
            raise KeyboardInterrupt("simulated preemption")
        return real_run_step(ex, cfg, step, *args, **kw)

    monkeypatch.setattr(driver, "run_step", crashing)
    with pytest.raises(KeyboardInterrupt):
        main(_args(cut, "ray") + extra)
    monkeypatch.setattr(driver, "run_step", real_run_step)
    assert latest_checkpoint(cut).name == "step_000002"
    assert main(["train", "--resume", str(cut)]) == 0
    a, b = _rows(full), _rows(cut)
    assert sorted(b) == [0, 1, 2, 3]
    for step in range(4):
        for key in COMPARED:
            assert a[step].get(key) == pytest.approx(b[step].get(key), rel=1e-5, abs=1e-6), (
                step,
                key,
            )
