"""Typed, frozen settings per role, built once from the config.

An actor receives the settings of its role only (never the whole :class:`Config`), so what it
depends on is visible in its constructor and travels as a small frozen value. Every executor
builds them with :func:`settings_from_config`, so the single-process baseline and the Ray actors
run with the same values by construction.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import BaseModel

from maskgrpo_ray.algo.diversity import embedding_choice, train_figure
from maskgrpo_ray.algo.estimators import ForwardSettings
from maskgrpo_ray.algo.grpo import LossGuards
from maskgrpo_ray.config import Config, ModelConfig, RewardComponent, RewardConfig, RolloutConfig
from maskgrpo_ray.config.kinds import load_plugins
from maskgrpo_ray.errors import UserError
from maskgrpo_ray.models.registry import reward_defaults
from maskgrpo_ray.pipeline.geneval_judge import judge_spec
from maskgrpo_ray.rewards.base import EnsembleSpec, RewardSpec, reward_embeds

if TYPE_CHECKING:
    from _typeshed import DataclassInstance


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
    step_agreement: bool = False  # record it (train.unmasking_step_selection critical)

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
    # the monitor probe's KL to the base (logging.monitors.probe_kl with a probe): a Ray
    # rollout actor then keeps a frozen copy of the base it was built with
    probe_kl: bool = False

    def kwargs(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class UpdateSettings:
    """Everything one learner update needs (``learner_core``): objective, schedule, optimizer."""

    num_steps: int  # U, likelihood units per sample: S unmasking steps, or K mask draws
    step_selection: str  # "all" | "first" | "last" | "random" | ... | "auto" (comp. reduction)
    steps_trained: int  # k for first/last/random; auto: the cap
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
    window_shift: int = 1  # window selection: updates per one-step move of the window
    anchor_steps: int = 0  # the first m unmasking steps trained towards the reference only
    anchor_coef: float = 0.0  # beta of their k3 (per transition)
    autocast: str = "off"  # "bf16": forward passes under torch.autocast (learner.autocast)
    auto_margin: float = 2.0  # auto selection: standard errors a step must stand above its floor
    shrinkage: int = 1  # s, steps scored per forward pass (trajectory shrinkage; 1: exact)
    # the trained likelihood's guidance (train.likelihood_guidance_scale); None: the rollout's
    likelihood_guidance_scale: float | None = None
    ema_decay: float = 0.0  # d of the weights' moving average (pipeline.ema); 0: none


@dataclass(frozen=True)
class AdvantageSettings:
    """How the driver turns a step's kept groups into advantages (``phases.make_train_batch``)."""

    kind: str  # "grpo" | "centred" | "gdpo" | "batch_std"
    diversity: str  # "none" | "gardo" | "bonus"
    # the per-sample figure diversity uses: "diversity/nn" | "diversity/pairwise", or
    # "diversity_train/..." where train.diversity.embedding is not the reported figures' space
    measure: str
    bonus_weight: float
    gardo_over: str  # "group" | "positive"
    recentre: bool  # gardo: the scaled advantages centred per group again
    eps: float
    component_weights: dict[str, float]  # reward part name -> weight (GDPO)
    clip: float = 0.0  # train.advantage_clip: |A| at most this; 0: no clip


@dataclass(frozen=True)
class LearnerSettings:
    """Placement and engine of the learner ranks."""

    num_workers: int  # world size
    zero_stage: int
    bf16: bool
    num_cpus_per_worker: float
    num_gpus_per_worker: float
    torch_threads_per_worker: int  # 0: auto (see LearnerWorker), Ray's on GPU
    custom_resources: dict[str, float]  # custom Ray resources per rank
    activation_checkpointing: bool = False
    weight_sync: str = "object_store"  # resolved: "object_store" or "collective"
    weight_sync_bucket_bytes: int = 256 << 20
    # rollout.max_policy_lag > 0: rollouts run during the update, on the same CPUs if no GPU
    overlapped: bool = False


