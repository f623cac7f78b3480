"""Likelihood estimators of a sample: one interface, two families.

The clipped GRPO objective needs, for every sample, a set of log-probability *units* under the
behaviour policy (cached at rollout), the current policy and the reference. Each unit is one
forward pass of the model on a state derived from the sample:

- ``trajectory`` (Mask-GRPO, the paper): a unit is an unmasking step ``t``; the state is the
  recorded ``Y_t`` (rebuilt from ``unmask_step``) and the log-prob is the step's transition
  probability (``transition.step_log_prob``: Eq. 13, 14, 15, or Eq. 14's Gumbel marginal).
- ``forward`` (the forward-process or "re-mask the final sample" view of MaskGRPO on MMaDA, Ma
  et al. 2026; MaskFocus; UDM-GRPO): a unit is a *mask draw* ``k``; the state is the final tokens
  with a seeded random set of ``c_k`` positions re-masked, and the log-prob is the masked
  positions' ``log p(x_i | state, prompt)``, summed or averaged. The sampler is a black box:
  only the final tokens, one seed per sample and the mask sizes ``c [K]`` travel.

Masks are a pure function of ``(seed, draw, count, L)`` computed on the CPU with its own
generator (:func:`forward_masks`), so the rollout actor, every learner rank and the reference
policy see identical masks on any device, and the ratio before the first update is exactly 1.

Shapes: ``N`` samples, ``L`` image tokens, ``V`` codebook size (also the mask value), ``K`` mask
draws per sample, ``M`` (sample, unit) pairs of one forward pass.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from maskgrpo_ray.algo.grpo import critical_steps, group_agreement, prediction_agreement
from maskgrpo_ray.algo.transition import step_log_prob

ESTIMATORS: tuple[str, ...] = ("trajectory", "forward")
MASK_RATIO_RULES: tuple[str, ...] = ("stratified", "uniform", "step_focus")
REDUCTIONS: tuple[str, ...] = ("mean", "sum")
COUPLINGS: tuple[str, ...] = ("none", "complementary")
_MIX = 0x9E3779B97F4A7C15  # golden-ratio odd constant: decorrelates (seed, draw) streams
_RATIO_STREAM = 1 << 20  # the draw index reserved for a sample's ratio draws


@dataclass(frozen=True)
class ForwardSettings:
    """The forward estimator's settings (``likelihood.forward.*``)."""

    num_draws: int  # K, seeded masks per sample
    ratio_min: float  # smallest share of the L tokens re-masked
    ratio_max: float  # largest share
    ratio_rule: str  # "stratified" | "uniform" | "step_focus"
    reduction: str  # "mean" | "sum" over the masked positions
    coupling: str = "none"  # "complementary": draws 2j, 2j+1 mask complementary position sets

    def __post_init__(self) -> None:
        if self.num_draws < 1:
            raise ValueError(f"num_draws must be >= 1, got {self.num_draws}")
        if not 0.0 < self.ratio_min <= self.ratio_max <= 1.0:
            raise ValueError(
                f"need 0 < ratio_min <= ratio_max <= 1, got {self.ratio_min}, {self.ratio_max}"
            )
        if self.ratio_rule not in MASK_RATIO_RULES:
            raise ValueError(f"ratio_rule must be one of {MASK_RATIO_RULES}: {self.ratio_rule!r}")
        if self.reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}: {self.reduction!r}")
        if self.coupling not in COUPLINGS:
            raise ValueError(f"coupling must be one of {COUPLINGS}: {self.coupling!r}")
        if self.coupling == "complementary" and (
            self.num_draws % 2 or self.ratio_rule == "step_focus"
        ):
            raise ValueError(
                "complementary coupling needs an even num_draws and the stratified or uniform "
                f"ratio rule, got {self.num_draws}, {self.ratio_rule!r}"
            )


def _stream_seed(seed: int, draw: int) -> int:
    """A 63-bit seed for the ``(seed, draw)`` stream (splitmix-style odd-constant mix)."""
    return (int(seed) + (int(draw) + 1) * _MIX) % (1 << 63)


