"""RewardActor: scores rollouts against their prompts with the configured reward.

A reward component that raises or returns bad values does not stop the run: ``phases.score_rewards``
(the same code as the single-process trainer) makes the lost values NaN, so their groups are
skipped as invalid by the filter phase, logs them, and counts them per component and kind in
``RewardResult.reward_failures``. The actor sends back the scores only (a typed
``RewardResult``), never the rollout, and mirrors the counts to the Ray metrics.
"""

from __future__ import annotations

import time

import ray
import torch

from maskgrpo_ray.actors.base import PoolActor
from maskgrpo_ray.cluster.attach import apply_env_defaults
from maskgrpo_ray.cluster.ray_metrics import process_metrics
from maskgrpo_ray.pipeline.build import build_reward_from_settings, resolve_device
from maskgrpo_ray.pipeline.messages import RewardResult, RolloutBatch, merge_reward_failures
from maskgrpo_ray.pipeline.phases import reward_failure_metrics, score_rewards
from maskgrpo_ray.pipeline.settings import RewardSettings
from maskgrpo_ray.rewards.base import Reward


class RewardActor(PoolActor):
    """One reward model replica (CPU share or a GPU, from the config).

    Args:
        settings: the reward composition (``reward.components``).
        num_gpus: the GPU share the actor was given (CUDA when > 0 and present).
        actor_id: this replica's number (a metrics tag).
        reward: a reward to use instead of building ``settings`` (tests, custom code).
    """

    def __init__(
        self,
        settings: RewardSettings,
        num_gpus: float,
        actor_id: int,
        reward: Reward | None = None,
    ) -> None:
        apply_env_defaults()
        super().__init__(actor_id)
        if reward is None:
            reward = build_reward_from_settings(settings, resolve_device(num_gpus))
        self.reward = reward
        self.batches = 0
        self.failures: dict[str, dict[str, int]] = {}

    def score(self, batch: RolloutBatch, images: torch.Tensor | None = None) -> RewardResult:
        """The rollout's rewards (the rollout itself is not sent back). ``images``: the images
        when the rollout came without them (``RolloutActor.generate_split``)."""
        t0 = time.perf_counter()
        if images is not None:
            batch = batch.with_images(images)
        scored = score_rewards(self.reward, batch, self.prompt_meta)
        self.batches += 1
        self.failures = merge_reward_failures(self.failures, scored.reward_failures)
        m = process_metrics()
        m.observe("maskgrpo_score_seconds", time.perf_counter() - t0, {"actor": str(self.actor_id)})
        for name, kinds in scored.reward_failures.items():
            for kind, n in kinds.items():
                m.count("maskgrpo_reward_failures_total", n, {"component": name, "kind": kind})
        return scored

    def stats(self) -> dict[str, float]:
        """Batches scored and samples lost per ``reward_failures/<component>/<kind>`` (cumulative)."""
        return {"reward_batches": float(self.batches), **reward_failure_metrics(self.failures)}


RemoteRewardActor = ray.remote(RewardActor)
