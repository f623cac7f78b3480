"""What one update trains (:class:`UpdatePlan`): the units and learning rate decided once by
``learner_core.UpdatePlanner`` and the same on every rank, each rank reading its rows."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from maskgrpo_ray.algo.grpo import critical_steps
from maskgrpo_ray.pipeline.learner_loss import input_rows
from maskgrpo_ray.pipeline.messages import TrainBatch


@dataclass(frozen=True)
class UpdatePlan:
    """What one update trains: the same on every rank (a rank gets its rows of
    ``sample_units``, :meth:`rows`)."""

    train_steps: torch.Tensor  # [K] long, units trained: unmasking steps, or mask draws
    learning_rate: float
    cycle: bool = False  # inner update i trains unit train_steps[i mod K] only
    # [N, K] long: per-sample units (group_random: a group's rows alike); None: train_steps
    sample_units: torch.Tensor | None = None
    # k > 0: each sample's k critical steps, read from the batch's record on the rank that
    # trains it (:meth:`resolved`)
    critical: int = 0

    @property
    def units_per_pass(self) -> int:
        """Units each optimizer update (pass over the batch) trains, per sample."""
        if self.critical:
            return self.critical
        if self.sample_units is not None:
            return int(self.sample_units.shape[1])
        return 1 if self.cycle else len(self.train_steps)

    def rows_per_sample(self, shrinkage: int, num_steps: int) -> int:
        """Model input rows each sample takes in a pass (``learner_loss.input_rows``): the
        units, or under trajectory shrinkage the distinct blocks among them; with units that
        differ by sample (not known before the batch is read: ``critical``), the most a sample
        can take, ``min(k, ceil(S / s))``."""
        k = self.units_per_pass
        if shrinkage <= 1:
            return k
        if self.critical or self.sample_units is not None:
            return min(k, math.ceil(num_steps / shrinkage))
        return max(
            input_rows(self.units_for_pass(i), shrinkage) for i in range(k if self.cycle else 1)
        )

    def units_for_pass(self, i: int) -> torch.Tensor:
        """The units inner update ``i`` trains: all of them, or one in turn (``cycle``);
        ``[N, K]`` when they differ by sample."""
        if self.sample_units is not None:
            return self.sample_units
        if not self.cycle:
            return self.train_steps
        k = i % len(self.train_steps)
        return self.train_steps[k : k + 1]

    def resolved(self, batch: TrainBatch) -> UpdatePlan:
        """The plan with its per-sample critical steps read from ``batch`` (this rank's
        samples' ``step_agreement``; ``algo.grpo.critical_steps``); other plans as they are."""
        if not self.critical:
            return self
        if batch.step_agreement is None:
            raise ValueError(
                "unmasking_step_selection critical needs the rollout's step_agreement; the "
                "rollout did not record it (RolloutSettings.step_agreement)"
            )
        units = critical_steps(batch.step_agreement, self.critical)  # [N, K]
        return replace(self, sample_units=units, critical=0)

    def rows(self, start: int, stop: int) -> UpdatePlan:
        """The plan of samples ``start .. stop - 1`` (a learner rank's share of the batch)."""
        if self.sample_units is None:
            return self
        return replace(self, sample_units=self.sample_units[start:stop])
