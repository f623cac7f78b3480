"""Checkpoints off the critical path (run.checkpoint_async): the snapshot is a host copy the
training no longer touches, one background write at a time, a failed write raises at the next
wait and publishes nothing (the previous checkpoint stays the newest valid one)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from maskgrpo_ray.checkpoints.storage import CheckpointStore
from maskgrpo_ray.loop.snapshot import BackgroundWriter, host_copy


def test_host_copy_is_detached_from_the_live_state():
    live = {"w": torch.ones(3), "opt": {"state": {0: {"m": torch.zeros(2)}}, "lr": [1e-3]}, "n": 4}
    snap = host_copy(live)
    live["w"].add_(1.0)
    live["opt"]["state"][0]["m"].add_(5.0)
    live["opt"]["lr"][0] = 9.0
    assert snap["w"].tolist() == [1.0, 1.0, 1.0]
    assert snap["opt"]["state"][0]["m"].tolist() == [0.0, 0.0]
    assert snap["opt"]["lr"] == [1e-3] and snap["n"] == 4


def test_one_write_at_a_time_and_in_order():
    writer, order, gate = BackgroundWriter(), [], threading.Event()

    def first():
        gate.wait(timeout=10)
        order.append(1)

    writer.submit(first, "first")
    assert writer.busy  # the loop goes on while it writes
    threading.Timer(0.2, gate.set).start()
    writer.submit(lambda: order.append(2), "second")  # waits for the first
    writer.wait()
    assert order == [1, 2] and not writer.busy and writer.last_write_s >= 0


def test_a_failed_write_raises_at_the_next_wait_and_publishes_nothing(tmp_path: Path):
    store = CheckpointStore(str(tmp_path / "ck"))
    store.save(2, lambda f: (f / "a.bin").write_bytes(b"x" * 10), keep=2)
    writer = BackgroundWriter()

    def crashing(folder: Path) -> None:
        (folder / "a.bin").write_bytes(b"half")
        raise OSError("disk gone mid-write")

    writer.submit(lambda: store.save(4, crashing, keep=2), "checkpoint step 4")
    with pytest.raises(RuntimeError, match="disk gone mid-write"):
        writer.wait()
    assert store.latest() == "step_000002" and store.list() == ["step_000002"]
    folder = store.fetch_valid(tmp_path / "scratch")
    assert folder is not None and folder.name == "step_000002"
    writer.wait()  # the error is raised once


def test_the_planner_counts_only_the_snapshot_on_the_path():
    from maskgrpo_ray.planner.checkpoint_cost import CheckpointRates, checkpoint_cost

    r = CheckpointRates(
        learner_write=1e9, to_driver=1e9, driver_write=1e9, sha256=1e9, fixed_s=0.0, host_copy=1e9
    )
    # 10 GB: the whole write 10 * (3 + 2) = 50 s; the snapshot of 10 ranks, each its 1 GB
    # written on its node (1 s) and copied into host memory (1 s): 2 s
    sync = checkpoint_cost(10**10, 6.0, 100, 0.0, r)
    snap = checkpoint_cost(10**10, 6.0, 100, 0.0, r, asynchronous=True, ranks=10)
    assert sync.seconds == snap.seconds == pytest.approx(50.0)
    assert sync.critical_s == pytest.approx(50.0) and snap.critical_s == pytest.approx(2.0)
    assert snap.overhead == pytest.approx(2.0 / 600.0)  # every 100 steps of 6 s
    # checkpoints every 5 steps (30 s) while a write takes 50 s: the next save waits 20 s
    tight = checkpoint_cost(10**10, 6.0, 5, 0.0, r, asynchronous=True, ranks=10)
    assert tight.critical_s == pytest.approx(50.0 - 30.0 + 2.0)
