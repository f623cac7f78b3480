"""FilterActor: owns the std-history filter (paper Section 3.3); its state is saveable.

Decisions must be taken in the order groups arrive, against one history, so there is exactly
one filter actor per run. The driver keeps a copy of this class (``RayExecutor.filter_copy``)
that decides the same groups, to restart a dead filter actor with its history.
"""

from __future__ import annotations

from typing import Any

import ray
import torch

from maskgrpo_ray.actors.base import ActorProcess, outlive_sigterm
from maskgrpo_ray.algo.filtering import StdHistoryFilter
from maskgrpo_ray.pipeline.build import build_filter
from maskgrpo_ray.pipeline.phases import FilterResult, filter_rewards
from maskgrpo_ray.pipeline.settings import FilterSettings


class FilterActor(ActorProcess):
    def __init__(self, settings: FilterSettings) -> None:
        outlive_sigterm()
        self.filt: StdHistoryFilter | None = build_filter(settings)
        self.batches = 0
        self.groups_kept = 0

    def filter(self, rewards: torch.Tensor, group_size: int) -> FilterResult:
        """Keep / drop / invalid per group of ``rewards [N]`` (records every valid group's std).

        Only the rewards travel here, not the images."""
        res = filter_rewards(rewards, group_size, self.filt)
        self.batches += 1
        self.groups_kept += int(res.keep.sum())
        return res

    def stats(self) -> dict[str, float]:
        """Drop rate, threshold and history (cumulative), and groups kept (effective batch)."""
        out = self.filt.stats() if self.filt is not None else {}
        out["filter_groups_kept_total"] = float(self.groups_kept)
        return out

    def state_dict(self) -> dict[str, Any]:
        return {
            "filter": None if self.filt is None else self.filt.state_dict(),
            "batches": self.batches,
            "groups_kept": self.groups_kept,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        f = state.get("filter")
        self.filt = None if f is None else StdHistoryFilter.from_state_dict(f)
        self.batches = int(state.get("batches", 0))
        self.groups_kept = int(state.get("groups_kept", 0))


RemoteFilterActor = ray.remote(FilterActor)
