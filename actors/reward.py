"""RewardActor: scores rollouts against their prompts with the configured reward.

A reward that raises does not stop the run: the batch gets NaN rewards (its groups are then
skipped as invalid by the filter phase) and the failure is counted.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import ray
import torch

from maskgrpo_ray.build import build_reward_from_config, resolve_device
from maskgrpo_ray.config import Config
from maskgrpo_ray.phases import accuracy_fn, score
from maskgrpo_ray.ray_cluster import apply_env_defaults
from maskgrpo_ray.ray_metrics import process_metrics
from maskgrpo_ray.types import RolloutBatch, ScoredBatch

log = logging.getLogger(__name__)


def safe_score(reward: Any, batch: RolloutBatch) -> tuple[ScoredBatch, bool]:
    """``phases.score``, or NaN rewards (same parts, NaN accuracy) if it raises.

    Returns:
        the scored batch and whether scoring raised.
    """
    try:
        return score(reward, batch), False
    except Exception as err:  # noqa: BLE001 - any reward failure is counted, never fatal
        log.warning("reward failed on prompts %s: %r", batch.prompt_indices, err)
    n = batch.num_samples
    nan = torch.full((n,), float("nan"))
    parts = {name: nan.clone() for name in getattr(reward, "rewards", {})}
    acc = nan.clone() if accuracy_fn(reward) is not None else None
    return ScoredBatch(batch, nan.clone(), parts, acc).validate(), True


class RewardActor:
    """One reward model replica (CPU share or a GPU, from the config)."""

    def __init__(self, cfg: Config, actor_id: int) -> None:
        apply_env_defaults()
        self.actor_id = actor_id
        self.reward = build_reward_from_config(cfg, resolve_device(cfg.reward.num_gpus_per_actor))
        self.failures = 0
        self.nan_samples = 0
        self.batches = 0

    def ready(self) -> int:
        return self.actor_id

    def score(self, batch: RolloutBatch) -> ScoredBatch:
        t0 = time.perf_counter()
        scored, failed = safe_score(self.reward, batch)
        self.batches += 1
        self.failures += int(failed)
        self.nan_samples += int((~torch.isfinite(scored.rewards)).sum())
        m = process_metrics()
        m.observe("maskgrpo_score_seconds", time.perf_counter() - t0, {"actor": str(self.actor_id)})
        if failed:
            m.count("maskgrpo_reward_failures_total")
        return scored

    def stats(self) -> dict[str, float]:
        return {
            "reward_batches": float(self.batches),
            "reward_failures": float(self.failures),
            "reward_nan_samples": float(self.nan_samples),
        }


RemoteRewardActor = ray.remote(RewardActor)
