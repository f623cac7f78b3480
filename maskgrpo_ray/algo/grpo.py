"""The clipped GRPO objective over unmasking steps (paper Eq. 10-12).

Pure tensor math in the style of torchtune's GRPO loss: no config objects, no distributed calls.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

STEP_SELECTIONS: tuple[str, ...] = ("all", "first", "last", "random", "group_random", "window")
PER_GROUP_SELECTIONS: tuple[str, ...] = ("group_random",)


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


KL_NORMALIZATIONS: tuple[str, ...] = ("per_token", "per_transition")


def k3_kl(
    ref_logp: torch.Tensor,
    logp: torch.Tensor,
    *,
    num_tokens: torch.Tensor | None = None,
    clamp: float | None = None,
) -> torch.Tensor:
    """The k3 estimator ``exp(d) - d - 1`` with ``d = ref - logp`` per pair, float ``[M]``.

    Args:
        ref_logp, logp: float ``[M]`` transition log-probs under the reference and current policy.
        num_tokens: float/long ``[M]``, tokens the pair's transition likelihood covers; when given
            (``per_token`` normalisation) ``d`` is divided by it first, so the term is k3 of the
            *mean per-token* log-ratio. A transition log-prob sums over up to ~L tokens; k3 of
            that sum grows like ``exp(d)`` and swamps the surrogate (the toy world stops learning
            at beta = 0.05 per transition), while per token it stays on the scale of the
            per-token KL that verl, TRL and torchtune penalise.
        clamp: when given, ``d`` is clamped to ``[-clamp, clamp]`` before the exponential, so the
            term is at most ``exp(clamp) - clamp - 1`` and never overflows (float32 overflows at
            ``d`` ~ 88); outside the range the term is constant (no gradient), as in verl.
    """
    d = ref_logp.detach() - logp  # [M]
    if num_tokens is not None:
        d = d / num_tokens.to(d.dtype).clamp(min=1.0)
    if clamp is not None:
        d = d.clamp(-clamp, clamp)
    return torch.exp(d) - d - 1.0


@dataclass(frozen=True)
class LossGuards:
    """Guards of the clipped objective (see :func:`grpo_loss`); None turns one off.

    The library defaults are the plain objective; the config's defaults (``train.*``) are the
    recommended guards.
    """

    log_ratio_clamp: float | None = None
    dual_clip: float | None = None
    kl_clamp: float | None = None
    kl_normalization: str = "per_transition"  # "per_token" | "per_transition"


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
    log_ratio_clamp: float | None = None,
    dual_clip: float | None = None,
    kl_clamp: float | None = None,
    kl_num_tokens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped surrogate plus optional k3 KL, averaged over (sample, step) pairs.

    ``loss = -mean min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A)
    + kl_coef * mean(k3)``, with ``ratio = exp(logp - old_logp)`` per sample and step
    (Eq. 10-11; the min is per pair, not of batch means as in the official release).

    Guards (each off when None), for transition log-probs that sum over many tokens:

    * ``log_ratio_clamp``: ``logp - old_logp`` is clamped to ``[-c, c]`` before ``exp`` (verl
      clamps at 20), so one pair whose Eq. 14 threshold flipped cannot overflow the ratio;
    * ``dual_clip`` (``c > 1``, Ye et al. 2020, verl's ``clip_ratio_c``): for ``A < 0`` the
      surrogate is at least ``c * A``, bounding the loss of a pair whose ratio exploded;
    * ``kl_clamp`` and ``kl_num_tokens``: see :func:`k3_kl`.

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
        ``(loss, metrics)`` with metrics ``ratio_mean``, ``clip_frac``, ``dual_clip_frac``,
        ``kl`` (means over ``M``).
    """
    denom = float(normalizer) if normalizer is not None else float(max(logp.numel(), 1))
    log_ratio = logp - old_logp.detach()
    if log_ratio_clamp is not None:
        log_ratio = log_ratio.clamp(-log_ratio_clamp, log_ratio_clamp)
    ratio = torch.exp(log_ratio)
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    surrogate = torch.minimum(ratio * adv, clipped * adv)
    dual = torch.zeros_like(surrogate, dtype=torch.bool)
    if dual_clip is not None:
        if not dual_clip > 1.0:
            raise ValueError(f"dual_clip must be > 1 (verl uses 3.0), got {dual_clip}")
        floor = dual_clip * adv
        dual = (adv < 0) & (surrogate < floor)
        surrogate = torch.where(dual, floor, surrogate)
    loss = -surrogate.sum() / denom
    kl_value = 0.0
    if ref_logp is not None and kl_coef > 0.0:
        kl = k3_kl(ref_logp, logp, num_tokens=kl_num_tokens, clamp=kl_clamp)  # [M], >= 0
        loss = loss + kl_coef * kl.sum() / denom
        kl_value = float(kl.detach().mean()) if kl.numel() else 0.0
    with torch.no_grad():
        is_clipped = ((ratio < 1.0 - clip_low) & (adv < 0)) | (
            (ratio > 1.0 + clip_high) & (adv > 0)
        )
        metrics = {
            "ratio_mean": float(ratio.mean()) if ratio.numel() else 1.0,
            "clip_frac": float(is_clipped.float().mean()) if ratio.numel() else 0.0,
            "dual_clip_frac": float(dual.float().mean()) if ratio.numel() else 0.0,
            "kl": kl_value,
        }
    return loss, metrics


