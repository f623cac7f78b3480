"""Evaluation generation with fixed seeds: the one home for it.

The prompts are cut into units of ``prompts_per_unit`` in prompt order; unit ``u`` samples
with a generator seeded from ``(seed, u)`` only. Whatever runs a unit (the single process, any
rollout actor, after any number of actor deaths) makes the same images for the same weights,
so the images do not depend on the number of rollout actors. The evaluation inside training
(:func:`evaluate_rewards`) and ``maskgrpo eval`` (:func:`generate_unit`) both go through
:func:`generate_unit`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from maskgrpo_ray.algo.diversity import CEILING, FIGURES, expected_distinct_fraction
from maskgrpo_ray.models.base import MaskedImagePolicy
from maskgrpo_ray.models.registry import entry_for
from maskgrpo_ray.pipeline.learner_loss import pair_log_probs, train_pairs
from maskgrpo_ray.pipeline.messages import RolloutBatch, TrainBatch
from maskgrpo_ray.pipeline.phases import generate, score_rewards
from maskgrpo_ray.pipeline.settings import EvalSettings

if TYPE_CHECKING:
    from maskgrpo_ray.config import ModelConfig


@dataclass(frozen=True)
class EvalUnit:
    """``prompts[k]`` is prompt number ``prompt_indices[k]`` of the evaluation set."""

    index: int
    prompt_indices: list[int]
    prompts: list[str]
    seed: int


def unit_seed(seed: int, index: int) -> int:
    """The sampling seed of unit ``index``: a function of the evaluation seed and the index."""
    return (seed * 1_000_003 + 7_919 * (index + 1)) % (2**63 - 1)


def make_units(prompts: Sequence[str], settings: EvalSettings) -> list[EvalUnit]:
    """Cut the evaluation prompts into units of ``settings.prompts_per_unit`` (prompt order)."""
    size = settings.prompts_per_unit
    return [
        EvalUnit(
            u,
            list(range(s, min(s + size, len(prompts)))),
            list(prompts[s : s + size]),
            unit_seed(settings.seed, u),
        )
        for u, s in enumerate(range(0, len(prompts), size))
    ]


@torch.no_grad()
def generate_unit(
    policy: MaskedImagePolicy, unit: EvalUnit, settings: EvalSettings
) -> RolloutBatch:
    """``samples_per_prompt`` images per prompt of ``unit`` (prompt-major: sample ``j`` of
    the unit's prompt ``k`` is row ``k * S + j``), sampled with the unit's own generator."""
    device = next(policy.parameters()).device
    g = torch.Generator(device=device).manual_seed(unit.seed)
    return generate(
        policy,
        unit.prompts,
        unit.prompt_indices,
        group_size=settings.samples_per_prompt,
        num_steps=settings.num_steps,
        temperature=settings.temperature,
        gumbel_temperature=settings.gumbel_temperature,
        guidance_scale=settings.guidance_scale,
        transition="p2",
        policy_version=-1,
        generator=g,
        sampler=settings.sampler,
    )


GRID_SAMPLES = 6  # images per prompt in a run's per-tag evaluation grid


def grid_unit(prompts: Sequence[str], settings: EvalSettings) -> tuple[EvalUnit, EvalSettings]:
    """One fixed-seed unit of ``prompts`` (a prompt per GenEval tag) with at most
    :data:`GRID_SAMPLES` images each: the same seed and noise for every checkpoint of a run, so
    the base model's grid and the tuned model's show the same draws."""
    unit = EvalUnit(-1, list(range(len(prompts))), list(prompts), unit_seed(settings.seed, 10**6))
    return unit, replace(
        settings, samples_per_prompt=min(GRID_SAMPLES, settings.samples_per_prompt)
    )


# what a monitor probe summarises besides the evaluation's figures (docs/monitors.md): the KL to
# the base and the policy's entropy (``probe_divergence``) and the image statistics
# (``runlog.monitors.image_statistics``)
PROBE_FIGURES = (
    "kl",
    "entropy",
    "image/colour_entropy",
    "image/dark",
    "image/saturated",
    "image/edges",
    "image/malformed",
)
KL_PAIRS_PER_PASS = 256  # (sample, step) pairs per forward pass of probe_divergence


@torch.no_grad()
def probe_divergence(
    policy: MaskedImagePolicy, base: MaskedImagePolicy, batch: RolloutBatch
) -> dict[str, torch.Tensor]:
    """Per sample of ``batch`` (drawn from ``policy``), float ``[N]`` each: ``kl``, the
    log-ratio of its whole trajectory under ``policy`` and under ``base`` per token,
    ``sum_t (log pi(Y_t | Y_t-1) - log base(Y_t | Y_t-1)) / L``, and ``entropy``, its negative
    log-likelihood under ``policy`` per token, ``-sum_t log pi(Y_t | Y_t-1) / L``, both scored
    with the learner's likelihood (``learner_loss.pair_log_probs``, the rollout's guidance and
    temperature). Their means over samples are the k1 estimate of KL(policy || base) per token
    and the Monte-Carlo estimate of the policy's trajectory entropy per token (in nats; at the
    base, the unit its KL is measured against: ``runlog.probe_alarms``)."""
    tb = TrainBatch.from_rollout(batch, torch.zeros(batch.num_samples))
    n, units = batch.old_logp.shape
    samples, steps = train_pairs(tb, torch.arange(units))
    own, diff = [], []
    with torch.random.fork_rng(devices=[]):  # a forward that draws (dropout) leaves no trace
        for s in range(0, samples.numel(), KL_PAIRS_PER_PASS):
            i, t = samples[s : s + KL_PAIRS_PER_PASS], steps[s : s + KL_PAIRS_PER_PASS]
            lp, lb = pair_log_probs(policy, tb, i, t), pair_log_probs(base, tb, i, t)
            own.append(lp.cpu())
            diff.append((lp - lb).cpu())
    tokens = batch.final_tokens.shape[1]

    def per_token(parts: list[torch.Tensor]) -> torch.Tensor:
        return (torch.cat(parts).double().view(n, units).sum(-1) / tokens).float()

    return {"kl": per_token(diff), "entropy": -per_token(own)}


def unit_rewards(
    reward: Any, batch: RolloutBatch, prompt_meta: Mapping[str, Any] | None = None
) -> dict[str, torch.Tensor]:
    """The training reward on an evaluation unit: ``reward`` ``[N]`` and, where the reward
    defines one, ``accuracy`` ``[N]`` (NaN where scoring failed), and the diversity of each
    prompt's samples (``maskgrpo_ray.algo.diversity``: a unit's group is one prompt's samples)."""
    result = score_rewards(reward, batch, prompt_meta)
    out = {"reward": result.rewards}
    if result.accuracy is not None:
        out["accuracy"] = result.accuracy
    out.update(result.diversity)
    return out


