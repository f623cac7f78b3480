"""The phases of one Mask-GRPO step as library functions (generate, score, filter, advantages,
update, evaluate). The single-process trainer calls them in a loop; the Ray actors wrap them
one per actor method. Nothing here imports ray.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from maskgrpo_ray.algo.filtering import StdHistoryFilter
from maskgrpo_ray.algo.grpo import group_advantages, group_std, grpo_loss, select_train_steps
from maskgrpo_ray.algo.sampling import replay_states, rollout
from maskgrpo_ray.algo.transition import step_log_prob
from maskgrpo_ray.models.base import MaskedImagePolicy
from maskgrpo_ray.types import RolloutBatch, ScoredBatch, TrainBatch


@torch.no_grad()
def generate(
    policy: MaskedImagePolicy,
    prompts: Sequence[str],
    prompt_indices: Sequence[int],
    *,
    group_size: int,
    num_steps: int,
    temperature: float,
    gumbel_temperature: float,
    guidance_scale: float,
    transition: str,
    policy_version: int,
    generator: torch.Generator | None,
) -> RolloutBatch:
    """Roll out ``G`` samples for each of ``B`` prompts, recording the trajectory."""
    cond = policy.tokenize(prompts).repeat_interleave(group_size, dim=0)  # [N, P]
    n = cond.shape[0]
    device = cond.device
    init = torch.full(
        (n, policy.num_image_tokens), policy.mask_index, dtype=torch.long, device=device
    )
    traj = rollout(
        policy.conditioned(cond, guidance_scale),
        init,
        policy.codebook_size,
        num_steps=num_steps,
        temperature=temperature,
        gumbel_temperature=gumbel_temperature,
        kind=transition,
        generator=generator,
    )
    images = policy.decode_images(traj.final_tokens)
    return RolloutBatch(
        prompts=list(prompts),
        prompt_indices=list(prompt_indices),
        group_size=group_size,
        cond_ids=cond.cpu(),
        final_tokens=traj.final_tokens.cpu(),
        unmask_step=traj.unmask_step.cpu(),
        old_logp=traj.old_logp.cpu(),
        log_theta=traj.log_theta.cpu(),
        sampled=None if traj.sampled is None else traj.sampled.cpu(),
        images=images.cpu(),
        policy_version=policy_version,
        transition=transition,
        guidance_scale=guidance_scale,
        temperature=temperature,
    ).validate()


def score(reward: Any, batch: RolloutBatch) -> ScoredBatch:
    """Score a rollout's images; the reward may be composite (``score`` returns parts)."""
    prompts = [p for p in batch.prompts for _ in range(batch.group_size)]
    parts: dict[str, torch.Tensor] = {}
    if hasattr(reward, "score"):
        total, parts = reward.score(batch.images, prompts)
    else:
        total = reward(batch.images, prompts)
    acc_fn = accuracy_fn(reward)
    acc = acc_fn(batch.images, prompts) if acc_fn is not None else None
    return ScoredBatch(
        batch, total.float().cpu(), {k: v.float().cpu() for k, v in parts.items()}, acc
    ).validate()


def accuracy_fn(reward: Any) -> Any:
    """The 0/1 correctness function of a reward (or of a composite's part), if it has one."""
    if hasattr(reward, "accuracy"):
        return reward.accuracy
    for part in getattr(reward, "rewards", {}).values():
        if hasattr(part, "accuracy"):
            return part.accuracy
    return None


@dataclass(frozen=True)
class FilterResult:
    keep: torch.Tensor  # [B] bool, groups to train on
    invalid: torch.Tensor  # [B] bool, groups with a NaN/inf reward (skipped, not resampled)
    stds: torch.Tensor  # [B] group reward std


def filter_groups(scored: ScoredBatch, filt: StdHistoryFilter | None) -> FilterResult:
    """Decide per group: invalid (non-finite reward), dropped by the std filter, or kept."""
    return filter_rewards(scored.rewards, scored.rollout.group_size, filt)


def filter_rewards(rewards: torch.Tensor, g: int, filt: StdHistoryFilter | None) -> FilterResult:
    """:func:`filter_groups` on the rewards ``[N]`` alone (what a filter actor is sent)."""
    r = rewards.view(-1, g)
    invalid = ~torch.isfinite(r).all(dim=1)
    stds = group_std(torch.nan_to_num(rewards), g)
    keep = ~invalid
    if filt is not None:
        for i in range(len(keep)):
            if keep[i]:
                keep[i] = filt.decide(float(stds[i]))
    return FilterResult(keep, invalid, stds)


def make_train_batch(scored: ScoredBatch, keep: torch.Tensor, advantage_eps: float) -> TrainBatch:
    """Advantages per group (Eq. 12) for the kept groups."""
    rb = scored.rollout.group_slice(keep)
    rewards = scored.rewards.view(-1, rb.group_size)[keep].view(-1)
    return TrainBatch(
        group_size=rb.group_size,
        cond_ids=rb.cond_ids,
        final_tokens=rb.final_tokens,
        unmask_step=rb.unmask_step,
        old_logp=rb.old_logp,
        sampled=rb.sampled,
        advantages=group_advantages(rewards, rb.group_size, advantage_eps),
        transition=rb.transition,
        guidance_scale=rb.guidance_scale,
        temperature=rb.temperature,
        policy_version=rb.policy_version,
    ).validate()


