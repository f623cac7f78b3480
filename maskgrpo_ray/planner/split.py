"""The rollout/learner split of a cluster: the ideal throughput of each split of ``gpus``
(:func:`pipeline_ideal` of :func:`~maskgrpo_ray.planner.cost_model.step_costs`) and the best
one (:func:`plan_split`), ``maskgrpo plan``'s recommendation. No torch."""

from __future__ import annotations

from dataclasses import dataclass

from maskgrpo_ray.planner.checkpoint_cost import CheckpointCost
from maskgrpo_ray.planner.cost_model import CostProfile, StepCosts, Workload, step_costs


@dataclass(frozen=True)
class Ideal:
    """Images per second a split can reach, and the work-conserving limit beside it."""

    sync: float  # images / (R + L + W)
    asynchronous: float  # images / max(R, L + W)
    limit: float  # n / (r + l): every GPU busy all the time, any split
    rollout_busy_async: float  # R / max(R, L + W)
    learner_busy_async: float  # (L + W) / max(R, L + W)
    rollout_busy_sync: float  # R / (R + L + W): the rollout GPUs wait for the update and sync
    learner_busy_sync: float  # (L + W) / (R + L + W)

    def busy(self, asynchronous: bool) -> tuple[float, float]:
        """(rollout, learner) GPUs' busy shares of a step in the given loop."""
        if asynchronous:
            return self.rollout_busy_async, self.learner_busy_async
        return self.rollout_busy_sync, self.learner_busy_sync


def pipeline_ideal(c: StepCosts) -> Ideal:
    """The ideal throughputs of :func:`step_costs`' split (seconds are GPU seconds, unscaled)."""
    images = c.images
    busy = max(c.rollout_s, c.learner_s + c.sync_s)
    total = c.rollout_s + c.learner_s + c.sync_s
    n = c.rollout_gpus + c.learner_gpus
    return Ideal(
        sync=images / total,
        asynchronous=images / busy,
        limit=n / (c.r + c.l),
        rollout_busy_async=c.rollout_s / busy,
        learner_busy_async=(c.learner_s + c.sync_s) / busy,
        rollout_busy_sync=c.rollout_s / total,
        learner_busy_sync=(c.learner_s + c.sync_s) / total,
    )


@dataclass(frozen=True)
class SplitPlan:
    gpus: int
    rollout_gpus: int
    learner_gpus: int
    asynchronous: bool
    images_per_s: float
    limit: float
    costs: StepCosts
    table: list[tuple[int, int, float]]  # every split: (rollout, learner, images/s)
    checkpoint: CheckpointCost | None = None  # at the recommended split (maskgrpo plan)


def plan_split(p: CostProfile, w: Workload, gpus: int, *, asynchronous: bool = True) -> SplitPlan:
    """The rollout/learner split of ``gpus`` with the most images/s (ties: fewer rollout GPUs)."""
    if gpus < 2:
        raise ValueError(f"--gpus {gpus}: a split needs at least 2 GPUs (1 rollout, 1 learner)")
    table = []
    for nr in range(1, gpus):
        ideal = pipeline_ideal(step_costs(p, w, nr, gpus - nr))
        table.append((nr, gpus - nr, ideal.asynchronous if asynchronous else ideal.sync))
    nr, nl, best = max(table, key=lambda t: (t[2], -t[0]))
    return SplitPlan(
        gpus,
        nr,
        nl,
        asynchronous,
        best,
        pipeline_ideal(step_costs(p, w, nr, nl)).limit,
        step_costs(p, w, nr, nl),
        table,
    )