@dataclass(frozen=True)
class RewardSettings:
    """The reward composition, built the same way by reward actors and evaluation."""

    specs: tuple[RewardSpec, ...]
    # the component the diversity figures are measured in (None: the heaviest that embeds)
    diversity_embedding: str | None = None
    # train.diversity's own component, set only where it is not the figures' (diversity_train/*)
    train_embedding: str | None = None
    ensemble: EnsembleSpec | None = None  # reward.ensemble
    # eval.geneval: the GenEval scorer whose 0/1 correctness is the evaluation's accuracy (its
    # defaults with a geneval reward: a held-out judge, pipeline.geneval_judge; None: not asked)
    judge: RewardSpec | None = None


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
    custom: dict[str, float] = field(default_factory=dict)  # custom Ray resources


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
    advantage: AdvantageSettings


_S = TypeVar("_S", bound="DataclassInstance")


def _from_section(cls: type[_S], section: BaseModel, **derived: Any) -> _S:
    """``cls`` (a settings dataclass) with every field that ``section`` has by the same name
    copied from it, and the others from ``derived``; a field in neither is an error (no setting
    falls back to a default silently)."""
    names = [f.name for f in fields(cls)]
    copied = {n: getattr(section, n) for n in names if n in type(section).model_fields}
    missing = sorted(set(names) - set(copied) - set(derived))
    if missing:
        raise TypeError(f"{cls.__name__}: no value for {missing} from {type(section).__name__}")
    return cls(**{**copied, **derived})


def _forward_settings(cfg: Config) -> ForwardSettings | None:
    if cfg.likelihood.estimator != "forward":
        return None
    f = cfg.likelihood.forward
    return _from_section(
        ForwardSettings,
        f,
        num_draws=f.mask_draws,
        ratio_min=f.mask_ratio_min,
        ratio_max=f.mask_ratio_max,
        ratio_rule=f.mask_ratios,
    )


def resolve_weight_sync(cfg: Config) -> str:
    """``learner.weight_sync`` with ``auto`` decided: the collective when the learner ranks and
    the rollout actors hold whole GPUs each (NCCL) and ZeRO-3 does not partition the weights.

    Fractional GPU shares keep the object store: Ray packs them onto one GPU, and NCCL refuses
    two ranks of a group on one device ("Duplicate GPU detected", measured on an H100 with a
    rollout actor and a learner rank at 0.4 GPU each; docs/gpu.md)."""
    lc = cfg.learner
    if lc.weight_sync != "auto":
        return lc.weight_sync
    whole = lc.num_gpus_per_worker >= 1 and cfg.rollout.num_gpus_per_actor >= 1
    return "collective" if whole and lc.zero_stage < 3 else "object_store"


def _rollout_settings(cfg: Config) -> RolloutSettings:
    r = cfg.rollout
    return _from_section(
        RolloutSettings,
        r,
        group_size=r.samples_per_prompt,
        num_steps=r.unmasking_steps,
        forward=_forward_settings(cfg),
        step_agreement=cfg.train.unmasking_step_selection == "critical",
    )


def _eval_settings(cfg: Config) -> EvalSettings:
    """The evaluation sampler: ``eval``'s fields, each unset one the rollout's."""
    e, r, m = cfg.eval, cfg.rollout, cfg.logging.monitors
    return _from_section(
        EvalSettings,
        e,
        num_steps=e.unmasking_steps or r.unmasking_steps,
        guidance_scale=r.guidance_scale if e.guidance_scale is None else e.guidance_scale,
        temperature=r.temperature,
        gumbel_temperature=(
            r.gumbel_temperature if e.gumbel_temperature is None else e.gumbel_temperature
        ),
        seed=cfg.run.seed + 10_007,  # fixed, apart from the training streams
        sampler=e.sampler or r.sampler,
        probe_kl=bool(m.enabled and m.probe_kl and m.probe_prompts),
    )


