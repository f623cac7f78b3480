"""The learner's part of ``train.ema_decay``: rank 0 keeps the weights' moving average.

Under ZeRO stage 0-2 every rank holds the whole parameters after each optimizer step, and
they are equal on every rank, so one EMA is enough: rank 0 keeps it (``pipeline.ema``), as it
is rank 0 that serves the weights (``LearnerGroup.weights_ref``). The other ranks would only
spend a second copy of the trained tensors each (a full fine-tune's fp32 model per GPU) on
the same numbers. ZeRO-3 is refused by the config (``train.ema_decay`` with
``learner.zero_stage`` 3): its partitions are never gathered for the EMA.

A checkpoint keeps rank 0's EMA as ``learner/ema.pt`` beside the DeepSpeed files, and a load
restores it bit for bit; a checkpoint without one (saved with the EMA off) starts it again from
the loaded weights, with a warning.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from maskgrpo_ray.pipeline.ema import ParameterEma
from maskgrpo_ray.pipeline.settings import UpdateSettings
from maskgrpo_ray.weights.safe_files import load_torch_file

EMA_FILE = "ema.pt"  # in a rank's checkpoint folder (the run's ``learner/``)


class EmaRank:
    """What :class:`~maskgrpo_ray.learner.worker.LearnerWorker` adds for the EMA (a mixin: the
    worker has ``rank``, ``engine`` and ``update_settings``)."""

    rank: int
    engine: Any
    update_settings: UpdateSettings
    ema: ParameterEma | None = None

    def start_ema(self) -> None:
        """Rank 0, with ``train.ema_decay`` > 0: an EMA starting from the engine's weights
        now (the base, or the weights a restarted learner was given)."""
        decay = self.update_settings.ema_decay
        self.ema = ParameterEma(self.engine.module, decay) if decay > 0 and self.rank == 0 else None

    def ema_state(self) -> dict[str, torch.Tensor]:
        """Rank 0: the EMA on the CPU in the parameters' dtypes (the form of ``trained_state``):
        what evaluation on the rollout actors and the exported policy use."""
        if self.ema is None:
            raise RuntimeError(
                f"learner rank {self.rank} keeps no EMA (rank 0 does, when train.ema_decay > 0)"
            )
        return self.ema.weights(self.engine.module)

    def save_ema(self, folder: Path) -> None:
        """Rank 0: the EMA's state into ``folder`` (the rank's checkpoint files)."""
        if self.ema is not None:
            torch.save(self.ema.state_dict(), folder / EMA_FILE)

    def load_ema(self, folder: Path) -> None:
        """Rank 0: the EMA :meth:`save_ema` wrote in ``folder``, after the weights were loaded
        (none there: it starts again from them, announced)."""
        if self.ema is None:
            return
        path = folder / EMA_FILE
        state = load_torch_file(path, "a checkpoint's EMA") if path.exists() else None
        self.ema.resume(self.engine.module, state, "the learner checkpoint")
