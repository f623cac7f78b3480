"""SIGTERM to a training driver: a checkpoint, exit 0 within the grace period, and the same
command run again finishes the run with every step logged once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from maskgrpo_ray.checkpoint import latest_checkpoint
from maskgrpo_ray.step.recovery import Preemption, StepAbandoned

STEPS = 12
GRACE_S = 20.0
SMALL = [
    "model.toy.pretrain_steps=20",
    f"train.steps={STEPS}",
    "train.prompts_per_step=3",
    "rollout.unmasking_steps=4",
    "eval.samples_per_prompt=1",
    "filter.warmup_groups=2",
    "run.checkpoint_every_steps=0",  # the only checkpoint is the one the signal makes
    f"run.preemption_grace_seconds={GRACE_S}",
    "logging.progress_bar=false",
]


def _command(run: Path) -> list[str]:
    out = [sys.executable, "-m", "maskgrpo_ray.cli", "train", "--backend", "local"]
    out += ["--run-dir", str(run)]
    for s in SMALL:
        out += ["--set", s]
    return out


def _steps(run: Path) -> list[int]:
    return [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.timeout(600)
def test_sigterm_checkpoints_exits_zero_and_the_same_command_resumes(tmp_path):
    run = tmp_path / "run"
    env = {**os.environ, "MASKGRPO_CACHE_DIR": str(tmp_path / "cache")}
    log_path = tmp_path / "first.log"
    with log_path.open("w") as log_file:
        proc = subprocess.Popen(_command(run), env=env, stdout=log_file, stderr=subprocess.STDOUT)
        metrics = run / "metrics.jsonl"
        deadline = time.monotonic() + 300
        while not (metrics.exists() and metrics.read_text().strip()):
            assert proc.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, "no metrics line within 300 s"
            time.sleep(0.05)
        t_signal = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=GRACE_S + 30)
        took = time.monotonic() - t_signal
    out = log_path.read_text()
    assert rc == 0, out
    assert took < GRACE_S, (took, out)
    assert "SIGTERM received" in out
    done = _steps(run)
    assert 1 <= len(done) < STEPS, "the run should have been stopped mid-way"
    assert done == list(range(len(done)))
    ck = latest_checkpoint(run)
    assert ck is not None and ck.name == f"step_{len(done):06d}", (ck, done)
    assert (ck / "manifest.json").exists()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["completed"] is False and summary["stopped_by"] == "SIGTERM"
    assert summary["steps_done"] == summary["resume_step"] == len(done)

    again = subprocess.run(
        _command(run), env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"from checkpoint step_{len(done):06d}" in again.stderr
    assert _steps(run) == list(range(STEPS))  # each step exactly once, in order
    summary = json.loads((run / "summary.json").read_text())
    assert summary["completed"] is True and summary["start_step"] == len(done)
    print(f"SIGTERM to exit: {took:.2f} s; stopped after {len(done)} of {STEPS} steps")


def test_a_step_that_would_overrun_the_grace_period_is_abandoned():
    """A signal in a step with no time to finish it: StepAbandoned from the alarm, about when
    the grace period minus the checkpoint reserve runs out, and the handlers come back."""
    before = signal.getsignal(signal.SIGTERM)
    stop = Preemption(grace_s=1.0)
    stop.save_s = 0.2  # reserve = 0.2 * 1.5 + min(5, 0.1) = 0.4 s: abandon at about 0.6 s
    assert stop.install()
    try:
        t0 = time.monotonic()
        with pytest.raises(StepAbandoned), stop.step():
            os.kill(os.getpid(), signal.SIGTERM)
            while time.monotonic() - t0 < 10:  # a step that would take 10 s
                time.sleep(0.01)
        took = time.monotonic() - t0
    finally:
        stop.uninstall()
    assert stop.requested and stop.signal_name == "SIGTERM"
    assert 0.5 < took < 2.0, took  # the alarm fires at 0.6 s; slack for a loaded machine
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_signal_between_steps_only_sets_the_flag():
    stop = Preemption(grace_s=30.0)
    assert stop.install()
    try:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.01)  # let the interpreter run the handler
        assert stop.requested and stop.signal_name == "SIGINT"
        assert stop.seconds_left() > 29.0
    finally:
        stop.uninstall()