def _update_settings(cfg: Config, forward: ForwardSettings | None) -> UpdateSettings:
    t = cfg.train
    return _from_section(
        UpdateSettings,
        t,
        num_steps=forward.num_draws if forward is not None else cfg.rollout.unmasking_steps,
        step_selection=t.unmasking_step_selection,
        steps_trained=t.unmasking_steps_trained,
        micro_batch_pairs=t.micro_batch_pairs_per_gpu,
        guards=LossGuards(
            log_ratio_clamp=t.log_ratio_clamp or None,
            dual_clip=t.dual_clip or None,
            kl_clamp=t.kl_clamp or None,
            kl_normalization=t.kl_normalization,
        ),
        seed=cfg.run.seed,
        cycle_units=forward is not None and cfg.likelihood.forward.draws_per_update == "one",
        window_shift=t.unmasking_window_shift_updates,
        anchor_steps=t.anchor_unmasking_steps,
        anchor_coef=t.anchor_kl_coef,
        autocast=cfg.learner.autocast,
        auto_margin=t.unmasking_step_auto_margin,
        shrinkage=t.trajectory_shrinkage,
    )


def _learner_settings(cfg: Config) -> LearnerSettings:
    return _from_section(
        LearnerSettings,
        cfg.learner,
        weight_sync=resolve_weight_sync(cfg),
        weight_sync_bucket_bytes=int(cfg.learner.weight_sync_bucket_mb * (1 << 20)),
        overlapped=cfg.rollout.max_policy_lag > 0,
    )


def _reward_settings(cfg: Config) -> RewardSettings:
    """Each component's arguments: the model kind's defaults for it, then its own ``args``;
    the components the diversity figures are measured in."""
    specs = tuple(
        RewardSpec(c.kind, c.weight, {**reward_defaults(cfg.model, c.kind), **c.args})
        for c in cfg.reward.components
    )
    e = cfg.reward.ensemble
    ensemble = None
    if e is not None:
        ensemble = EnsembleSpec(tuple(e.members), e.rule, e.std_coef, e.weight)
    judge = judge_spec(cfg, specs)  # a geneval reward is judged by eval.geneval's scorer
    return RewardSettings(
        specs, cfg.reward.diversity_embedding, _train_embedding(cfg), ensemble=ensemble, judge=judge
    )


def component_name(c: RewardComponent) -> str:
    """A reward component's name: the key of its part in the composite (``args.name``, else
    its kind)."""
    return str(c.args.get("name", c.kind))


def _embedding_components(cfg: Config) -> list[tuple[str, float, bool]]:
    """``(name, weight, embeds)`` of every reward component (the model's plugins, which may
    register reward kinds, imported first)."""
    load_plugins(cfg.model.plugins)
    return [(component_name(c), c.weight, reward_embeds(c.kind)) for c in cfg.reward.components]


def check_diversity_spaces(cfg: Config) -> None:
    """Before anything starts: ``reward.diversity_embedding`` and ``train.diversity.embedding``
    name components that embed, and ``train.diversity`` has one to use. Raises a one-line
    :class:`UserError` naming the field, the value and the fix."""
    comps = _embedding_components(cfg)
    embeds = [n for n, _, e in comps if e]
    names = [n for n, _, _ in comps]
    kind = cfg.train.diversity.kind
    if kind != "none" and not embeds:
        raise UserError(
            f"train.diversity.kind={kind!r}: no reward component has an image embedding "
            f"(components: {names}), so there is no diversity/{cfg.train.diversity.measure} "
            "to use; add one that does (clip, toy_rules, toy_geneval, shapes_clip, "
            "shapes_judge; weight 0 is enough) or set train.diversity.kind none"
        )
    fields = [("reward.diversity_embedding", cfg.reward.diversity_embedding)]
    if kind != "none":
        fields.append(("train.diversity.embedding", cfg.train.diversity.embedding))
    for field_name, named in fields:
        if named is not None and named not in embeds:
            raise UserError(
                f"{field_name}={named!r} names no reward component with an image embedding "
                f"(the components that have one: {embeds}; all: {names}); name one of them, "
                "or leave it unset (null) for the heaviest that has one"
            )


