"""RolloutActor: holds a policy and turns prompt chunks into groups of G recorded samples.

Thin: each method unpacks a message, calls ``maskgrpo_ray.pipeline.phases``, packs the answer. The
actor's weights come only from the learner (``load_weights``, versioned); every rollout it
makes is tagged with that version. Seeds come with the request, so a chunk's samples do not
depend on which actor ran it (a re-issued chunk reproduces the lost one exactly).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import replace
from typing import Any

import ray
import torch

from maskgrpo_ray.actors.base import PoolActor
from maskgrpo_ray.cluster.attach import apply_env_defaults
from maskgrpo_ray.cluster.ray_metrics import process_metrics
from maskgrpo_ray.cluster.weight_transfer import Channel, TensorMeta
from maskgrpo_ray.config import ModelConfig
from maskgrpo_ray.errors import UserError
from maskgrpo_ray.evaluation.generation import (
    EvalUnit,
    generate_unit,
    probe_divergence,
    unit_rewards,
)
from maskgrpo_ray.models.base import prompt_problems
from maskgrpo_ray.pipeline.build import build_policy, build_reward_from_settings, resolve_device
from maskgrpo_ray.pipeline.data_plane import RolloutMeta
from maskgrpo_ray.pipeline.ema import swapped_in
from maskgrpo_ray.pipeline.learner_core import frozen_base
from maskgrpo_ray.pipeline.messages import RolloutBatch, ScoredBatch
from maskgrpo_ray.pipeline.phases import generate, score
from maskgrpo_ray.pipeline.settings import EvalSettings, RewardSettings, RolloutSettings


class RolloutActor(PoolActor):
    """One policy replica. Resources (CPU share, GPU) are set by ``.options`` from the config.

    Args:
        model: the model section (what to build; weights then come from the learner).
        rollout: the sampler's settings for training rollouts.
        evaluation: the sampler's settings for held-out evaluation.
        reward: the reward composition evaluation scores with (built on first use).
        num_gpus: the GPU share the actor was given (CUDA when > 0 and present).
        actor_id: the pool's id of this replica.
    """

    def __init__(
        self,
        model: ModelConfig,
        rollout: RolloutSettings,
        evaluation: EvalSettings,
        reward: RewardSettings,
        num_gpus: float,
        actor_id: int,
    ) -> None:
        apply_env_defaults()
        super().__init__(actor_id)
        self.rollout, self.evaluation, self.reward_settings = rollout, evaluation, reward
        self.device = resolve_device(num_gpus)
        try:
            self.policy = build_policy(model, self.device).eval()
        except UserError as err:  # raised from ready(): one line in the driver
            self.init_error = err
            return
        # the probe's KL to the base (logging.monitors.probe_kl): the weights the actor was
        # built with, frozen before any weight sync (a LoRA policy's: its adapter disabled)
        self.base = frozen_base(self.policy) if evaluation.probe_kl else None
        self.version = 0
        self.chunks = 0
        self._eval_reward: Any = None
        self._sync: Any = None  # a Channel once the run uses the collective weight sync

    def check_prompts(self, prompts: list[str]) -> list[str | None]:
        """Per prompt: None if the policy can read it, else the reason (a ValueError's text)."""
        return prompt_problems(self.policy, prompts)

    def sync_join(
        self,
        host: str,
        port: int,
        rank: int,
        world: int,
        metas: list[TensorMeta],
        bucket_bytes: int,
        timeout_s: float,
    ) -> int:
        """Join a collective weight-sync group (``maskgrpo_ray/cluster/weight_transfer.py``) as
        ``rank``; blocks until every member has joined. Replaces (closes) any earlier group."""
        if self._sync is not None:
            self._sync.close()
        self._sync = Channel(host, port, rank, world, self.device, metas, bucket_bytes, timeout_s)
        return rank

    def sync_receive(self, version: int) -> int:
        """Receive the learner's broadcast into this policy's tensors; tag ``version``."""
        self._sync.receive(self.policy.state_dict())
        self.version = int(version)
        return self.version

    def load_weights(self, state: dict[str, torch.Tensor], version: int) -> int:
        """Install the learner's weights (a subset of the state dict: the trained tensors)."""
        missing = set(state) - set(self.policy.state_dict())
        if missing:
            raise KeyError(f"weights for unknown tensors: {sorted(missing)[:5]}")
        self.policy.load_state_dict(state, strict=False)
        self.version = int(version)
        return self.version

    def weights_version(self) -> int:
        """The version of the weights this actor holds."""
        return self.version

    def weights(self) -> tuple[dict[str, torch.Tensor], int]:
        """The tensors that train (the learner's ``trained_state``: parameters with
        ``requires_grad``; frozen parts are the same everywhere), on the CPU, and their
        version: what a replacement sibling or a learner restarted without a checkpoint takes."""
        state = {
            n: p.detach().cpu().clone()
            for n, p in self.policy.named_parameters()
            if p.requires_grad
        }
        return state, self.version

    def generate(self, prompts: list[str], positions: list[int], seed: int) -> RolloutBatch:
        """``G`` samples for each prompt of the chunk, tagged with this actor's version."""
        t0 = time.perf_counter()
        gen = torch.Generator(device=self.device).manual_seed(int(seed))
        batch = generate(
            self.policy,
            prompts,
            positions,
            policy_version=self.version,
            generator=gen,
            **self.rollout.kwargs(),
        )
        self.chunks += 1
        process_metrics().observe(
            "maskgrpo_generate_seconds", time.perf_counter() - t0, {"actor": str(self.actor_id)}
        )
        return batch

    @ray.method(num_returns=3)
    def generate_split(
        self, prompts: list[str], positions: list[int], seed: int
    ) -> tuple[RolloutMeta, RolloutBatch, torch.Tensor]:
        """:meth:`generate` as three objects: a small :class:`RolloutMeta` (all the driver
        fetches), the rollout without its images (the reward actor and the learner ranks fetch
        it) and the images ``uint8 [N, H, W, 3]`` (the reward actor's; the driver's only when
        it draws a sample grid). ``maskgrpo_ray.pipeline.data_plane`` says who reads what."""
        batch = self.generate(prompts, positions, seed)
        return RolloutMeta.of(batch), batch.without_images(), batch.images

    def _weights(
        self, weights: dict[str, torch.Tensor] | None
    ) -> contextlib.AbstractContextManager[None]:
        """A block with ``weights`` in the policy (the learner's EMA, ``train.ema_decay``) and
        this actor's own weights back after it, bit for bit; None: its own throughout. The
        actor runs one call at a time: no rollout ever sees the swapped weights."""
        return contextlib.nullcontext() if weights is None else swapped_in(self.policy, weights)

    def eval_unit(
        self, unit: EvalUnit, weights: dict[str, torch.Tensor] | None = None, probe: bool = False
    ) -> dict[str, torch.Tensor]:
        """One evaluation unit with the current weights (or ``weights`` for this call), scored
        with the training reward: per-sample ``reward`` (and ``accuracy``) ``[N]``
        (``evaluation.generation``); ``probe``: the KL of those weights to the base and their
        entropy too (``kl``, ``entropy`` ``[N]``), where the actor keeps one."""
        if self._eval_reward is None:
            self._eval_reward = build_reward_from_settings(
                self.reward_settings, self.device, evaluation=True
            )
        divergence: dict[str, torch.Tensor] = {}
        with self._weights(weights):
            batch = generate_unit(self.policy, unit, self.evaluation)
            if probe and self.base is not None:
                divergence = probe_divergence(self.policy, self.base, batch)
        return {**unit_rewards(self._eval_reward, batch, self.prompt_meta), **divergence}

    def eval_images(
        self,
        unit: EvalUnit,
        settings: EvalSettings,
        weights: dict[str, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """A unit's images with the current weights (or ``weights`` for this call) under
        ``settings`` (``grid_unit``): uint8 ``[N, H, W, 3]``, prompt-major."""
        with self._weights(weights):
            return generate_unit(self.policy, unit, settings).images

    def probe_chunk(self, prompts: list[str], positions: list[int], seed: int) -> ScoredBatch:
        """One step-signal probe batch (``loop.step_signal_probe``): a training rollout of the chunk
        with the current weights and its seed, scored here with the run's reward (the
        evaluation's copy), whole but for its images (the learner ranks measure it)."""
        if self._eval_reward is None:
            self._eval_reward = build_reward_from_settings(
                self.reward_settings, self.device, evaluation=True
            )
        batch = self.generate(prompts, positions, seed)
        scored = score(self._eval_reward, batch, self.prompt_meta)
        return replace(scored, rollout=batch.without_images())

    def eval_rollout(self, unit: EvalUnit) -> RolloutBatch:
        """One evaluation unit's rollout (images ``[N, H, W, 3]``, prompt-major) with the
        current weights: ``maskgrpo eval`` scores and writes it."""
        return generate_unit(self.policy, unit, self.evaluation)

    def status(self) -> dict[str, Any]:
        """What an operator checks of a replica: id, device, weights version, chunks done and
        a checksum of its weights (replicas of one version must agree)."""
        with torch.no_grad():
            checksum = sum(float(p.double().sum()) for p in self.policy.parameters())
        return {
            "actor_id": self.actor_id,
            "device": str(self.device),
            "version": self.version,
            "chunks": self.chunks,
            "weights_checksum": checksum,
        }


RemoteRolloutActor = ray.remote(RolloutActor)