def select_train_steps(
    num_steps: int,
    selection: str,
    k: int,
    generator: torch.Generator | None = None,
    *,
    update: int = 0,
    window_shift: int = 1,
) -> torch.Tensor:
    """Steps trained by the whole batch (the paper's *computational reduction*): long ``[K]``
    sorted step indices.

    ``"all"`` trains every step; ``"first"``/``"last"`` the first/last ``k``; ``"random"`` ``k``
    distinct steps drawn with ``generator``; ``"window"`` the ``k`` consecutive steps starting
    at ``(update // window_shift) mod (S - k + 1)`` (a window sliding early to late over the
    updates, then again: MixGRPO's). ``"group_random"`` is per group:
    :func:`select_group_steps`.
    """
    if selection not in STEP_SELECTIONS or selection in PER_GROUP_SELECTIONS:
        raise ValueError(
            f"selection must be one of {STEP_SELECTIONS} but group_random (per group), got {selection!r}"
        )
    if selection == "all":
        return torch.arange(num_steps)
    if not 1 <= k <= num_steps:
        raise ValueError(f"k must be in [1, {num_steps}] for selection {selection!r}, got {k}")
    if selection == "first":
        return torch.arange(k)
    if selection == "last":
        return torch.arange(num_steps - k, num_steps)
    if selection == "window":
        start = (update // max(1, window_shift)) % (num_steps - k + 1)
        return torch.arange(start, start + k)
    return torch.randperm(num_steps, generator=generator)[:k].sort().values


def select_group_steps(
    num_steps: int, k: int, num_groups: int, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Iso-temporal subsets (Flash-GRPO's grouping): ``k`` distinct steps drawn uniformly for
    each of ``B`` groups, independently, long ``[B, K]`` sorted per row. Every sample of a group
    trains the same steps, so the group's advantages compare like with like.

    Unbiased: each step is in a group's subset with probability ``k / S``, so the mean of the
    clipped objective over the ``k`` drawn steps has, over the draws, the expectation of its mean
    over all ``S`` (its gradient too; ``tests/test_algo_step_subsets.py`` enumerates it).
    """
    if not 1 <= k <= num_steps:
        raise ValueError(f"k must be in [1, {num_steps}] for group_random, got {k}")
    order = torch.rand(num_groups, num_steps, generator=generator).argsort(dim=1)  # [B, S]
    return order[:, :k].sort(dim=1).values


def prediction_agreement(
    predictions: torch.Tensor, final_tokens: torch.Tensor, unmask_step: torch.Tensor
) -> torch.Tensor:
    """``a_t``: the share of the ``L`` tokens where step ``t``'s predicted image equals the final
    sample, float ``[N, S]``. Step ``t``'s prediction is MaskFocus's ``pred_original_sample``:
    the sampled token at every position still masked before the step, the committed token
    elsewhere (so ``a_{S-1} = 1``).

    Args:
        predictions: long ``[N, S, L]``, the sampler's token at every position at each step.
        final_tokens: long ``[N, L]``.
        unmask_step: long ``[N, L]``, the step that committed each position (-1: given).
    """
    s = predictions.shape[1]
    steps = torch.arange(s, device=predictions.device).view(1, s, 1)
    masked = unmask_step.unsqueeze(1) >= steps  # [N, S, L], masked before step t
    pred = torch.where(masked, predictions, final_tokens.unsqueeze(1))  # [N, S, L]
    return (pred == final_tokens.unsqueeze(1)).float().mean(-1)


def group_agreement(agreement: torch.Tensor, group_size: int) -> torch.Tensor:
    """Each group's mean agreement per step, one row per sample (equal within a group): float
    ``[N, S]`` from ``agreement`` ``[N, S]`` (:func:`prediction_agreement`). MaskFocus scores
    steps by the batch's mean similarity; a group's mean is what one rollout actor sees (it
    generates whole groups), and it gives a group's members the same critical steps."""
    n, s = agreement.shape
    if group_size < 1 or n % group_size:
        raise ValueError(f"{n} samples do not split into groups of {group_size}")
    mean = agreement.view(n // group_size, group_size, s).mean(1)  # [B, S]
    return mean.repeat_interleave(group_size, dim=0)


def critical_steps(agreement: torch.Tensor, k: int) -> torch.Tensor:
    """MaskFocus's critical steps (zghhui/MaskFocus ``grpo_trainer.py``): the ``k`` steps whose
    prediction moved the intermediate image furthest towards the final one, long ``[N, K]``
    sorted per row; the one definition of a step's focus score (``train.unmasking_step_selection:
    critical`` trains these steps, ``likelihood.forward.ratio_rule: step_focus`` masks their
    sizes, :func:`maskgrpo_ray.algo.estimators.focus_step_counts`).

    MaskFocus measures ``sim_t = cos(VQ embedding of step t's predicted image, the final's)``,
    averaged over the batch, for the steps before the last (the last prediction *is* the
    final), and trains the ``k`` steps ``t`` with the largest ``|sim_t - sim_{t-1}|`` (its index
    ``i`` of ``|sim_{i+1} - sim_i|`` trains the state after step ``i``, the input of step
    ``t = i + 1``). Here ``sim_t`` is the token agreement ``a_t`` (:func:`prediction_agreement`:
    model-agnostic, and for a lookup-free quantizer such as MAGVIT-v2's, whose codes are sign
    vectors, the embedding cosine is an affine function of the bit agreement, which token
    agreement bounds from below), averaged over the sample's group (:func:`group_agreement`,
    which the rollout records), so a group's members train the same steps and the group's
    advantages at every trained step still sum to zero. Each row is scored on its own: rows
    equal within a group give the group one choice on any sharding over learner ranks.
    Candidates are ``t = 1 .. S-2``, as MaskFocus's; steps ``0`` and ``S - 1``, which it never
    scores, rank after every scored step, ``0`` first (so ``k = S`` trains all steps). Ties: the
    earlier step.

    Args:
        agreement: float ``[N, S]``, ``a_t`` per sample (its group's, :func:`group_agreement`).
        k: ``1 <= k <= S``.
    """
    n, s = agreement.shape
    if not 1 <= k <= s:
        raise ValueError(f"k must be in [1, {s}] for critical steps, got {k}")
    a = agreement.double()
    jump = torch.full_like(a, -1.0)  # unscored: below every |delta| (>= 0)
    if s >= 3:
        jump[:, 1 : s - 1] = (a[:, 1 : s - 1] - a[:, : s - 2]).abs()
    jump[:, s - 1] = -2.0  # the final step: last
    # stable top-k: ties towards earlier steps
    key = jump - torch.arange(s, dtype=torch.float64, device=a.device) * 1e-9
    return key.topk(k, dim=1).indices.sort(dim=1).values