def _train_embedding(cfg: Config) -> str | None:
    """The component ``train.diversity`` measures in, where it is not the one the reported
    figures are measured in (then the reward computes ``diversity_train/*`` there); else None."""
    d, named = cfg.train.diversity, cfg.reward.diversity_embedding
    if d.kind == "none" or d.embedding == named:
        return None
    check_diversity_spaces(cfg)
    comps = _embedding_components(cfg)
    train = embedding_choice(comps, d.embedding)
    return train if train != embedding_choice(comps, named) else None


def _healing(section: RolloutConfig | RewardConfig) -> PoolHealing:
    return PoolHealing(section.max_restarts, section.call_timeout_seconds)


def _resources(section: RolloutConfig | RewardConfig) -> ActorResources:
    return ActorResources(
        section.num_cpus_per_actor, section.num_gpus_per_actor, dict(section.custom_resources)
    )


def advantage_settings(cfg: Config) -> AdvantageSettings:
    """The advantage rule of ``train.advantage`` and ``train.diversity``; the GDPO component
    weights keyed by each component's name in ``ScoredBatch.reward_parts`` (``args.name``, else
    its kind)."""
    t = cfg.train
    return AdvantageSettings(
        kind=t.advantage,
        diversity=t.diversity.kind,
        measure=train_figure(t.diversity.measure, _train_embedding(cfg) is not None),
        bonus_weight=t.diversity.bonus_weight,
        gardo_over=t.diversity.gardo_normalize,
        recentre=t.diversity.recentre,
        eps=t.advantage_eps,
        component_weights={component_name(c): c.weight for c in cfg.reward.components},
        clip=t.advantage_clip,
    )


@dataclass(frozen=True)
class StepSettings:
    """What the driver's step loop reads on every step, made once at the start
    (:func:`step_settings`): the loop never holds the :class:`Config` to rebuild from it."""

    advantage: AdvantageSettings  # the kept groups' advantages (phases.make_train_batch)
    max_policy_lag: int  # rollout.max_policy_lag: the staleness check, lag 1's wait
    samples_per_prompt: int  # rollout.samples_per_prompt
    onpolicy_ratio_tolerance: float  # train.onpolicy_ratio_tolerance
    sample_grid_every_steps: int  # logging.sample_grid_every_steps (0: none)
    steps: int  # train.steps (the last step draws a grid too)
    checkpoint_every_steps: int  # run.checkpoint_every_steps: no submission ahead crosses one


def step_settings(cfg: Config) -> StepSettings:
    """The step loop's settings (:class:`StepSettings`), built once per run."""
    return StepSettings(
        advantage=advantage_settings(cfg),
        max_policy_lag=cfg.rollout.max_policy_lag,
        samples_per_prompt=cfg.rollout.samples_per_prompt,
        onpolicy_ratio_tolerance=cfg.train.onpolicy_ratio_tolerance,
        sample_grid_every_steps=cfg.logging.sample_grid_every_steps,
        steps=cfg.train.steps,
        checkpoint_every_steps=cfg.run.checkpoint_every_steps,
    )


def settings_from_config(cfg: Config) -> RunSettings:
    """Build every role's settings from the validated config (the one place that reads it)."""
    rollout = _rollout_settings(cfg)
    return RunSettings(
        model=cfg.model,
        rollout=rollout,
        eval=_eval_settings(cfg),
        update=_update_settings(cfg, rollout.forward),
        learner=_learner_settings(cfg),
        reward=_reward_settings(cfg),
        filter=_from_section(FilterSettings, cfg.filter),
        rollout_resources=_resources(cfg.rollout),
        reward_resources=_resources(cfg.reward),
        rollout_healing=_healing(cfg.rollout),
        reward_healing=_healing(cfg.reward),
        advantage=advantage_settings(cfg),
    )