def distinct_ceiling(
    count: Callable[[str], int | None], prompts: Sequence[str], samples_per_prompt: int
) -> torch.Tensor:
    """float ``[P * S]``, prompt-major: each prompt's ceiling of ``diversity/distinct``, the
    expected fraction of distinct images among its ``S`` samples when drawn uniformly from its
    ``count(prompt)`` correct images (:func:`~maskgrpo_ray.algo.diversity.expected_distinct_fraction`),
    repeated over its samples (NaN where ``count`` is None or 0: no correct image, no
    ceiling)."""
    per_prompt = []
    for p in prompts:
        m = count(p)
        per_prompt.append(math.nan if not m else expected_distinct_fraction(m, samples_per_prompt))
    return torch.tensor(per_prompt, dtype=torch.float64).repeat_interleave(samples_per_prompt)


def ceiling_counter(model: ModelConfig) -> Callable[[str], int | None] | None:
    """The model kind's count of a prompt's correct images (``ModelEntry.correct_images``), or
    None when its world does not know it."""
    entry = entry_for(model)
    return None if entry.correct_images is None else entry.correct_images(model)


def ceiling_figures(
    model: ModelConfig,
    prompts: Sequence[str],
    samples_per_prompt: int,
    tags: Sequence[str | None] | None = None,
) -> dict[str, float]:
    """``eval_diversity/distinct_ceiling`` (the mean of :func:`distinct_ceiling` over the
    prompts; per GenEval tag too, as :func:`summarize`), ``{}`` when the world has no count."""
    count = ceiling_counter(model)
    if count is None:
        return {}
    return summarize([{CEILING: distinct_ceiling(count, prompts, samples_per_prompt)}], tags)


