"""Advantages beyond plain GRPO: diversity-aware (GARDO, a diversity bonus) and multi-reward
(GDPO). Pure tensor math: rewards and per-sample figures in, advantages ``[N]`` out.

Shapes: ``N = B * G`` samples, groups of ``G`` contiguous; ``C`` reward components.
"""

from __future__ import annotations

import torch

from maskgrpo_ray.algo.grpo import group_advantages

ADVANTAGE_KINDS: tuple[str, ...] = ("grpo", "centred", "gdpo", "batch_std")
DIVERSITY_KINDS: tuple[str, ...] = ("none", "gardo", "bonus")


def centred_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """``A_j = r_j - mean_G r``, float ``[N]`` (no division by the group's std: GARDO's and
    Dr. GRPO's form; equal rewards or ``G = 1`` give 0)."""
    r = rewards.float().view(-1, group_size)  # [B, G]
    return (r - r.mean(dim=1, keepdim=True)).view(-1)


def batch_std_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-4) -> torch.Tensor:
    """``A_j = (r_j - mean_G r) / (std_N r + eps)``, float ``[N]``: centred in its group, divided
    by the whole batch's reward std (unbiased; Flow-GRPO's ``global_std``), so a group whose
    rewards barely differ keeps small advantages instead of having its noise blown up to unit
    size. One sample: 0."""
    r = rewards.float()
    if r.numel() < 2:
        return torch.zeros_like(r)
    return centred_advantages(r, group_size) / (r.std(unbiased=True) + eps)


def clip_advantages(adv: torch.Tensor, clip: float) -> torch.Tensor:
    """``adv`` clamped to ``[-clip, clip]`` (Flow-GRPO clips at 5); ``clip`` 0: unchanged."""
    return adv.clamp(-clip, clip) if clip > 0 else adv


def gdpo_advantages(
    parts: torch.Tensor, weights: torch.Tensor, group_size: int, eps: float = 1e-4
) -> torch.Tensor:
    """GDPO (arXiv 2601.05242): each reward component normalised within its group, the weighted
    sum of those, normalised over the batch.

    ``A = (s - mean_N s) / (std_N s + eps)`` with ``s_j = sum_c w_c (r_cj - mean_G r_c) /
    (std_G r_c + eps)``: a plain sum ``sum_c w_c r_c`` maps different reward combinations to the
    same advantage (a large swing in one component drowns a small one in another); normalising
    each component first gives each the same say per unit of its own spread.

    Args:
        parts: float ``[C, N]``, the components' rewards (finite).
        weights: float ``[C]``, the components' weights ``w_c``.
        group_size: ``G``.
        eps: added to each std.

    Returns:
        float ``[N]``; 0 everywhere when every component is constant within every group.
    """
    if parts.dim() != 2 or weights.shape != (parts.shape[0],):
        raise ValueError(
            f"parts must be [C, N] and weights [C], got {parts.shape}, {weights.shape}"
        )
    per = torch.stack([group_advantages(p, group_size, eps) for p in parts])  # [C, N]
    s = (weights.float().view(-1, 1) * per).sum(0)  # [N]
    if s.numel() < 2:
        return torch.zeros_like(s)
    return (s - s.mean()) / (s.std(unbiased=True) + eps)


GARDO_NORMALIZATIONS: tuple[str, ...] = ("group", "positive")