def mask_counts(
    seeds: torch.Tensor,
    s: ForwardSettings,
    num_tokens: int,
    focus_counts: torch.Tensor | None = None,
) -> torch.Tensor:
    """How many of the ``L`` tokens each draw re-masks: long ``[N, K]``, each in ``[1, L]``.

    Args:
        seeds: long ``[N]``, one mask seed per sample.
        s: the forward settings.
        num_tokens: ``L``.
        focus_counts: long ``[N, K]``, for ``step_focus`` only: the masked counts of the
            trajectory's chosen steps (:func:`focus_step_counts`).

    Rules (ratio ``r`` -> count ``clamp(ceil(r * L), 1, L)``):
        ``stratified``: ``r_k = lo + (hi - lo) (k + 1) / K``, the same for every sample
        (MaskGRPO on MMaDA: ``t_j = gamma + (1 - gamma)(j + 1)/mu`` with ``hi = 1``).
        ``uniform``: ``r_k ~ U(lo, hi)`` from the sample's seed.
        ``step_focus``: ``focus_counts`` as given.
    """
    n, k = seeds.shape[0], s.num_draws
    if s.ratio_rule == "step_focus":
        if focus_counts is None or focus_counts.shape != (n, k):
            raise ValueError(f"step_focus needs focus_counts [N={n}, K={k}]")
        return focus_counts.long().clamp(1, num_tokens)
    if s.coupling == "complementary":  # K / 2 ratios; each pair's second mask the complement
        first = _rule_counts(seeds, s, k // 2, num_tokens).clamp(1, num_tokens - 1)  # [N, K/2]
        return torch.stack([first, num_tokens - first], dim=2).view(n, k)
    return _rule_counts(seeds, s, k, num_tokens)


def _rule_counts(seeds: torch.Tensor, s: ForwardSettings, k: int, num_tokens: int) -> torch.Tensor:
    """``k`` mask counts per sample under the stratified or uniform rule: long ``[N, k]``."""
    n = seeds.shape[0]
    if s.ratio_rule == "stratified":
        steps = (torch.arange(k, dtype=torch.float64) + 1) / k
        ratios = (s.ratio_min + (s.ratio_max - s.ratio_min) * steps).expand(n, k)  # [N, K]
    else:
        rows = []
        for seed in seeds.tolist():
            g = torch.Generator().manual_seed(_stream_seed(seed, _RATIO_STREAM))
            rows.append(torch.rand(k, generator=g, dtype=torch.float64))
        ratios = s.ratio_min + (s.ratio_max - s.ratio_min) * torch.stack(rows)  # [N, K]
    return torch.ceil(ratios * num_tokens - 1e-9).long().clamp(1, num_tokens)


def forward_masks(
    seeds: torch.Tensor,
    draws: torch.Tensor,
    counts: torch.Tensor,
    num_tokens: int,
    coupling: str = "none",
) -> torch.Tensor:
    """The re-masked positions of (sample, draw) pairs: bool ``[M, L]``, on the CPU.

    Args:
        seeds: long ``[M]``, each pair's sample mask seed.
        draws: long ``[M]``, the draw index ``k``.
        counts: long ``[M]``, positions to mask (``c_k`` of the pair's sample).
        num_tokens: ``L``.
        coupling: ``"complementary"`` (coupled-GRPO, arXiv 2506.20639): an odd draw ``2j + 1``
            masks the positions its pair's draw ``2j`` leaves (with ``counts`` complementary,
            as :func:`mask_counts` gives them), so every token is scored exactly once per pair.

    Returns:
        Pair ``m`` masks the ``counts[m]`` positions with the smallest of ``L`` uniforms drawn
        from a CPU generator seeded by ``(seeds[m], draws[m])`` alone: a uniformly random subset
        of that size, the same whatever the other pairs, the device or the process. Coupled, an
        odd draw masks the ``counts[m]`` *largest* of its pair's uniforms: the complement.
    """
    m = seeds.shape[0]
    out = torch.zeros(m, num_tokens, dtype=torch.bool)
    coupled = coupling == "complementary"
    for row, (seed, draw, count) in enumerate(
        zip(seeds.tolist(), draws.tolist(), counts.tolist(), strict=True)
    ):
        second = coupled and draw % 2 == 1
        g = torch.Generator().manual_seed(_stream_seed(seed, draw - 1 if second else draw))
        order = torch.rand(num_tokens, generator=g).argsort()
        out[row, order[num_tokens - count :] if second else order[:count]] = True
    return out


def masked_token_log_prob(
    logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor, reduction: str
) -> torch.Tensor:
    """``sum`` (or ``mean``) over masked positions of ``log softmax(logits)[target]``: ``[M]``.

    Args:
        logits: float ``[M, L, V]`` at the re-masked state (temperature applied).
        targets: long ``[M, L]``, the sample's final tokens.
        mask: bool ``[M, L]``, the re-masked positions (the ones scored).
        reduction: ``"sum"`` (the log-likelihood of the masked tokens given the rest) or
            ``"mean"`` (divided by the number of masked positions).
    """
    logp = torch.log_softmax(logits.float(), dim=-1)  # [M, L, V]
    tok = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # [M, L]
    total = torch.where(mask, tok, torch.zeros_like(tok)).sum(-1)  # [M]
    if reduction == "sum":
        return total
    if reduction == "mean":
        return total / mask.sum(-1).clamp(min=1)
    raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")


def focus_step_counts(
    predictions: torch.Tensor,
    final_tokens: torch.Tensor,
    unmask_step: torch.Tensor,
    k: int,
    group_size: int = 1,
) -> torch.Tensor:
    """MaskFocus-style step focus: the masked counts of each sample's ``K`` critical steps.

    MaskFocus (Meissonic) ranks a trajectory's steps by ``|delta cos-sim|`` between the VQ
    embedding of the step's predicted image and the final one, keeps the top ``K`` and scores a
    random mask *of that step's size* (not the trajectory's own mask). The steps are
    :func:`maskgrpo_ray.algo.grpo.critical_steps` of the group's token agreement (the one
    definition the ``critical`` step selection also uses: candidates ``1 .. S-2``, steps ``0``
    and ``S - 1`` after them); a step's count is the tokens masked before it.

    Args:
        predictions: long ``[N, S, L]``, the sampler's token at every position at each step.
        final_tokens: long ``[N, L]``.
        unmask_step: long ``[N, L]``, the step that committed each position (-1: given).
        k: ``K <= S``.
        group_size: ``G``, samples of one prompt (consecutive rows); they share the steps.

    Returns:
        long ``[N, K]``, ordered by step.
    """
    agree = prediction_agreement(predictions, final_tokens, unmask_step)  # [N, S]
    steps = critical_steps(group_agreement(agree, group_size), k)  # [N, K]
    s = predictions.shape[1]
    t = torch.arange(s, device=unmask_step.device).view(1, s, 1)
    masked_before = (unmask_step.unsqueeze(1) >= t).sum(-1)  # [N, S]
    return masked_before.gather(1, steps.to(masked_before.device))


@dataclass(frozen=True)
class PairQuery:
    """One forward pass's worth of (sample, unit) pairs: the model input and how to score it."""

    state: torch.Tensor  # [R, L] long, model input (masked = V); R = M unless shared
    num_tokens: torch.Tensor  # [M] float, tokens the pair's log-prob covers
    score: Callable[[torch.Tensor], torch.Tensor]  # logits [R, L, V] (temperature applied) -> [M]
    # [R] long, the pair whose condition each input row takes (trajectory shrinkage: pairs of
    # one sample and block share a row); None: one row per pair, R = M
    rows: torch.Tensor | None = None


def trajectory_query(
    final_tokens: torch.Tensor,
    unmask_step: torch.Tensor,
    steps: torch.Tensor,
    codebook_size: int,
    transition: str,
    *,
    sampled: torch.Tensor | None = None,
    gumbel_tau: torch.Tensor | float = 0.0,
    shrinkage: int = 1,
    sample_ids: torch.Tensor | None = None,
) -> PairQuery:
    """Pairs (sample, unmasking step): the recorded state ``Y_t`` and its transition log-prob.

    Args:
        final_tokens, unmask_step: long ``[M, L]`` of each pair's sample.
        steps: long ``[M]``, the step ``t``; transition: ``"p1" | "p2" | "ar"``.
        sampled: long ``[M, L]``, the sampled tokens at the step (``"ar"`` only).
        gumbel_tau: float ``[M]`` (or scalar), the step's recorded Gumbel temperature.
        shrinkage: ``s``, TraceRL's trajectory shrinkage: step ``t`` is scored from the state
            ``Y_{t0}`` of its block's first step ``t0 = s * floor(t / s)`` (its own masked and
            newly unmasked sets, under those logits), and the pairs of one sample and block
            share one input row, so ``S`` steps cost ``ceil(S / s)`` rows (and their
            ``log_softmax``; the per-pair terms, Eq. 14's sums and the Gumbel marginal, stay one
            per pair: ``transition.step_log_prob``'s ``pair_rows``). ``1``: the exact
            ``Y_t`` per pair. Biased for ``s > 1``: a later step of a block is scored from an
            earlier, more masked state than the one it was sampled in.
        sample_ids: long ``[M]``, which sample each pair is (pairs of one sample and block
            share a row; needed for ``s > 1``, default: every pair its own sample).
    """
    t = steps.view(-1, 1)
    masked = unmask_step >= t  # [M, L]
    unmasked = unmask_step == t
    target = sampled if sampled is not None else final_tokens
    covered = unmasked if transition == "p2" else masked
    if shrinkage == 1:
        state = torch.where(masked, torch.full_like(final_tokens, codebook_size), final_tokens)

        def score(logits: torch.Tensor) -> torch.Tensor:
            return step_log_prob(
                logits, masked, unmasked, target, transition, gumbel_tau=gumbel_tau
            )

        return PairQuery(state, covered.sum(-1).float(), score)
    rows, inverse, start = shrunk_rows(steps, shrinkage, sample_ids)
    state_masked = unmask_step[rows] >= start[rows].view(-1, 1)  # [R, L], Y_t0
    state = torch.where(
        state_masked, torch.full_like(final_tokens[rows], codebook_size), final_tokens[rows]
    )

    def shrunk(logits: torch.Tensor) -> torch.Tensor:  # [R, L, V] -> [M]
        # scored on the rows forwarded: one log_softmax per row, each pair reading its row
        return step_log_prob(
            logits, masked, unmasked, target, transition, gumbel_tau=gumbel_tau, pair_rows=inverse
        )

    return PairQuery(state, covered.sum(-1).float(), shrunk, rows)


def shrunk_rows(
    steps: torch.Tensor, shrinkage: int, sample_ids: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The input rows of trajectory shrinkage: pairs ``(sample_ids[m], steps[m])`` with the
    same sample and block ``floor(t / s)`` share one.

    Returns:
        ``rows`` long ``[R]`` (the first pair of each row, rows ordered by sample then block),
        ``inverse`` long ``[M]`` (each pair's row) and ``start`` long ``[M]`` (each pair's
        block start ``t0 = s * floor(t / s)``).
    """
    if shrinkage < 1:
        raise ValueError(f"shrinkage must be >= 1, got {shrinkage}")
    m = steps.shape[0]
    ids = sample_ids if sample_ids is not None else torch.arange(m, device=steps.device)
    start = torch.div(steps, shrinkage, rounding_mode="floor") * shrinkage  # [M]
    span = int(steps.max()) + 1 if m else 1
    _, inverse = torch.unique(ids.to(steps.device) * span + start, return_inverse=True)
    r = int(inverse.max()) + 1 if m else 0
    pair = torch.arange(m, device=steps.device)
    rows = torch.full((r,), m, dtype=torch.long, device=steps.device)
    rows = rows.scatter_reduce(0, inverse, pair, reduce="amin")
    return rows, inverse, start


def forward_query(
    final_tokens: torch.Tensor,
    mask_seed: torch.Tensor,
    mask_counts: torch.Tensor,
    draws: torch.Tensor,
    codebook_size: int,
    reduction: str,
    coupling: str = "none",
) -> PairQuery:
    """Pairs (sample, mask draw): the final tokens re-masked by the seeded mask, and its score.

    Args:
        final_tokens: long ``[M, L]`` of each pair's sample.
        mask_seed: long ``[M]``, the pair's sample seed; mask_counts: long ``[M]``, ``c_k``.
        draws: long ``[M]``, the draw ``k``; reduction: ``"mean" | "sum"``.
        coupling: ``"none" | "complementary"`` (:func:`forward_masks`).
    """
    mask = forward_masks(mask_seed, draws, mask_counts, final_tokens.shape[1], coupling)
    mask = mask.to(final_tokens.device)  # [M, L]
    state = torch.where(mask, torch.full_like(final_tokens, codebook_size), final_tokens)

    def score(logits: torch.Tensor) -> torch.Tensor:
        return masked_token_log_prob(logits, final_tokens, mask, reduction)

    # per_token KL divides the log-ratio by the tokens covered; a mean already is per token
    covered = mask.sum(-1).float() if reduction == "sum" else torch.ones(mask.shape[0])
    return PairQuery(state, covered.to(final_tokens.device), score)
