"""RolloutActor: holds a policy and turns prompt chunks into groups of G recorded samples.

Thin: each method unpacks a message, calls ``maskgrpo_ray.phases``, packs the answer. The
actor's weights come only from the learner (``load_weights``, versioned); every rollout it
makes is tagged with that version. Seeds come with the request, so a chunk's samples do not
depend on which actor ran it (a re-issued chunk reproduces the lost one exactly).
"""

from __future__ import annotations

import os
import time
from typing import Any

import ray
import torch

from maskgrpo_ray.build import build_policy, build_reward_from_config, resolve_device
from maskgrpo_ray.config import Config
from maskgrpo_ray.local import eval_settings, rollout_settings
from maskgrpo_ray.phases import evaluate, generate
from maskgrpo_ray.ray_cluster import apply_env_defaults
from maskgrpo_ray.ray_metrics import process_metrics
from maskgrpo_ray.types import RolloutBatch


class RolloutActor:
    """One policy replica. Resources (CPU share, GPU) are set by ``.options`` from the config."""

    def __init__(self, cfg: Config, actor_id: int) -> None:
        apply_env_defaults()
        self.cfg = cfg
        self.actor_id = actor_id
        self.device = resolve_device(cfg.rollout.num_gpus_per_actor)
        self.policy = build_policy(cfg, self.device).eval()
        self.version = 0
        self._eval_reward: Any = None
        self._calls = 0
        self._exit_on_call: int | None = None

    def ready(self) -> int:
        return self.actor_id

    def check_prompt(self, prompt: str) -> str | None:
        """None if the policy can read ``prompt``, else the reason (a ValueError's message)."""
        try:
            self.policy.tokenize([prompt])
        except ValueError as err:
            return str(err)
        return None

    def load_weights(self, state: dict[str, torch.Tensor], version: int) -> int:
        """Install the learner's weights (a subset of the state dict: the trained tensors)."""
        missing = set(state) - set(self.policy.state_dict())
        if missing:
            raise KeyError(f"weights for unknown tensors: {sorted(missing)[:5]}")
        self.policy.load_state_dict(state, strict=False)
        self.version = int(version)
        return self.version

    def generate(self, prompts: list[str], positions: list[int], seed: int) -> RolloutBatch:
        """``G`` samples for each prompt of the chunk, tagged with this actor's version."""
        self._calls += 1
        if self._exit_on_call is not None and self._calls >= self._exit_on_call:
            os._exit(1)  # a crash in the middle of a chunk (failure drills, tests)
        t0 = time.perf_counter()
        gen = torch.Generator(device=self.device).manual_seed(int(seed))
        batch = generate(
            self.policy,
            prompts,
            positions,
            policy_version=self.version,
            generator=gen,
            **rollout_settings(self.cfg),
        )
        process_metrics().observe(
            "maskgrpo_generate_seconds", time.perf_counter() - t0, {"actor": str(self.actor_id)}
        )
        return batch

    def evaluate(self, prompts: list[str]) -> dict[str, float]:
        """Held-out evaluation with the current weights (fixed seed, as the local trainer)."""
        if self._eval_reward is None:
            self._eval_reward = build_reward_from_config(self.cfg, self.device)
        return evaluate(self.policy, self._eval_reward, prompts, **eval_settings(self.cfg))

    def weights_digest(self) -> tuple[int, float]:
        """(version, sum of all parameters): a cheap fingerprint for tests."""
        with torch.no_grad():
            total = sum(float(p.double().sum()) for p in self.policy.parameters())
        return self.version, total

    def exit_on_call(self, call_number: int) -> None:
        """Die (``os._exit``) when ``generate`` is called for the ``call_number``-th time in
        total; a deterministic crash for failure drills and tests."""
        self._exit_on_call = int(call_number)


RemoteRolloutActor = ray.remote(RolloutActor)
