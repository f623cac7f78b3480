"""The clipped GRPO objective over unmasking steps (paper Eq. 10-12).

Pure tensor math in the style of torchtune's GRPO loss: no config objects, no distributed calls.
"""

from __future__ import annotations

import torch

STEP_SELECTIONS: tuple[str, ...] = ("all", "first", "last", "random")


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-4) -> torch.Tensor:
    """Group-relative advantages ``A_j = (r_j - mean_G r) / (std_G r + eps)`` (Eq. 12).

    Args:
        rewards: float ``[N]`` with ``N = B * G``, groups contiguous.
        group_size: ``G``.
        eps: added to the std (the official code uses 1e-4).

    Returns:
        float ``[N]``. ``std`` is the unbiased (``G - 1``) estimate as in the official code;
        equal rewards in a group, or ``G = 1``, give advantages of exactly 0, never NaN.
    """
    if rewards.numel() % group_size != 0:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    r = rewards.float().view(-1, group_size)  # [B, G]
    centred = r - r.mean(dim=1, keepdim=True)
    if group_size == 1:
        return torch.zeros_like(rewards, dtype=torch.float32)
    std = r.std(dim=1, unbiased=True, keepdim=True)  # [B, 1]
    return (centred / (std + eps)).view(-1)


def group_std(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Unbiased reward std per group, float ``[B]`` (0 for ``G = 1``)."""
    r = rewards.float().view(-1, group_size)
    if group_size == 1:
        return torch.zeros(r.shape[0])
    return r.std(dim=1, unbiased=True)


def grpo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    normalizer: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped surrogate plus optional k3 KL, averaged over (sample, step) pairs.

    ``loss = -mean min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A)
    + kl_coef * mean(exp(ref - logp) - (ref - logp) - 1)``, with
    ``ratio = exp(logp - old_logp)`` per sample and step (Eq. 10-11; the min is per pair, not
    of batch means as in the official release).

    Args:
        logp: float ``[M]`` transition log-probs under the current policy (with grad).
        old_logp: float ``[M]`` from the rollout cache.
        adv: float ``[M]`` the pair's sample advantage.
        clip_low, clip_high: the clip range ``[1 - clip_low, 1 + clip_high]``.
        ref_logp: float ``[M]`` under the frozen reference policy, or None.
        kl_coef: ``beta``; the KL term is added only when ``beta > 0`` and ``ref_logp`` is given.
        normalizer: divide the summed terms by this instead of ``M`` (micro-batching: pass the
            number of pairs in the whole update so micro-batch losses add up to the mean).

    Returns:
        ``(loss, metrics)`` with metrics ``ratio_mean``, ``clip_frac``, ``kl`` (means over ``M``).
    """
    denom = float(normalizer) if normalizer is not None else float(max(logp.numel(), 1))
    log_ratio = logp - old_logp.detach()
    ratio = torch.exp(log_ratio)
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    surrogate = torch.minimum(ratio * adv, clipped * adv)
    loss = -surrogate.sum() / denom
    kl_value = 0.0
    if ref_logp is not None and kl_coef > 0.0:
        d = ref_logp.detach() - logp
        kl = torch.exp(d) - d - 1.0  # k3 estimator, >= 0
        loss = loss + kl_coef * kl.sum() / denom
        kl_value = float(kl.detach().mean()) if kl.numel() else 0.0
    with torch.no_grad():
        is_clipped = ((ratio < 1.0 - clip_low) & (adv < 0)) | (
            (ratio > 1.0 + clip_high) & (adv > 0)
        )
        metrics = {
            "ratio_mean": float(ratio.mean()) if ratio.numel() else 1.0,
            "clip_frac": float(is_clipped.float().mean()) if ratio.numel() else 0.0,
            "kl": kl_value,
        }
    return loss, metrics


def select_train_steps(
    num_steps: int, selection: str, k: int, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Steps trained (the paper's *computational reduction*): long ``[K]`` sorted step indices.

    ``"all"`` trains every step; ``"first"``/``"last"`` the first/last ``k``; ``"random"`` ``k``
    distinct steps drawn with ``generator``.
    """
    if selection not in STEP_SELECTIONS:
        raise ValueError(f"selection must be one of {STEP_SELECTIONS}, got {selection!r}")
    if selection == "all":
        return torch.arange(num_steps)
    if not 1 <= k <= num_steps:
        raise ValueError(f"k must be in [1, {num_steps}] for selection {selection!r}, got {k}")
    if selection == "first":
        return torch.arange(k)
    if selection == "last":
        return torch.arange(num_steps - k, num_steps)
    return torch.randperm(num_steps, generator=generator)[:k].sort().values
