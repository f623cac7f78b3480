"""Typed, frozen settings per role, built once from the config.

An actor receives the settings of its role only (never the whole :class:`Config`), so what it
depends on is visible in its constructor and travels as a small frozen value. Every executor
builds them with :func:`settings_from_config`, so the single-process baseline and the Ray actors
run with the same values by construction.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from maskgrpo_ray.algo.estimators import ForwardSettings
from maskgrpo_ray.config import Config, ModelConfig
from maskgrpo_ray.models.registry import reward_defaults
from maskgrpo_ray.phases import LossGuards
from maskgrpo_ray.rewards.base import RewardSpec


@dataclass(frozen=True)
class RolloutSettings:
    """Keyword arguments of ``phases.generate`` besides prompts, version and generator."""

    group_size: int  # G
    num_steps: int  # S, unmasking steps of a training rollout
    temperature: float
    gumbel_temperature: float  # tau_0 of Show-o's remasking noise
    guidance_scale: float
    transition: str  # "p1" | "p2" | "ar"
    remask_likelihood: str  # "marginal" | "eq14"
    sampler: str  # "showo" | "ancestral"
    forward: ForwardSettings | None  # None: the trajectory estimator

    def kwargs(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}  # shallow: keeps forward


@dataclass(frozen=True)
class EvalSettings:
    """The evaluation sampler (``maskgrpo_ray.evaluation.generation``)."""

    samples_per_prompt: int
    num_steps: int  # unmasking steps of an evaluation rollout
    guidance_scale: float
    temperature: float
    gumbel_temperature: float
    seed: int  # fixed: the same images for the same weights
    sampler: str
    prompts_per_unit: int = 8  # prompts per work unit; a unit's seed is (seed, unit index)

    def kwargs(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class UpdateSettings:
    """Everything one learner update needs (``learner_core``): objective, schedule, optimizer."""

    num_steps: int  # U, likelihood units per sample: S unmasking steps, or K mask draws
    step_selection: str  # "all" | "first" | "last" | "random" (computational reduction)
    steps_trained: int  # k for first/last/random
    micro_batch_pairs: int  # (sample, unmasking step) pairs per forward
    updates_per_batch: int
    clip_low: float
    clip_high: float
    kl_coef: float
    guards: LossGuards
    grad_clip_norm: float  # 0: report the norm, do not clip
    learning_rate: float
    warmup_updates: int  # linear warm-up over this many optimizer updates
    weight_decay: float
    adam_betas: tuple[float, float]
    seed: int  # the run's seed; the step-selection stream is seeded from it
    cycle_units: bool = False  # inner update i trains unit i mod U only (forward: one draw)
    autocast: str = "off"  # "bf16": forward passes under torch.autocast (learner.autocast)


@dataclass(frozen=True)
class LearnerSettings:
    """Placement and engine of the learner ranks."""

    num_workers: int  # world size
    zero_stage: int
    bf16: bool
    num_cpus_per_worker: float
    num_gpus_per_worker: float
    torch_threads_per_worker: int  # 0: auto (see LearnerWorker), Ray's on GPU
    activation_checkpointing: bool = False
    weight_sync: str = "object_store"  # resolved: "object_store" or "collective"
    weight_sync_bucket_bytes: int = 256 << 20
    # rollout.max_policy_lag > 0: rollouts run during the update, on the same CPUs if no GPU
    overlapped: bool = False


@dataclass(frozen=True)
class RewardSettings:
    """The reward composition, built the same way by reward actors and evaluation."""

    specs: tuple[RewardSpec, ...]


@dataclass(frozen=True)
class FilterSettings:
    enabled: bool
    percentile: float
    warmup_groups: int
    max_history: int


@dataclass(frozen=True)
class ActorResources:
    num_cpus: float
    num_gpus: float


@dataclass(frozen=True)
class PoolHealing:
    """How a pool of replicas heals: replacements per run, and when a call counts as hung."""

    max_restarts: int
    call_timeout_s: float  # 0: the executor's timeout


@dataclass(frozen=True)
class RunSettings:
    """All roles' settings of one run."""

    model: ModelConfig
    rollout: RolloutSettings
    eval: EvalSettings
    update: UpdateSettings
    learner: LearnerSettings
    reward: RewardSettings
    filter: FilterSettings
    rollout_resources: ActorResources
    reward_resources: ActorResources
    rollout_healing: PoolHealing
    reward_healing: PoolHealing


def _forward_settings(cfg: Config) -> ForwardSettings | None:
    if cfg.likelihood.estimator != "forward":
        return None
    f = cfg.likelihood.forward
    return ForwardSettings(
        num_draws=f.mask_draws,
        ratio_min=f.mask_ratio_min,
        ratio_max=f.mask_ratio_max,
        ratio_rule=f.mask_ratios,
        reduction=f.reduction,
    )