def gardo_scale(
    adv: torch.Tensor,
    distance: torch.Tensor,
    group_size: int,
    eps: float = 1e-8,
    over: str = "group",
) -> torch.Tensor:
    """GARDO's diversity-aware advantages (arXiv 2512.24138): each *positive* advantage times
    ``d_j / mean_G d``, the sample's distance to its nearest other group member over the group's
    mean distance; negative (and zero) advantages unchanged.

    A correct image that another member of its group repeats (``d = 0``) is not reinforced; a
    correct one that stands apart is reinforced more. Over a group the expected reinforcement of
    an image drawn with probability ``q`` goes like ``q (1 - q)^(G-1)`` (it counts only when not
    repeated), so rarely drawn good images gain on frequent ones: mode coverage, not collapse.

    Args:
        adv: float ``[N]``, the advantages to scale (GARDO: :func:`centred_advantages`).
        distance: float ``[N]``, each sample's diversity figure (``diversity/nn``), >= 0.
        group_size: ``G``.
        eps: guards a group whose distances are all 0 (all members alike: their rewards, and
            so their advantages, are then equal, and no positive one exists).
        over: the mean the distance is divided by: ``group`` (GARDO's: all ``G`` members) or
            ``positive`` (the members with a positive advantage only: the positive advantages
            keep their sum's scale and are only redistributed towards the ones that stand
            apart; where good images are nearer to each other than bad ones, as the toy's
            clean scenes are in its cell space, ``group`` shrinks every positive advantage and
            the update is left to the negative ones).

    Returns:
        float ``[N]``.
    """
    if over not in GARDO_NORMALIZATIONS:
        raise ValueError(f"over must be one of {GARDO_NORMALIZATIONS}, got {over!r}")
    d = distance.float().clamp(min=0.0).view(-1, group_size)  # [B, G]
    if over == "group":
        mean = d.mean(dim=1, keepdim=True)  # [B, 1]
    else:
        pos = (adv.view(-1, group_size) > 0).float()
        mean = (d * pos).sum(dim=1, keepdim=True) / pos.sum(dim=1, keepdim=True).clamp(min=1)
    scale = (d / (mean + eps)).view(-1)  # [N]
    return torch.where(adv > 0, adv * scale, adv)


def diversity_advantages(
    rewards: torch.Tensor,
    group_size: int,
    *,
    kind: str = "grpo",
    diversity: str = "none",
    distance: torch.Tensor | None = None,
    bonus_weight: float = 0.0,
    gardo_over: str = "group",
    recentre: bool = False,
    parts: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
    eps: float = 1e-4,
) -> torch.Tensor:
    """The advantages of a batch of groups: the base rule ``kind`` (``grpo``: Eq. 12;
    ``centred``: ``r - mean_G r``; ``gdpo``: :func:`gdpo_advantages` of ``parts`` and
    ``weights``), with the ``diversity`` rule applied: ``none``; ``gardo``
    (:func:`gardo_scale` of the base advantages by ``distance``); ``bonus`` (the group-relative
    diversity bonus: ``bonus_weight * distance`` added to the reward before the base rule; under
    GDPO it joins the components as one more, of weight ``bonus_weight``).

    ``kind="grpo", diversity="none"`` is exactly :func:`~maskgrpo_ray.algo.grpo.group_advantages`.
    """
    if kind not in ADVANTAGE_KINDS or diversity not in DIVERSITY_KINDS:
        raise ValueError(
            f"kind {kind!r} / diversity {diversity!r} not in {ADVANTAGE_KINDS} / {DIVERSITY_KINDS}"
        )
    if diversity != "none" and (distance is None or distance.shape != rewards.shape):
        raise ValueError(f"diversity {diversity!r} needs a distance [N={rewards.numel()}]")
    if diversity == "bonus":
        assert distance is not None
        bonus = bonus_weight * distance.float()
        if kind == "gdpo":
            assert parts is not None and weights is not None
            parts = torch.cat([parts, distance.float().view(1, -1)])
            weights = torch.cat([weights.float(), torch.tensor([bonus_weight])])
        rewards = rewards.float() + bonus
    if kind == "grpo":
        adv = group_advantages(rewards, group_size, eps)
    elif kind == "centred":
        adv = centred_advantages(rewards, group_size)
    elif kind == "batch_std":
        adv = batch_std_advantages(rewards, group_size, eps)
    else:
        if parts is None or weights is None:
            raise ValueError("kind 'gdpo' needs the reward components (parts [C, N], weights [C])")
        adv = gdpo_advantages(parts, weights, group_size, eps)
    if diversity == "gardo":
        assert distance is not None
        adv = gardo_scale(adv, distance, group_size, over=gardo_over)
        if recentre:  # zero-sum per group again: shifts credit from repeats to novel samples
            a = adv.view(-1, group_size)
            adv = (a - a.mean(dim=1, keepdim=True)).view(-1)
    return adv
