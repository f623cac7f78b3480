"""Asynchronous checkpoints safe by default (issue 57): the SIGTERM reserve covers the whole
checkpoint and the write in flight from the first step, a second signal during the checkpoint
before exit loses nothing, a crashed write's staging folder is removed at the start, and the
Show-o configs checkpoint in the background. (A learner rank lost mid-write on Ray:
``tests/test_fault_drill.py``.)"""

from __future__ import annotations

import json
import logging
import os
import signal
from pathlib import Path

import pytest
from tiny_runs import NO_GRIDS, tiny_toy

from maskgrpo_ray.cli import main
from maskgrpo_ray.config import load_config
from maskgrpo_ray.loop import driver
from maskgrpo_ray.loop.recovery import Checkpoints, Preemption

ROOT = Path(__file__).resolve().parents[1]


class _Writer:
    def __init__(self, busy: bool) -> None:
        self.busy = busy


def test_the_reserve_covers_the_write_in_flight():
    # a whole checkpoint 4 s, grace 100 s: the checkpoint before exit 4 s, the write in
    # flight (finished first) 4 s more, half again as margin, and min(5, 10) for the exit
    stop = Preemption(100.0, _Writer(busy=True))  # type: ignore[arg-type]
    stop.save_s = 4.0
    assert stop.reserve_s() == pytest.approx((4 + 4) * 1.5 + 5)
    stop.writer = _Writer(busy=False)  # type: ignore[assignment]
    assert stop.reserve_s() == pytest.approx(4 * 1.5 + 5)


def _train(run: Path, *extra: str) -> int:
    args = ["train", "--backend", "local", "--run-dir", str(run)]
    for s in tiny_toy(3, 2, NO_GRIDS, "run.checkpoint_async=true", *extra):
        args += ["--set", s]
    return main(args)


def test_the_reserve_is_sized_from_the_first_step(tmp_path, monkeypatch):
    """The start's checkpoint is written in the foreground, so the reserve knows a whole
    checkpoint's seconds when the handlers go in (before: 0 until the first in-loop one)."""
    seen: list[float] = []
    real = Preemption.install

    def install(self: Preemption) -> bool:
        seen.append(self.save_s)
        return real(self)

    monkeypatch.setattr(Preemption, "install", install)
    assert _train(tmp_path / "run", "run.checkpoint_every_steps=2") == 0
    assert len(seen) == 1 and seen[0] > 0.0


def test_a_second_signal_during_the_checkpoint_before_exit_loses_nothing(
    tmp_path, monkeypatch, caplog
):
    """SIGINT during step 1, then a second SIGINT as the checkpoint before exit starts: the
    handlers are still in (before: removed first, so the second signal interrupted the save);
    the checkpoint at step 2 is written whole and the summary says so. A staging folder a
    crashed write left is removed at the start."""
    run = tmp_path / "run"
    stale = run / "checkpoints" / ".tmp-step_000004-99999"
    stale.mkdir(parents=True)
    (stale / "executor.pt").write_bytes(b"half a file")
    real_step, real_save = driver.run_step, Checkpoints.save

    def run_step(ex, settings, s, *args, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        if s == 1:
            os.kill(os.getpid(), signal.SIGINT)
        return real_step(ex, settings, s, *args, **kw)

    def save(self, next_step, base, totals, *, wait=False):  # noqa: ANN001, ANN202
        if next_step == 2:  # the checkpoint before exit
            os.kill(os.getpid(), signal.SIGINT)
        return real_save(self, next_step, base, totals, wait=wait)

    monkeypatch.setattr(driver, "run_step", run_step)
    monkeypatch.setattr(Checkpoints, "save", save)
    with caplog.at_level(logging.WARNING):
        assert _train(run, "run.checkpoint_every_steps=0") == 0
    assert "second SIGINT: the checkpoint before exit goes on" in caplog.text
    summary = json.loads((run / "summary.json").read_text())
    assert summary["completed"] is False and summary["resume_step"] == 2
    ck = run / "checkpoints" / "step_000002"
    assert (ck / "manifest.json").exists() and (ck / "driver.pt").exists()
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_000002"
    assert not stale.exists()
    assert "removed the staging folder of an unfinished checkpoint write" in caplog.text


def test_the_showo_configs_checkpoint_in_the_background():
    names = sorted((ROOT / "configs").glob("showo_*.yaml"))
    assert len(names) >= 6
    for path in names:
        assert load_config(path).run.checkpoint_async is True, path.name