def resolve_weight_sync(cfg: Config) -> str:
    """``learner.weight_sync`` with ``auto`` decided: the collective when the learner and the
    rollout actors have GPUs (NCCL) and ZeRO-3 does not partition the weights."""
    lc = cfg.learner
    if lc.weight_sync != "auto":
        return lc.weight_sync
    gpus = lc.num_gpus_per_worker > 0 and cfg.rollout.num_gpus_per_actor > 0
    return "collective" if gpus and lc.zero_stage < 3 else "object_store"


def settings_from_config(cfg: Config) -> RunSettings:
    """Build every role's settings from the validated config (the one place that reads it)."""
    r, t, e, lc = cfg.rollout, cfg.train, cfg.eval, cfg.learner
    rollout = RolloutSettings(
        group_size=r.samples_per_prompt,
        num_steps=r.unmasking_steps,
        temperature=r.temperature,
        gumbel_temperature=r.gumbel_temperature,
        guidance_scale=r.guidance_scale,
        transition=r.transition,
        remask_likelihood=r.remask_likelihood,
        sampler=r.sampler,
        forward=_forward_settings(cfg),
    )
    evaluation = EvalSettings(
        samples_per_prompt=e.samples_per_prompt,
        num_steps=e.unmasking_steps or r.unmasking_steps,
        guidance_scale=e.guidance_scale if e.guidance_scale is not None else r.guidance_scale,
        temperature=r.temperature,
        gumbel_temperature=(
            e.gumbel_temperature if e.gumbel_temperature is not None else r.gumbel_temperature
        ),
        seed=cfg.run.seed + 10_007,
        sampler=e.sampler or r.sampler,
        prompts_per_unit=e.prompts_per_unit,
    )
    forward = rollout.forward
    update = UpdateSettings(
        num_steps=forward.num_draws if forward is not None else r.unmasking_steps,
        step_selection=t.unmasking_step_selection,
        steps_trained=t.unmasking_steps_trained,
        micro_batch_pairs=t.micro_batch_pairs_per_gpu,
        updates_per_batch=t.updates_per_batch,
        clip_low=t.clip_low,
        clip_high=t.clip_high,
        kl_coef=t.kl_coef,
        guards=LossGuards(
            log_ratio_clamp=t.log_ratio_clamp or None,
            dual_clip=t.dual_clip or None,
            kl_clamp=t.kl_clamp or None,
            kl_normalization=t.kl_normalization,
        ),
        grad_clip_norm=t.grad_clip_norm,
        learning_rate=t.learning_rate,
        warmup_updates=t.warmup_updates,
        weight_decay=t.weight_decay,
        adam_betas=t.adam_betas,
        seed=cfg.run.seed,
        cycle_units=forward is not None and cfg.likelihood.forward.draws_per_update == "one",
        autocast=cfg.learner.autocast,
    )
    learner = LearnerSettings(
        num_workers=lc.num_workers,
        zero_stage=lc.zero_stage,
        bf16=lc.bf16,
        num_cpus_per_worker=lc.num_cpus_per_worker,
        num_gpus_per_worker=lc.num_gpus_per_worker,
        torch_threads_per_worker=lc.torch_threads_per_worker,
        activation_checkpointing=lc.activation_checkpointing,
        weight_sync=resolve_weight_sync(cfg),
        weight_sync_bucket_bytes=int(lc.weight_sync_bucket_mb * (1 << 20)),
        overlapped=cfg.rollout.max_policy_lag > 0,
    )
    specs = []
    for c in cfg.reward.components:
        kwargs = {**reward_defaults(cfg.model, c.kind), **c.args}  # the model's, then c.args
        specs.append(RewardSpec(kind=c.kind, weight=c.weight, kwargs=kwargs))
    f = cfg.filter
    return RunSettings(
        model=cfg.model,
        rollout=rollout,
        eval=evaluation,
        update=update,
        learner=learner,
        reward=RewardSettings(tuple(specs)),
        filter=FilterSettings(f.enabled, f.percentile, f.warmup_groups, f.max_history),
        rollout_resources=ActorResources(r.num_cpus_per_actor, r.num_gpus_per_actor),
        reward_resources=ActorResources(
            cfg.reward.num_cpus_per_actor, cfg.reward.num_gpus_per_actor
        ),
        rollout_healing=PoolHealing(r.max_restarts, r.call_timeout_seconds),
        reward_healing=PoolHealing(cfg.reward.max_restarts, cfg.reward.call_timeout_seconds),
    )
