"""The phases of one Mask-GRPO step before the update, as library functions (generate, score,
filter, advantages). The single-process trainer calls them in a loop; the Ray actors wrap them
one per actor method. The update is ``learner_core``'s. Nothing here imports ray.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch

from maskgrpo_ray.algo.advantages import clip_advantages, diversity_advantages
from maskgrpo_ray.algo.diversity import reward_diversity
from maskgrpo_ray.algo.estimators import (
    ForwardSettings,
    focus_step_counts,
    forward_query,
    mask_counts,
)
from maskgrpo_ray.algo.filtering import StdHistoryFilter
from maskgrpo_ray.algo.grpo import (
    group_advantages,
    group_agreement,
    group_std,
    prediction_agreement,
)
from maskgrpo_ray.algo.sampling import Trajectory, rollout
from maskgrpo_ray.errors import UserError
from maskgrpo_ray.models.base import MaskedImagePolicy
from maskgrpo_ray.pipeline.data_plane import RolloutRefs, TrainRefs
from maskgrpo_ray.pipeline.learner_loss import unit_log_probs
from maskgrpo_ray.pipeline.messages import (  # FilterResult: the message, importable from here too
    FilterResult,
    RewardResult,
    RolloutBatch,
    ScoredBatch,
    TrainBatch,
)
from maskgrpo_ray.pipeline.settings import AdvantageSettings
from maskgrpo_ray.rewards.base import check_reward_inputs
from maskgrpo_ray.runlog.monitors import MALFORMED, image_statistics

log = logging.getLogger(__name__)


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
    remask_likelihood: str = "marginal",
    sampler: str = "showo",
    forward: ForwardSettings | None = None,
    step_agreement: bool = False,
) -> RolloutBatch:
    """Roll out ``G`` samples for each of ``B`` prompts and cache the behaviour log-probs.

    ``forward`` None: the trajectory estimator (record the unmasking steps, ``old_logp [N, S]``
    of the ``transition``). Otherwise the forward estimator (:func:`_forward_units`).
    ``step_agreement``: also record each step's prediction's agreement with the final sample,
    averaged over the sample's group (``algo.grpo.group_agreement``; the ``critical`` step
    selection reads it).
    """
    cond = policy.tokenize(prompts).repeat_interleave(group_size, dim=0)  # [N, P]
    traj = rollout(
        policy.conditioned(cond, guidance_scale),
        _fully_masked(policy, cond.shape[0]),
        policy.codebook_size,
        num_steps=num_steps,
        temperature=temperature,
        gumbel_temperature=gumbel_temperature,
        kind=transition,
        remask_likelihood=remask_likelihood,
        generator=generator,
        mask_schedule=policy.mask_schedule,  # the model's own schedules (Show-o's by default)
        gumbel_anneal=policy.gumbel_anneal,
        sampler=sampler,
        record_likelihood=forward is None,
        keep_predictions=step_agreement
        or (forward is not None and forward.ratio_rule == "step_focus"),
    )
    batch = RolloutBatch(
        prompts=list(prompts),
        prompt_indices=list(prompt_indices),
        group_size=group_size,
        cond_ids=cond.cpu(),
        final_tokens=traj.final_tokens.cpu(),
        unmask_step=traj.unmask_step.cpu(),
        old_logp=traj.old_logp.cpu(),
        sampled=None if traj.sampled is None else traj.sampled.cpu(),
        images=policy.decode_images(traj.final_tokens).cpu(),
        policy_version=policy_version,
        transition=transition,
        guidance_scale=guidance_scale,
        temperature=temperature,
        likelihood_tau=traj.likelihood_tau,
    )
    if step_agreement and forward is None:
        assert traj.predictions is not None
        agree = prediction_agreement(traj.predictions, traj.final_tokens, traj.unmask_step)
        batch = replace(batch, step_agreement=group_agreement(agree, group_size).cpu())
    if forward is not None:
        batch = _forward_units(policy, batch, cond, traj, forward, generator)
    return batch.validate()


def _fully_masked(policy: MaskedImagePolicy, n: int) -> torch.Tensor:
    """The initial state: ``n`` images of mask tokens, long ``[N, L]`` on the policy's device.

    The rollout state lives with the weights: a policy may tokenize on the CPU (Show-o does;
    ``conditioned`` moves the prefix), so the condition's device says nothing about it.
    """
    device = next(policy.parameters()).device
    return torch.full(
        (n, policy.num_image_tokens), policy.mask_index, dtype=torch.long, device=device
    )


def _forward_units(
    policy: MaskedImagePolicy,
    batch: RolloutBatch,
    cond: torch.Tensor,
    traj: Trajectory,
    forward: ForwardSettings,
    generator: torch.Generator | None,
) -> RolloutBatch:
    """``batch`` under the forward estimator: nothing per step is kept; each sample gets a mask
    seed (drawn from ``generator``) and ``K`` mask sizes, and ``old_logp [N, K]`` scores the
    re-masked final tokens under the same weights, through the same :func:`unit_log_probs` the
    learner and the reference use. ``cond``: the condition ids ``[N, P]``."""
    n = cond.shape[0]
    device = next(policy.parameters()).device
    seeds = torch.randint(0, 2**62, (n,), generator=generator, device=device).cpu()
    focus_counts = None
    if forward.ratio_rule == "step_focus":
        assert traj.predictions is not None and traj.masked_before is not None
        focus_counts = focus_step_counts(
            traj.predictions,
            traj.final_tokens,
            traj.unmask_step,
            forward.num_draws,
            batch.group_size,
        ).cpu()
    counts = mask_counts(seeds, forward, policy.num_image_tokens, focus_counts)  # [N, K]
    old = []
    for k in range(forward.num_draws):  # one forward pass per draw, all samples
        query = forward_query(
            traj.final_tokens,
            seeds,
            counts[:, k],
            torch.full((n,), k),
            policy.codebook_size,
            forward.reduction,
            forward.coupling,
        )
        old.append(unit_log_probs(policy, cond, batch.guidance_scale, batch.temperature, query))
    return replace(
        batch,
        unmask_step=None,
        old_logp=torch.stack(old, dim=1).float().cpu(),
        sampled=None,
        likelihood_tau=torch.zeros(forward.num_draws),
        estimator="forward",
        mask_seed=seeds,
        mask_counts=counts,
        forward_reduction=forward.reduction,
        forward_coupling=forward.coupling,
    )


REWARD_FAILURE_KINDS = ("raised", "nonfinite", "bad_shape")


def score(
    reward: Any, batch: RolloutBatch, prompt_meta: Mapping[str, Any] | None = None
) -> ScoredBatch:
    """:func:`score_rewards` joined with the rollout (the single-process path)."""
    return ScoredBatch.join(batch, score_rewards(reward, batch, prompt_meta))


def score_rewards(
    reward: Any, batch: RolloutBatch, prompt_meta: Mapping[str, Any] | None = None
) -> RewardResult:
    """Score a rollout's images, each reward component on its own; a failure never stops the run.

    The total is the composite's ``r = sum_k w_k r_k`` plus its ensemble term, if any
    (``CompositeReward.total``; a plain reward is one component, named by its ``name``). A component that raises, or returns anything but ``N`` values, loses the
    batch; a NaN/inf value loses that sample. Lost values are NaN in ``r_k`` and so in ``r``:
    their groups are invalid for :func:`filter_rewards` and never trained on. Every loss is
    logged (component, prompt indices, error) and counted, in samples, in
    ``reward_failures[k][kind]`` with ``kind`` one of :data:`REWARD_FAILURE_KINDS` (zeros
    included, so every component is always reported). A failing ``accuracy`` (logging only,
    never trained on) is NaN and counted under ``"accuracy"``.

    A component with ``uses_prompt_metadata = True`` is called ``fn(images, prompts, metas)``
    with each image's prompt metadata from ``prompt_meta`` (prompt text -> its metadata, e.g.
    GenEval's ``tag``/``include``; None where a prompt has none).

    The per-sample diversity figures come along (:func:`maskgrpo_ray.algo.diversity.reward_diversity`:
    in the embedding the composite names, with its layouts, and ``train.diversity``'s own), and
    so do the images' statistics (:func:`maskgrpo_ray.runlog.monitors.image_statistics`, ``image/*``),
    computed here because the images are here (on Ray: the reward actor), and where a component
    detects objects (``malformed_share``: the shapes judge) its share of malformed objects per
    image (``image/malformed``, NaN where it finds none).
    """
    prompts = [p for p in batch.prompts for _ in range(batch.group_size)]
    metas = [(prompt_meta or {}).get(p) for p in prompts]
    check_reward_inputs(batch.images, prompts)
    composite = hasattr(reward, "rewards") and hasattr(reward, "weights")  # CompositeReward
    if composite:
        components = dict(reward.rewards)
    else:
        components = {str(getattr(reward, "name", "reward")): reward}
    parts: dict[str, torch.Tensor] = {}
    failures: dict[str, dict[str, int]] = {}
    for name, fn in components.items():
        parts[name], failures[name] = _score_component(name, fn, batch, prompts, metas)
    # the composite's sum (and ensemble term); NaN stays NaN whatever the weight
    total = reward.total(parts) if composite else next(iter(parts.values())).clone()
    acc = None
    acc_fn = accuracy_fn(reward)
    if acc_fn is not None:
        acc, failures["accuracy"] = _score_component("accuracy", acc_fn, batch, prompts, metas)
    if not hasattr(reward, "rewards"):
        parts = {}  # a plain reward has no parts besides its total
    diversity = reward_diversity(reward, batch.images, batch.group_size)
    diversity.update(image_statistics(batch.images))
    detector = next((f for f in components.values() if hasattr(f, "malformed_share")), None)
    if detector is not None:  # a detector's share of malformed objects (the shapes judge)
        diversity[MALFORMED] = detector.malformed_share(batch.images).float().cpu()
    return RewardResult(total, parts, acc, failures, diversity)


def _score_component(
    name: str,
    fn: Any,
    batch: RolloutBatch,
    prompts: list[str],
    metas: list[Any],
) -> tuple[torch.Tensor, dict[str, int]]:
    """One component's float32 ``[N]`` values (NaN where lost) and its failure counts. A
    component (or the reward a bound ``accuracy`` belongs to) with ``uses_prompt_metadata``
    gets the metadata as a third argument."""
    n = len(prompts)
    counts = dict.fromkeys(REWARD_FAILURE_KINDS, 0)
    lost = torch.full((n,), float("nan"))
    owner = getattr(fn, "__self__", None)
    with_meta = bool(
        getattr(fn, "uses_prompt_metadata", getattr(owner, "uses_prompt_metadata", False))
    )
    try:
        out = fn(batch.images, prompts, metas) if with_meta else fn(batch.images, prompts)
    except Exception as err:  # noqa: BLE001 - a reward failure is counted, never fatal
        counts["raised"] = n
        _warn_lost(name, "raised", batch, torch.ones(n, dtype=torch.bool), repr(err))
        return lost, counts
    values = out.detach().float().cpu() if isinstance(out, torch.Tensor) else None
    if values is None or values.shape != (n,):
        counts["bad_shape"] = n
        got = tuple(values.shape) if values is not None else type(out).__name__
        why = f"returned {got}, expected a float tensor [N={n}]"
        _warn_lost(name, "bad_shape", batch, torch.ones(n, dtype=torch.bool), why)
        return lost, counts
    bad = ~torch.isfinite(values)  # [N]
    if bad.any():
        counts["nonfinite"] = int(bad.sum())
        why = f"non-finite values {sorted({str(float(v)) for v in values[bad]})}"
        _warn_lost(name, "nonfinite", batch, bad, why)
        values = torch.where(bad, lost, values)
    return values, counts


def _warn_lost(name: str, kind: str, batch: RolloutBatch, lost: torch.Tensor, why: str) -> None:
    """Log which prompts (stream positions) lost samples to a failing component, and why."""
    groups = sorted({int(i) // batch.group_size for i in lost.nonzero().flatten()})
    log.warning(
        "reward component %r: %s on %d of %d samples, prompts %s: %s; these samples get NaN "
        "and their groups are skipped as invalid",
        name,
        kind,
        int(lost.sum()),
        lost.numel(),
        [batch.prompt_indices[g] for g in groups],
        why,
    )


def reward_failure_metrics(failures: dict[str, dict[str, int]]) -> dict[str, float]:
    """Flat metric names ``reward_failures/<component>/<kind>`` of failure counts."""
    return {
        f"reward_failures/{name}/{kind}": float(n)
        for name, kinds in failures.items()
        for kind, n in kinds.items()
    }


def accuracy_fn(reward: Any) -> Any:
    """The 0/1 correctness function of a reward: its judge's (``CompositeReward.judge``, the
    evaluation's GenEval scorer), its own, or a composite part's, if it has one."""
    judge = getattr(reward, "judge", None)
    if judge is not None:
        return judge.accuracy
    if hasattr(reward, "accuracy"):
        return reward.accuracy
    for part in getattr(reward, "rewards", {}).values():
        if hasattr(part, "accuracy"):
            return part.accuracy
    return None


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


def make_train_batch(
    scored: ScoredBatch, keep: torch.Tensor, advantage: AdvantageSettings | float
) -> TrainBatch | TrainRefs:
    """Advantages per group for the kept groups (:func:`batch_advantages`): a ``TrainBatch``,
    or on Ray (the rollout left in the object store) a ``data_plane.TrainRefs`` that the learner
    ranks turn into their shards themselves. ``advantage``: the rule, or a float ``eps`` for
    plain GRPO (Eq. 12)."""
    kept = scored.groups(keep)
    rb = kept.rollout
    if isinstance(advantage, float):
        adv = group_advantages(kept.rewards, rb.group_size, advantage)
    else:
        adv = clip_advantages(batch_advantages(kept, advantage), advantage.clip)
    if isinstance(rb, RolloutRefs):
        return TrainRefs(rb, adv)
    assert isinstance(rb, RolloutBatch)  # in-process: the rollout itself
    return TrainBatch.from_rollout(rb, adv)


def batch_advantages(scored: ScoredBatch, s: AdvantageSettings) -> torch.Tensor:
    """The advantages ``[N]`` of ``scored``'s groups under ``s`` (``train.advantage``,
    ``train.diversity``; :func:`maskgrpo_ray.algo.advantages.diversity_advantages`). The
    diversity figure and the reward parts are the reward actors' (``ScoredBatch.diversity``,
    ``reward_parts``): no extra pass over the images."""
    g = scored.rollout.group_size
    distance = None
    if s.diversity != "none":
        if s.measure not in scored.diversity:
            raise UserError(
                f"train.diversity.kind={s.diversity!r} needs the per-sample {s.measure!r}, "
                "which only a reward component with an image embedding gives (clip, toy_rules, "
                "toy_geneval, shapes_clip, shapes_judge); add one (weight 0 is enough) or set "
                "train.diversity.kind none"
            )
        distance = scored.diversity[s.measure]
    parts = weights = None
    if s.kind == "gdpo":
        names = list(s.component_weights)
        parts = torch.stack([scored.reward_parts[n].float() for n in names])  # [C, N]
        weights = torch.tensor([s.component_weights[n] for n in names])
    return diversity_advantages(
        scored.rewards,
        g,
        kind=s.kind,
        diversity=s.diversity,
        distance=distance,
        bonus_weight=s.bonus_weight,
        gardo_over=s.gardo_over,
        recentre=s.recentre,
        parts=parts,
        weights=weights,
        eps=s.eps,
    )
