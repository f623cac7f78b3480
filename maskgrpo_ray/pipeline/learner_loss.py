"""The learner's loss: the clipped GRPO objective's gradients over a batch's (sample, unit) pairs.

A pair is a sample and one of its likelihood units: an unmasking step (trajectory estimator) or a
mask draw (forward estimator). :func:`pair_query` rebuilds the pairs' model input from the
rollout's record, :func:`unit_log_probs` scores it (the one function that runs the model on a
likelihood unit: the rollout's forward estimator and the KL reference call it too), and
:func:`accumulate_gradients` backpropagates ``algo.grpo.grpo_loss`` over all pairs in
micro-batches. ``learner_core.apply_update`` calls it once per optimizer step, in the
single-process trainer and on every DeepSpeed rank alike.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

import torch

from maskgrpo_ray.algo.estimators import PairQuery, forward_query, trajectory_query
from maskgrpo_ray.algo.grpo import LossGuards, grpo_loss
from maskgrpo_ray.models.base import MaskedImagePolicy
from maskgrpo_ray.pipeline.messages import TrainBatch

log = logging.getLogger(__name__)


def pair_query(
    batch: TrainBatch,
    samples: torch.Tensor,
    units: torch.Tensor,
    codebook_size: int,
    device: torch.device | str = "cpu",
    shrinkage: int = 1,
) -> PairQuery:
    """The model input and scoring of (sample, unit) pairs under the batch's estimator, on
    ``device``. A unit is an unmasking step (trajectory: the recorded state ``Y_t`` and the
    rollout's transition definition; with ``shrinkage`` s > 1 the state of the step's block's
    first step, one input row per sample and block) or a mask draw (forward: the final tokens
    re-masked by the seeded mask, built on the CPU). ``samples`` and ``units`` are long ``[M]``
    on the CPU."""
    final = batch.final_tokens[samples].to(device)
    if batch.estimator == "forward":
        assert batch.mask_seed is not None and batch.mask_counts is not None
        return forward_query(
            final,
            batch.mask_seed[samples],
            batch.mask_counts[samples, units],
            units,
            codebook_size,
            batch.forward_reduction,
            batch.forward_coupling,
        )
    assert batch.unmask_step is not None
    sampled = batch.sampled[samples, units].to(device) if batch.sampled is not None else None
    return trajectory_query(
        final,
        batch.unmask_step[samples].to(device),
        units.to(device),
        codebook_size,
        batch.transition,
        sampled=sampled,
        gumbel_tau=batch.likelihood_tau[units].to(device),
        shrinkage=shrinkage,
        sample_ids=samples.to(device),
    )


def unit_log_probs(
    policy: MaskedImagePolicy,
    cond_ids: torch.Tensor,
    guidance_scale: float,
    temperature: float,
    query: PairQuery,
) -> torch.Tensor:
    """One forward pass of ``policy`` on the query's states, scored: float ``[M]``.

    The one place a likelihood unit is evaluated: the rollout (old log-probs under the forward
    estimator), the learner and the reference all call it, with the same guidance and
    temperature.
    """
    device = next(policy.parameters()).device
    if query.rows is not None:  # pairs sharing an input row (trajectory shrinkage)
        cond_ids = cond_ids[query.rows.to(cond_ids.device)]
    logits = policy.conditioned(cond_ids.to(device), guidance_scale)(query.state.to(device))
    return query.score(logits / temperature)


def pair_log_probs(
    policy: MaskedImagePolicy,
    batch: TrainBatch,
    samples: torch.Tensor,
    steps: torch.Tensor,
    shrinkage: int = 1,
) -> torch.Tensor:
    """Log-probs of (sample, unit) pairs in one forward: float ``[M]``.

    Rebuilds each pair's input from the record and scores it under the policy's current weights
    (same guidance and temperature as the rollout): the transition of unmasking step ``steps[m]``
    (trajectory estimator) or the re-masked final tokens of mask draw ``steps[m]`` (forward).
    """
    device = next(policy.parameters()).device
    query = pair_query(batch, samples, steps, policy.codebook_size, device, shrinkage)
    return unit_log_probs(
        policy, batch.cond_ids[samples], batch.guidance_scale, batch.temperature, query
    )


def abs_log_ratio_stats(abs_lr: torch.Tensor, steps: torch.Tensor) -> dict[str, float]:
    """Spread of ``|log pi - log pi_old|`` over the update's pairs (float ``[M]``, steps
    ``[M]``): mean, 90th percentile, max, and the unmasking step with the largest mean."""
    if abs_lr.numel() == 0:
        return {}
    per_step = torch.zeros(int(steps.max()) + 1).index_add_(0, steps, abs_lr)
    counts = torch.zeros_like(per_step).index_add_(0, steps, torch.ones_like(abs_lr))
    per_step = per_step / counts.clamp(min=1)
    return {
        "abs_log_ratio_mean": float(abs_lr.mean()),
        "abs_log_ratio_p90": float(torch.quantile(abs_lr.double(), 0.9)),
        "abs_log_ratio_max": float(abs_lr.max()),
        "abs_log_ratio_worst_step": float(per_step.argmax()),
    }


def onpolicy_figures(
    logp: torch.Tensor, cached: torch.Tensor, steps: torch.Tensor, measured: torch.Tensor
) -> dict[str, float]:
    """The learner's log-probs ``logp`` against the rollout's ``cached`` ones over the pairs
    ``measured`` (all float ``[M]``, steps long ``[M]``, measured bool ``[M]``): the spread
    of ``|log-ratio|`` (:func:`abs_log_ratio_stats`), ``first_ratio_abs_dev_max``
    (``max |exp(log-ratio) - 1|``) and ``onpolicy_measured_share`` (the share of the pairs
    measured). Nothing measured: only the share (0), the figures absent, never 0."""
    out = {"onpolicy_measured_share": float(measured.float().mean()) if len(measured) else 0.0}
    if not bool(measured.any()):
        return out
    lr = (logp[measured] - cached[measured]).double()
    out["first_ratio_abs_dev_max"] = float((lr.exp() - 1.0).abs().max())
    return out | abs_log_ratio_stats(lr.abs().float(), steps[measured])


def train_pairs(batch: TrainBatch, train_steps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """All (sample, unit) pairs trained this update: long ``[M]`` each, sample-major.
    ``train_steps``: long ``[K]`` (every sample trains the same units) or ``[N, K]`` (per
    sample)."""
    n = batch.num_samples
    if train_steps.dim() == 2:
        if train_steps.shape[0] != n:
            raise ValueError(f"per-sample units {tuple(train_steps.shape)} for {n} samples")
        k = train_steps.shape[1]
        return torch.arange(n).repeat_interleave(k), train_steps.reshape(-1)
    samples = torch.arange(n).repeat_interleave(len(train_steps))
    steps = train_steps.repeat(n)
    return samples, steps


def micro_batches(
    samples: torch.Tensor, units: torch.Tensor, micro_batch: int, shrinkage: int = 1
) -> list[slice]:
    """The pair ranges of an update's micro-batches: at most ``micro_batch`` model input rows
    each. A row is a pair, or under trajectory ``shrinkage`` s > 1 the pairs of one sample and
    block (``t // s``) that follow each other (sample-major, sorted units: all of them), never
    cut between two micro-batches, so a forward holds ``micro_batch`` rows at any ``s`` (up to
    ``s`` times as many pairs). ``samples``, ``units``: long ``[M]``, in training order."""
    m = len(samples)
    if shrinkage <= 1 or m == 0:
        return [slice(a, min(a + micro_batch, m)) for a in range(0, m, micro_batch)]
    key = samples * (int(units.max()) + 1) + torch.div(units, shrinkage, rounding_mode="floor")
    new_row = torch.ones(m, dtype=torch.bool)
    new_row[1:] = key[1:] != key[:-1]
    chunk = torch.div(new_row.cumsum(0) - 1, micro_batch, rounding_mode="floor")  # [M]
    counts = torch.unique_consecutive(chunk, return_counts=True)[1].tolist()
    ends = torch.tensor(counts).cumsum(0).tolist()
    return [slice(e - c, e) for c, e in zip(counts, ends, strict=True)]


def input_rows(units: torch.Tensor, shrinkage: int) -> int:
    """Model input rows per sample that training ``units`` (long ``[K]``, sorted) takes: the
    distinct blocks ``t // s`` (``K`` at ``s = 1``)."""
    if shrinkage <= 1:
        return int(units.numel())
    return int(torch.unique(torch.div(units, shrinkage, rounding_mode="floor")).numel())


def accumulate_gradients(
    policy: MaskedImagePolicy,
    batch: TrainBatch,
    *,
    train_steps: torch.Tensor,
    micro_batch: int,
    clip_low: float,
    clip_high: float,
    kl_coef: float = 0.0,
    ref_policy: MaskedImagePolicy | None = None,
    backward: Any = None,
    normalizer: float | None = None,
    guards: LossGuards | None = None,
    autocast: str = "off",
    anchor: Anchor | None = None,
    shrinkage: int = 1,
    rollout_logp: torch.Tensor | None = None,
) -> dict[str, float]:
    """Backpropagate the clipped GRPO loss over all trained pairs in micro-batches
    (:func:`micro_batches`: ``micro_batch`` model input rows each).

    ``autocast="bf16"`` runs the policy's (and the reference's) forward under
    ``torch.autocast`` in bfloat16 (weights, gradients and the loss stay float32; the
    log-probabilities are cast back to float32 before the ratio).

    The loss of each micro-batch is divided by the number of pairs of the whole update
    (``normalizer``; default this batch's), so the accumulated gradient is that of the mean.
    ``backward`` defaults to ``loss.backward()`` (a DeepSpeed engine passes its own).
    ``anchor``: units trained towards the reference only (:class:`Anchor`), after the trained
    pairs. Besides the loss terms' shares, the metrics hold ``forward_passes_per_sample`` (model
    input rows per sample: the trained units, fewer under ``shrinkage``) and the on-policy
    figures of this call's pairs against the rollout's cached log-probs (``rollout_logp``
    ``[N, U]``, default the batch's; :func:`onpolicy_figures`): the spread of ``|log-ratio|``
    and ``first_ratio_abs_dev_max`` (``max |ratio - 1|`` over every micro-batch: 0 up to
    round-off when the learner holds the rollout's weights). Under ``shrinkage`` s > 1 only the
    block-start pairs (``t % s == 0``, scored from their own state: exact at any ``s``) are
    measured; none measured: the figures are absent (never 0).
    """
    guards = guards or LossGuards()
    samples, steps = train_pairs(batch, train_steps)
    total = float(normalizer if normalizer is not None else max(len(samples), 1))
    sums = dict.fromkeys(
        ("loss", "ratio_mean", "clip_frac", "dual_clip_frac", "kl", "forward_passes_per_sample"),
        0.0,
    )
    logps: list[torch.Tensor] = []
    with_ref = ref_policy if kl_coef > 0 else None
    step = backward or (lambda x: x.backward())
    for chunk in micro_batches(samples, steps, micro_batch, shrinkage):
        s, t = samples[chunk], steps[chunk]
        loss, m, logp = _micro_batch_loss(
            policy, with_ref, batch, s, t, guards, bf16=autocast == "bf16",
            clip=(clip_low, clip_high), kl_coef=kl_coef, normalizer=total, shrinkage=shrinkage,
        )  # fmt: skip
        step(loss)
        logps.append(logp)
        sums["loss"] += float(loss.detach())
        for k in ("ratio_mean", "clip_frac", "dual_clip_frac", "kl"):
            sums[k] += m[k] * len(s) / total
        sums["forward_passes_per_sample"] += m["forward_rows"] / max(batch.num_samples, 1)
    if logps:
        cached = batch.old_logp if rollout_logp is None else rollout_logp
        check = steps % shrinkage == 0 if batch.estimator == "trajectory" else steps >= 0
        sums.update(onpolicy_figures(torch.cat(logps), cached[samples, steps], steps, check))
    if anchor is not None and ref_policy is not None and len(anchor.units):
        per_sample = train_steps.shape[-1]  # units per sample: [K] or [N, K]
        sums["anchor_kl"] = _anchor_gradients(
            policy, ref_policy, batch, anchor, micro_batch, total / max(per_sample, 1),
            step, autocast,
        )  # fmt: skip
    return sums


def shrunk_old_log_probs(
    policy: MaskedImagePolicy,
    batch: TrainBatch,
    unit_sets: list[torch.Tensor],
    *,
    micro_batch: int,
    shrinkage: int,
    autocast: str = "off",
    num_forward: int = 0,
) -> TrainBatch:
    """The batch with the old log-probs of its trained pairs recomputed under trajectory
    shrinkage (TraceRL's way): each set of ``unit_sets`` (an update pass's units, ``[K]`` or
    ``[N, K]``) is scored without gradient in the micro-batches its pass will use, so the first
    pass's ratio is exactly 1 (the same computation on the same inputs). ``num_forward``: the
    forwards each set takes on every rank; this process pads with no-grad forwards up to it
    (ZeRO-3 gathers the parameters inside every forward, a collective: a rank that ran fewer
    would leave the others waiting; 0: no padding). The rollout's
    log-probs are of the exact states ``Y_t``; a shrunk pair is scored from its block's first
    state, so keeping them would make the first ratio ``p(.|Y_t0) / p(.|Y_t)``, a bias, not a
    policy change, that the clip would cut off."""
    old = batch.old_logp.clone()
    device = next(policy.parameters()).device
    with torch.no_grad():
        for units in unit_sets:
            samples, steps = train_pairs(batch, units)
            chunks = micro_batches(samples, steps, micro_batch, shrinkage)
            for chunk in chunks:
                s, t = samples[chunk], steps[chunk]
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast == "bf16"):
                    logp = pair_log_probs(policy, batch, s, t, shrinkage)
                old[s, t] = logp.float().cpu()
            for _ in range(num_forward - len(chunks)):  # keep collective forwards in step
                pad_forward(policy, batch, units, micro_batch, autocast, shrinkage)
    return replace(batch, old_logp=old)