def pair_log_probs(
    policy: MaskedImagePolicy, batch: TrainBatch, samples: torch.Tensor, steps: torch.Tensor
) -> torch.Tensor:
    """Transition log-probs of (sample, step) pairs in one forward: float ``[M]``.

    Rebuilds each pair's state ``Y_t`` from the record and evaluates the rollout's transition
    definition under the policy's current weights (same guidance and temperature).
    """
    device = next(policy.parameters()).device
    final = batch.final_tokens[samples].to(device)
    tokens, masked, unmasked = replay_states(
        final, batch.unmask_step[samples].to(device), steps.to(device), policy.codebook_size
    )
    logits = policy.conditioned(batch.cond_ids[samples].to(device), batch.guidance_scale)(tokens)
    target = batch.sampled[samples, steps].to(device) if batch.sampled is not None else final
    return step_log_prob(logits / batch.temperature, masked, unmasked, target, batch.transition)


def train_pairs(batch: TrainBatch, train_steps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """All (sample, step) pairs trained this update: long ``[M]`` each, sample-major."""
    n = batch.num_samples
    samples = torch.arange(n).repeat_interleave(len(train_steps))
    steps = train_steps.repeat(n)
    return samples, steps


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
) -> dict[str, float]:
    """Backpropagate the clipped GRPO loss over all trained pairs in micro-batches.

    The loss of each micro-batch is divided by the number of pairs of the whole update
    (``normalizer``; default this batch's), so the accumulated gradient is that of the mean.
    ``backward`` defaults to ``loss.backward()`` (a DeepSpeed engine passes its own).
    """
    samples, steps = train_pairs(batch, train_steps)
    total = float(normalizer if normalizer is not None else max(len(samples), 1))
    sums = {"loss": 0.0, "ratio_mean": 0.0, "clip_frac": 0.0, "kl": 0.0}
    for start in range(0, len(samples), micro_batch):
        s, t = samples[start : start + micro_batch], steps[start : start + micro_batch]
        logp = pair_log_probs(policy, batch, s, t)
        ref = None
        if ref_policy is not None and kl_coef > 0:
            with torch.no_grad():
                ref = pair_log_probs(ref_policy, batch, s, t)
        dev = logp.device
        loss, m = grpo_loss(
            logp,
            batch.old_logp[s, t].to(dev),
            batch.advantages[s].to(dev),
            clip_low=clip_low,
            clip_high=clip_high,
            ref_logp=ref,
            kl_coef=kl_coef,
            normalizer=total,
        )
        (backward or (lambda x: x.backward()))(loss)
        sums["loss"] += float(loss.detach())
        for k in ("ratio_mean", "clip_frac", "kl"):
            sums[k] += m[k] * len(s) / total
    return sums


def local_update(
    policy: MaskedImagePolicy,
    optimizer: torch.optim.Optimizer,
    batch: TrainBatch,
    *,
    num_steps: int,
    step_selection: str,
    steps_trained: int,
    micro_batch: int,
    clip_low: float,
    clip_high: float,
    grad_clip_norm: float,
    updates_per_batch: int,
    kl_coef: float,
    ref_policy: MaskedImagePolicy | None,
    generator: torch.Generator | None,
) -> dict[str, float]:
    """One or more optimizer passes over a train batch (single process)."""
    policy.train()
    metrics: dict[str, float] = {}
    train_steps = select_train_steps(num_steps, step_selection, steps_trained, generator)
    for _ in range(updates_per_batch):
        optimizer.zero_grad(set_to_none=True)
        metrics = accumulate_gradients(
            policy,
            batch,
            train_steps=train_steps,
            micro_batch=micro_batch,
            clip_low=clip_low,
            clip_high=clip_high,
            kl_coef=kl_coef,
            ref_policy=ref_policy,
        )
        if grad_clip_norm > 0:
            metrics["grad_norm"] = float(
                torch.nn.utils.clip_grad_norm_(policy.parameters(), grad_clip_norm)
            )
        optimizer.step()
    policy.eval()
    return metrics


@torch.no_grad()
def evaluate(
    policy: MaskedImagePolicy,
    reward: Any,
    prompts: Sequence[str],
    *,
    samples_per_prompt: int,
    num_steps: int,
    guidance_scale: float,
    temperature: float,
    gumbel_temperature: float,
    seed: int,
    batch_prompts: int = 32,
) -> dict[str, float]:
    """Held-out evaluation with fixed seeds: mean reward and accuracy (where defined)."""
    rewards, accs = [], []
    g = torch.Generator(device=next(policy.parameters()).device).manual_seed(seed)
    for i in range(0, len(prompts), batch_prompts):
        chunk = list(prompts[i : i + batch_prompts])
        rb = generate(
            policy,
            chunk,
            list(range(i, i + len(chunk))),
            group_size=samples_per_prompt,
            num_steps=num_steps,
            temperature=temperature,
            gumbel_temperature=gumbel_temperature,
            guidance_scale=guidance_scale,
            transition="p2",
            policy_version=-1,
            generator=g,
        )
        sb = score(reward, rb)
        rewards.append(sb.rewards)
        if sb.accuracy is not None:
            accs.append(sb.accuracy)
    r = torch.cat(rewards)
    out = {"eval_reward": float(r[torch.isfinite(r)].mean())}
    if accs:
        a = torch.cat(accs)
        out["eval_accuracy"] = float(a[torch.isfinite(a)].mean())
    return out


def nan_to_none(d: dict[str, float]) -> dict[str, float | None]:
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in d.items()}