def mean_se(x: torch.Tensor, prompts: int | None = None) -> float:
    """The standard error of the mean of ``x`` (``[P * S]``, prompt-major, NaN skipped): with
    ``prompts`` = P, the sample standard deviation of the P prompts' means over sqrt(P) (the
    prompts are the independent draws); else of the samples. NaN with fewer than two."""
    if prompts and x.numel() % prompts == 0 and x.numel() > prompts:
        x = x.view(prompts, -1).nanmean(dim=1)
    x = x[torch.isfinite(x)].double()
    return float(x.std() / x.numel() ** 0.5) if x.numel() > 1 else math.nan


def summarize(
    per_unit: Sequence[dict[str, torch.Tensor]],
    tags: Sequence[str | None] | None = None,
    extra: Sequence[str] = (),
) -> dict[str, float]:
    """``eval_reward``, ``eval_accuracy`` and ``eval_diversity/distinct`` / ``pairwise`` / ``nn``
    / ``layouts`` / ``distinct_ceiling`` (those present):
    means over the finite per-sample values of all units (NaN when none is finite). With ``tags``
    (one per prompt, in prompt order: the prompts' GenEval tags), also ``eval_<key>/<tag>`` per
    tag, and ``eval_accuracy/tag_mean``: the mean of the tags' accuracies, GenEval's "Overall"
    (``eval_accuracy`` weighs every image alike, so a tag with more prompts weighs more).
    ``eval_reward_se``: the standard error of ``eval_reward``, from the prompts' mean rewards
    when ``tags`` says how many prompts there are (a prompt's samples are correlated), else from
    the samples (:func:`mean_se`).
    ``extra``: more per-sample keys summarised alike (a monitor probe's :data:`PROBE_FIGURES`)."""
    out: dict[str, float] = {}
    for key in ("reward", "accuracy", *FIGURES, *extra):
        parts = [u[key] for u in per_unit if key in u]
        if not parts:
            continue
        x = torch.cat(parts).float()  # [P * S], prompt-major
        groups: dict[str, torch.Tensor] = {"": torch.ones_like(x, dtype=torch.bool)}
        if tags is not None and any(t is not None for t in tags):
            per_prompt = x.numel() // len(tags)
            for tag in sorted({t for t in tags if t is not None}):
                hit = torch.tensor([t == tag for t in tags]).repeat_interleave(per_prompt)
                groups[f"/{tag}"] = hit
        for suffix, hit in groups.items():
            v = x[hit & torch.isfinite(x)]
            out[f"eval_{key}{suffix}"] = float(v.mean()) if v.numel() else math.nan
        if key == "reward":
            out["eval_reward_se"] = mean_se(x, len(tags) if tags is not None else None)
        if key == "accuracy" and len(groups) > 1:
            per_tag = [out[f"eval_accuracy{s}"] for s in groups if s]
            out["eval_accuracy/tag_mean"] = sum(per_tag) / len(per_tag)
    return out


def evaluate_rewards(
    policy: MaskedImagePolicy,
    reward: Any,
    prompts: Sequence[str],
    settings: EvalSettings,
    tags: Sequence[str | None] | None = None,
    prompt_meta: Mapping[str, Any] | None = None,
    *,
    probe: bool = False,
    base: MaskedImagePolicy | None = None,
) -> dict[str, float]:
    """Held-out evaluation in one process: every unit generated and scored with the training
    reward (given ``prompt_meta``: prompt text -> metadata), summarised (:func:`summarize`).
    ``probe``: the monitor probe's :data:`PROBE_FIGURES` too (the KL to ``base`` where one is
    given)."""
    per_unit = []
    for u in make_units(prompts, settings):
        rb = generate_unit(policy, u, settings)
        figures = unit_rewards(reward, rb, prompt_meta)
        if probe and base is not None:
            figures.update(probe_divergence(policy, base, rb))
        per_unit.append(figures)
    return summarize(per_unit, tags, PROBE_FIGURES if probe else ())