@dataclass(frozen=True)
class Anchor:
    """Units trained towards the reference policy only: each (sample, unit) pair contributes
    ``coef * k3(log pi_ref - log pi)`` of its transition (no reward advantage), averaged over
    the anchor pairs. ``train.anchor_unmasking_steps``: the first unmasking steps, where a masked
    model decides what goes where, held to the base model while the reward trains the late
    ones."""

    units: torch.Tensor  # [A] long
    coef: float
    clamp: float | None = None


def _anchor_gradients(
    policy: MaskedImagePolicy,
    ref_policy: MaskedImagePolicy,
    batch: TrainBatch,
    anchor: Anchor,
    micro_batch: int,
    per_unit: float,
    step: Any,
    autocast: str,
) -> float:
    """Backpropagate the anchor's KL over its pairs, normalised by the update's anchor pairs
    per rank (``per_unit``, the update's samples per rank, times the anchored units); returns
    the mean k3 over this call's anchor pairs."""
    samples, units = train_pairs(batch, anchor.units)
    normalizer = per_unit * len(anchor.units)
    guards = LossGuards(kl_clamp=anchor.clamp, kl_normalization="per_transition")
    zero = torch.zeros(batch.num_samples)
    total_kl = 0.0
    for start in range(0, len(samples), micro_batch):
        s, t = samples[start : start + micro_batch], units[start : start + micro_batch]
        loss, m, _ = _micro_batch_loss(
            policy,
            ref_policy,
            batch,
            s,
            t,
            guards,
            bf16=autocast == "bf16",
            clip=(0.0, 0.0),
            kl_coef=anchor.coef,
            normalizer=normalizer,
            advantages=zero,
        )
        step(loss)
        total_kl += m["kl"] * len(s)
    return total_kl / max(len(samples), 1)


