"""Factories from typed settings to library objects (policy, reward, filter)."""

from __future__ import annotations

import logging

import torch

from maskgrpo_ray.algo.filtering import StdHistoryFilter
from maskgrpo_ray.config import ModelConfig
from maskgrpo_ray.models.base import MaskedImagePolicy
from maskgrpo_ray.models.registry import build_model
from maskgrpo_ray.pipeline.settings import FilterSettings, RewardSettings
from maskgrpo_ray.rewards.base import CompositeReward, build_reward

log = logging.getLogger(__name__)


def resolve_device(num_gpus: float) -> torch.device:
    """CUDA when the actor was given a GPU share and CUDA exists, else CPU (never hard-coded).
    The CUDA device carries its index (the first of the GPUs Ray made visible to the actor):
    ``torch.cuda.set_device`` and NCCL refuse an index-less ``cuda``."""
    if num_gpus > 0 and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    if num_gpus > 0:
        log.warning(
            "this actor holds %g GPU(s) but CUDA is not available here: it runs on the CPU "
            "(expected only with logical GPUs, e.g. model.kind sim on a CPU machine)",
            num_gpus,
        )
    return torch.device("cpu")


def build_policy(model: ModelConfig, device: torch.device | None = None) -> MaskedImagePolicy:
    """The base policy of the registered kind ``model.kind`` (``models.registry``), on ``device``;
    with ``model.lora``, the LoRA adapter injected (``maskgrpo_ray.models.lora``: the base frozen, the
    adapter starting at zero, so the policy equals the base)."""
    policy = build_model(model, device or torch.device("cpu"))
    if model.lora is not None:
        from maskgrpo_ray.models.lora import apply_lora

        apply_lora(policy, model.lora, model.kind)
        policy.to(device or torch.device("cpu"))
    return policy


def build_reward_from_settings(
    reward: RewardSettings, device: torch.device | None = None, *, evaluation: bool = False
) -> CompositeReward:
    """The weighted reward composition (every component built now, so a missing file fails),
    with the components its diversity figures are measured in; for ``evaluation``, with the
    judge (``eval.geneval``) whose correctness is the evaluation's accuracy."""
    built = build_reward(
        list(reward.specs),
        device=device,
        diversity_embedding=reward.diversity_embedding,
        train_embedding=reward.train_embedding,
        ensemble=reward.ensemble,
    )
    return attach_judge(built, reward, device) if evaluation else built


def attach_judge(
    reward: CompositeReward, settings: RewardSettings, device: torch.device | None = None
) -> CompositeReward:
    """``reward`` as the evaluation scores with it: its parts (shared, not rebuilt) and, when
    ``settings.judge`` is set, the judge built now (:attr:`CompositeReward.judge`)."""
    if settings.judge is None:
        return reward
    judge = build_reward([settings.judge], device=device).rewards[settings.judge.name or "geneval"]
    parts = [(r, reward.weights[n]) for n, r in reward.rewards.items()]
    return CompositeReward(
        parts,
        diversity_embedding=reward.diversity_embedding,
        train_embedding=reward.train_embedding,
        ensemble=reward.ensemble,
        judge=judge,
    )


def build_filter(f: FilterSettings) -> StdHistoryFilter | None:
    if not f.enabled:
        return None
    return StdHistoryFilter(
        percentile_q=f.percentile, warmup_groups=f.warmup_groups, max_history=f.max_history
    )
