"""The single-process executor: every phase in this process. The baseline the distributed
system is measured against, and the engine of the tests and ablations."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

from maskgrpo_ray.algo.filtering import StdHistoryFilter
from maskgrpo_ray.build import build_optimizer, learning_rate_at, loss_guards
from maskgrpo_ray.config import Config
from maskgrpo_ray.models.base import MaskedImagePolicy
from maskgrpo_ray.phases import (
    FilterResult,
    evaluate,
    filter_groups,
    generate,
    local_update,
    score,
)
from maskgrpo_ray.types import ScoredBatch, TrainBatch


def eval_settings(cfg: Config) -> dict[str, Any]:
    """Keyword arguments of ``phases.evaluate`` from the config (fixed seed)."""
    return {
        "samples_per_prompt": cfg.eval.samples_per_prompt,
        "num_steps": cfg.eval.unmasking_steps or cfg.rollout.unmasking_steps,
        "guidance_scale": (
            cfg.eval.guidance_scale
            if cfg.eval.guidance_scale is not None
            else cfg.rollout.guidance_scale
        ),
        "temperature": cfg.rollout.temperature,
        "gumbel_temperature": (
            cfg.eval.gumbel_temperature
            if cfg.eval.gumbel_temperature is not None
            else cfg.rollout.gumbel_temperature
        ),
        "seed": cfg.run.seed + 10_007,
    }


def rollout_settings(cfg: Config) -> dict[str, Any]:
    """Keyword arguments of ``phases.generate`` from the config (all but prompts and version)."""
    r = cfg.rollout
    return {
        "group_size": r.samples_per_prompt,
        "num_steps": r.unmasking_steps,
        "temperature": r.temperature,
        "gumbel_temperature": r.gumbel_temperature,
        "guidance_scale": r.guidance_scale,
        "transition": r.transition,
        "remask_likelihood": r.remask_likelihood,
    }


def update_settings(cfg: Config) -> dict[str, Any]:
    """Keyword arguments of the update from the config."""
    t = cfg.train
    return {
        "num_steps": cfg.rollout.unmasking_steps,
        "step_selection": t.unmasking_step_selection,
        "steps_trained": t.unmasking_steps_trained,
        "micro_batch": t.micro_batch_pairs_per_gpu,
        "clip_low": t.clip_low,
        "clip_high": t.clip_high,
        "grad_clip_norm": t.grad_clip_norm,
        "updates_per_batch": t.updates_per_batch,
        "kl_coef": t.kl_coef,
        "guards": loss_guards(cfg),
    }


class LocalExecutor:
    """Generate, score, filter and update in one process."""

    def __init__(
        self, cfg: Config, policy: MaskedImagePolicy, reward: Any, filt: StdHistoryFilter | None
    ) -> None:
        self.cfg, self.policy, self.reward, self.filt = cfg, policy, reward, filt
        self.optimizer = build_optimizer(cfg, policy)
        self.ref_policy = None
        if cfg.train.kl_coef > 0:
            self.ref_policy = copy.deepcopy(policy).eval().requires_grad_(False)
        self.generator = torch.Generator().manual_seed(cfg.run.seed)
        self.step_generator = torch.Generator().manual_seed(cfg.run.seed + 1)
        self.policy_version = 0

    def generate_and_score(self, prompts: list[str], positions: list[int]) -> ScoredBatch:
        rb = generate(
            self.policy,
            prompts,
            positions,
            policy_version=self.policy_version,
            generator=self.generator,
            **rollout_settings(self.cfg),
        )
        return score(self.reward, rb)

    def filter(self, scored: ScoredBatch) -> FilterResult:
        return filter_groups(scored, self.filt)

    def filter_stats(self) -> dict[str, float]:
        return self.filt.stats() if self.filt is not None else {}

    def update(self, batch: TrainBatch) -> dict[str, float]:
        lr = learning_rate_at(self.cfg, self.policy_version)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        m = local_update(
            self.policy,
            self.optimizer,
            batch,
            ref_policy=self.ref_policy,
            generator=self.step_generator,
            **update_settings(self.cfg),
        )
        self.policy_version += 1
        return {**m, "learning_rate": lr}

    def sync_weights(self) -> float:
        return 0.0  # the rollout uses the learner's weights directly

    def evaluate(self, prompts: list[str]) -> dict[str, float]:
        return evaluate(self.policy, self.reward, prompts, **eval_settings(self.cfg))

    def extra_metrics(self) -> dict[str, float]:
        return {}

    def save(self, folder: Path) -> None:
        """Weights, optimizer, RNG streams, filter history and policy version into ``folder``."""
        torch.save(self.policy.state_dict(), folder / "policy.pt")
        torch.save(self.optimizer.state_dict(), folder / "optimizer.pt")
        torch.save(
            {
                "generator": self.generator.get_state(),
                "step_generator": self.step_generator.get_state(),
                "torch": torch.get_rng_state(),
                "policy_version": self.policy_version,
                "filter": self.filt.state_dict() if self.filt is not None else None,
            },
            folder / "executor.pt",
        )

    def load(self, folder: Path) -> None:
        self.policy.load_state_dict(torch.load(folder / "policy.pt", weights_only=True))
        self.optimizer.load_state_dict(torch.load(folder / "optimizer.pt", weights_only=True))
        state = torch.load(folder / "executor.pt", weights_only=True)
        self.generator.set_state(state["generator"])
        self.step_generator.set_state(state["step_generator"])
        torch.set_rng_state(state["torch"])
        self.policy_version = int(state["policy_version"])
        if state["filter"] is not None:
            self.filt = StdHistoryFilter.from_state_dict(state["filter"])

    def shutdown(self) -> None:
        pass