def pad_loss(
    policy: MaskedImagePolicy,
    batch: TrainBatch,
    *,
    train_steps: torch.Tensor,
    micro_batch: int,
    autocast: str = "off",
    shrinkage: int = 1,
) -> torch.Tensor | None:
    """A zero-valued loss with a real backward graph: the policy's log-probs of the batch's
    first micro-batch (as :func:`accumulate_gradients` forms it), summed, times zero; None for
    an empty batch. Its backward gives every parameter an exactly-zero gradient, produced by the
    same autograd graph, so in the same order, as a real micro-batch's (the order in which
    DeepSpeed ZeRO-2/3 fill their gradient-reduction buckets)."""
    logp = _first_micro_batch(policy, batch, train_steps, micro_batch, autocast, shrinkage)
    return None if logp is None else logp.float().sum() * 0.0


def pad_forward(
    policy: MaskedImagePolicy,
    batch: TrainBatch,
    train_steps: torch.Tensor,
    micro_batch: int,
    autocast: str = "off",
    shrinkage: int = 1,
) -> None:
    """A no-grad forward of the batch's first micro-batch, its result dropped: what a rank
    with fewer recompute micro-batches runs so that every rank calls the model as often (an
    empty batch: nothing, with a WARNING, since nothing can be replayed)."""
    with torch.no_grad():
        if _first_micro_batch(policy, batch, train_steps, micro_batch, autocast, shrinkage) is None:
            log.warning("an empty shard cannot pad a collective forward: the ranks may hang")


