"""What a learner checkpoint costs: its bytes from the model's size, its seconds from stated
rates, and what a cadence makes of them (the share of the run, the most a kill loses). Plain
Python (no torch): ``maskgrpo plan`` prints it beside the split (:mod:`maskgrpo_ray.planner.cost_model`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def checkpoint_bytes(params: int, trained_params: int, *, bf16: bool) -> int:
    """Bytes of one learner checkpoint (DeepSpeed's files): the module's weights (bf16: 2
    bytes a parameter, fp32: 4) and, per trained parameter, Adam's two fp32 moments (8) and,
    under bf16 mixed precision, the fp32 master copy (4). The toy's, fp32 and fully trained:
    12 bytes a parameter (measured: 887,399 bytes for its 70,727 parameters and DeepSpeed's
    framing); Show-o's 1.448B in bf16: 14, 20.3 GB."""
    return params * (2 if bf16 else 4) + trained_params * (12 if bf16 else 8)


@dataclass(frozen=True)
class CheckpointRates:
    """What a checkpoint's path costs (``backend.ray_executor.RayExecutor.save``, ``storage``):
    every rank writes its DeepSpeed files on its node, the files reach the driver through the
    object store, the driver writes them to a staging folder hashing them (sha256) as they
    come, builds the manifest (a second sha256 pass) and publishes them. The byte rates are
    stated assumptions for a GPU cluster's head (NVMe-class disks, 10 Gb/s to the head;
    sha256 1.4 GiB/s on one core was measured here), ``fixed_s`` the toy's measured
    per-checkpoint cost (bench/checkpoint_cost.py), where the bytes take no time."""

    learner_write: float = 1.0e9  # bytes/s, a rank's files to its node's disk
    to_driver: float = 1.25e9  # bytes/s, object store -> the driver's node
    driver_write: float = 1.0e9  # bytes/s, the staging folder, fsync included
    sha256: float = 1.5e9  # bytes/s, one core; two passes
    fixed_s: float = 0.03  # seconds, a checkpoint of no bytes (the toy's on Ray: 0.9 MB)
    # bytes/s, run.checkpoint_async's snapshot into host memory: a rank's files read back into
    # the object store (shared memory) after their write to the node's disk
    host_copy: float = 5.0e9

    def seconds(self, nbytes: int) -> float:
        per_byte = 1 / self.learner_write + 1 / self.to_driver + 1 / self.driver_write
        return self.fixed_s + nbytes * (per_byte + 2 / self.sha256)

    def snapshot_seconds(self, nbytes: int, ranks: int = 1) -> float:
        """The step loop's share of an asynchronous checkpoint (``run.checkpoint_async``): each
        of ``ranks`` learner ranks writes its share of the bytes on its node and copies it into
        host memory, in parallel; the rest (to the driver, hashing, publishing) is the
        background writer's."""
        per_rank = nbytes / max(ranks, 1)
        return self.fixed_s + per_rank * (1 / self.learner_write + 1 / self.host_copy)


@dataclass(frozen=True)
class CheckpointCost:
    """One checkpoint's predicted bytes and seconds, and what the cadence makes of them."""

    bytes: int
    seconds: float  # the whole write
    interval_s: float  # between checkpoints: every_steps steps or every_minutes, the sooner
    overhead: float  # critical-path seconds over the interval (the run's time lost to them)
    loses_s: float  # the most a SIGKILL loses: the interval, the step in flight and a save
    critical_s: float = math.nan  # on the step loop's path: the whole write, or the snapshot


def checkpoint_cost(
    nbytes: int,
    step_s: float,
    every_steps: int,
    every_minutes: float,
    rates: CheckpointRates | None = None,
    *,
    asynchronous: bool = False,
    ranks: int = 1,
) -> CheckpointCost:
    """A checkpoint of ``nbytes`` on a run whose steps take ``step_s``, checkpointed every
    ``every_steps`` steps or ``every_minutes`` minutes, whichever comes first (0: that cadence
    off; both off: only the run's start, end and a SIGTERM checkpoint, so ``interval_s`` and
    ``loses_s`` are infinite). ``asynchronous`` (``run.checkpoint_async``): only the snapshot
    of ``ranks`` learner ranks is on the step loop's path and counts in ``overhead`` (a write
    longer than the interval would make the next save wait: the path is then the longer)."""
    r = rates or CheckpointRates()
    seconds = r.seconds(nbytes)
    by_steps = every_steps * step_s if every_steps else math.inf
    by_time = every_minutes * 60.0 + step_s if every_minutes else math.inf  # at a boundary
    interval = min(by_steps, by_time)
    critical = seconds
    if asynchronous:
        snap = r.snapshot_seconds(nbytes, ranks)
        critical = max(snap, seconds - interval + snap) if math.isfinite(interval) else snap
    overhead = critical / interval if math.isfinite(interval) else 0.0
    return CheckpointCost(
        nbytes, seconds, interval, overhead, interval + step_s + seconds, critical
    )
