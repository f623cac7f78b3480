"""Factories from the config to library objects (policy, reward, filter, optimizer)."""

from __future__ import annotations

import logging

import torch

from maskgrpo_ray.algo.filtering import StdHistoryFilter
from maskgrpo_ray.config import Config
from maskgrpo_ray.models.base import MaskedImagePolicy
from maskgrpo_ray.phases import LossGuards
from maskgrpo_ray.rewards.base import CompositeReward, RewardSpec, build_reward

log = logging.getLogger(__name__)


def resolve_device(num_gpus: float) -> torch.device:
    """CUDA when the actor was given a GPU share and CUDA exists, else CPU (never hard-coded)."""
    if num_gpus > 0 and torch.cuda.is_available():
        return torch.device("cuda")
    return torch.device("cpu")


def build_policy(cfg: Config, device: torch.device | None = None) -> MaskedImagePolicy:
    """The base policy named by ``model.kind`` (toy: pre-trained once and cached)."""
    device = device or torch.device("cpu")
    if cfg.model.kind == "toy":
        from maskgrpo_ray.models.toy import ToyModelSpec, load_or_pretrain

        t = cfg.model.toy
        spec = ToyModelSpec(
            grid=t.grid,
            cell_px=t.cell_px,
            d_model=t.d_model,
            layers=t.layers,
            heads=t.heads,
            pretrain_steps=t.pretrain_steps,
            pretrain_batch=t.pretrain_batch,
            pretrain_lr=t.pretrain_lr,
            noise_prob=t.noise_prob,
        )
        return load_or_pretrain(spec).to(device)
    from maskgrpo_ray.models.showo import policy_from_config

    return policy_from_config(cfg.model.showo, device=device)


def build_reward_from_config(cfg: Config, device: torch.device | None = None) -> CompositeReward:
    specs = []
    for c in cfg.reward.components:
        kwargs = dict(c.args)
        if c.kind == "toy_rules" and cfg.model.kind == "toy":
            kwargs.setdefault("grid", cfg.model.toy.grid)
        specs.append(RewardSpec(kind=c.kind, weight=c.weight, kwargs=kwargs))
    return build_reward(specs, device=device)


def build_filter(cfg: Config) -> StdHistoryFilter | None:
    f = cfg.filter
    if not f.enabled:
        return None
    return StdHistoryFilter(
        percentile_q=f.percentile, warmup_groups=f.warmup_groups, max_history=f.max_history
    )


def build_optimizer(cfg: Config, policy: torch.nn.Module) -> torch.optim.Optimizer:
    """AdamW; 1-D parameters and biases get no weight decay (as the official release)."""
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for p in policy.parameters():
        if p.requires_grad:
            (no_decay if p.ndim < 2 else decay).append(p)
    t = cfg.train
    return torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": t.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=t.learning_rate,
        betas=t.adam_betas,
    )


def learning_rate_at(cfg: Config, update: int) -> float:
    """Learning rate of the ``update``-th optimizer step (0-based): linear warm-up, then flat."""
    t = cfg.train
    if t.warmup_updates and update < t.warmup_updates:
        return t.learning_rate * (update + 1) / t.warmup_updates
    return t.learning_rate


def loss_guards(cfg: Config) -> LossGuards:
    """The objective's guards from ``train.*`` (a 0 in the config turns one off)."""
    t = cfg.train
    return LossGuards(
        log_ratio_clamp=t.log_ratio_clamp or None,
        dual_clip=t.dual_clip or None,
        kl_clamp=t.kl_clamp or None,
        kl_normalization=t.kl_normalization,
    )