def _first_micro_batch(
    policy: MaskedImagePolicy,
    batch: TrainBatch,
    train_steps: torch.Tensor,
    micro_batch: int,
    autocast: str,
    shrinkage: int,
) -> torch.Tensor | None:
    """The policy's log-probs of the batch's first micro-batch (as :func:`micro_batches` forms
    it); None for an empty batch."""
    samples, steps = train_pairs(batch, train_steps)
    if len(samples) == 0:
        return None
    first = micro_batches(samples, steps, micro_batch, shrinkage)[0]
    device = next(policy.parameters()).device
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast == "bf16"):
        return pair_log_probs(policy, batch, samples[first], steps[first], shrinkage)


def _micro_batch_loss(
    policy: MaskedImagePolicy,
    ref_policy: MaskedImagePolicy | None,
    batch: TrainBatch,
    samples: torch.Tensor,
    units: torch.Tensor,
    guards: LossGuards,
    *,
    bf16: bool,
    clip: tuple[float, float],
    kl_coef: float,
    normalizer: float,
    advantages: torch.Tensor | None = None,
    shrinkage: int = 1,
) -> tuple[torch.Tensor, dict[str, float], torch.Tensor]:
    """The clipped loss of the (sample, unit) pairs ``samples``, ``units`` (long ``[M]``), its
    metrics (with ``forward_rows``, the model's input rows) and ``log pi`` float ``[M]`` on the
    CPU (detached). The policy (with grad) and the reference (without; None: no KL term)
    score the same states (and masks), under bf16 autocast when ``bf16``; their log-probs are
    float32 before the ratio."""
    device = next(policy.parameters()).device
    query = pair_query(batch, samples, units, policy.codebook_size, device, shrinkage)
    cond = batch.cond_ids[samples]
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
        logp = unit_log_probs(policy, cond, batch.guidance_scale, batch.temperature, query)
        ref = None
        if ref_policy is not None:
            with torch.no_grad():  # the same states (and masks) as the policy's
                ref = unit_log_probs(
                    ref_policy, cond, batch.guidance_scale, batch.temperature, query
                ).float()
    logp = logp.float()
    dev = logp.device
    old = batch.old_logp[samples, units].to(dev)
    per_token = guards.kl_normalization == "per_token"
    loss, metrics = grpo_loss(
        logp,
        old,
        (batch.advantages if advantages is None else advantages)[samples].to(dev),
        clip_low=clip[0],
        clip_high=clip[1],
        ref_logp=ref,
        kl_coef=kl_coef,
        normalizer=normalizer,
        log_ratio_clamp=guards.log_ratio_clamp,
        dual_clip=guards.dual_clip,
        kl_clamp=guards.kl_clamp,
        kl_num_tokens=query.num_tokens.to(dev) if per_token else None,
    )
    metrics["forward_rows"] = float(query.state.shape[0])
    return loss, metrics, logp.detach().float().cpu()
