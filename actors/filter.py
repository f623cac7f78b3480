"""FilterActor: owns the std-history filter (paper Section 3.3); its state is saveable.

Decisions must be taken in the order groups arrive, against one history, so there is exactly
one filter actor per run.
"""

from __future__ import annotations

import os
from typing import Any

import ray
import torch

from maskgrpo_ray.algo.filtering import StdHistoryFilter
from maskgrpo_ray.build import build_filter
from maskgrpo_ray.phases import FilterResult, filter_rewards
from maskgrpo_ray.settings import FilterSettings


class FilterActor:
    def __init__(self, settings: FilterSettings) -> None:
        self.filt: StdHistoryFilter | None = build_filter(settings)
        self.batches = 0
        self.groups_kept = 0

    def ready(self) -> bool:
        return True

    def filter(self, rewards: torch.Tensor, group_size: int) -> FilterResult:
        """Keep / drop / invalid per group of ``rewards [N]`` (records every valid group's std).

        Only the rewards travel here, not the images."""
        res = filter_rewards(rewards, group_size, self.filt)
        self.batches += 1
        self.groups_kept += int(res.keep.sum())
        return res

    def filter_and_delta(
        self, rewards: torch.Tensor, group_size: int
    ) -> tuple[FilterResult, list[float], dict[str, float]]:
        """:meth:`filter`, the stds it added to the history and the stats after it. The driver
        applies the delta to its copy of the state (:func:`apply_filter_delta`), so a filter
        actor that dies is restarted with the history its next decision needs, without the
        whole history crossing to the driver on every call."""
        seen = self.filt.seen if self.filt is not None else 0
        res = self.filter(rewards, group_size)
        added: list[float] = []
        if self.filt is not None and self.filt.seen > seen:
            added = list(self.filt.history)[-(self.filt.seen - seen) :]
        return res, added, self.stats()

    def pid(self) -> int:
        return os.getpid()

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


def apply_filter_delta(
    state: dict[str, Any], res: FilterResult, added: list[float]
) -> dict[str, Any]:
    """The filter actor's state after a :meth:`FilterActor.filter_and_delta` call, from the
    state before it, the call's decisions and the stds it added (equal to the actor's own
    ``state_dict``)."""
    out = dict(state)
    out["batches"] = int(state["batches"]) + 1
    out["groups_kept"] = int(state["groups_kept"]) + int(res.keep.sum())
    f = state["filter"]
    if f is not None:
        valid = ~res.invalid
        f = dict(f)
        f["history"] = (list(f["history"]) + list(added))[-int(f["max_history"]) :]
        f["seen"] = int(f["seen"]) + int(valid.sum())
        f["dropped"] = int(f["dropped"]) + int((valid & ~res.keep).sum())
        out["filter"] = f
    return out
