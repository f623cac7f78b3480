"""The update's config sections: scoring (``reward``), sample filtering (``filter``), the
clipped GRPO objective and its optimizer (``train``) (the learner group's section, ``learner``, is
:mod:`maskgrpo_ray.config.learner`).

Part of the one config tree (:mod:`maskgrpo_ray.config`, the import point); plain pydantic.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from maskgrpo_ray.config.base import Strict
from maskgrpo_ray.config.refresh import RewardRefreshConfig


class RewardComponent(Strict):
    """One term of the reward: a registered scorer, its weight and its arguments."""

    kind: str = Field(
        description="registered reward kind: toy_rules, toy_geneval (reads each prompt's "
        "GenEval metadata), clip, imagereward"
    )
    weight: float = Field(1.0, description="weight of this component in the summed reward")
    args: dict[str, Any] = Field(
        default_factory=dict, description="keyword arguments of the reward kind (paths, ...)"
    )


class EnsembleConfig(Strict):
    """An ensemble of reward models as one term of the reward (docs/monitors.md, Defenses):
    its members are components of weight 0 (each logged as reward/<name>), combined per sample
    into a pessimistic score that the policy can only raise where every member agrees."""

    members: list[str] = Field(
        min_length=2,
        description="the components combined (their args.name, else their kind); each must "
        "have weight 0 in reward.components: the ensemble term carries the weight",
    )
    rule: Literal["mean_minus_std", "min"] = Field(
        "mean_minus_std",
        description="mean_minus_std: mean - std_coef * std over the members (std over members, "
        "divided by M); min: the lowest member",
    )
    std_coef: float = Field(1.0, ge=0, description="k of mean - k * std (rule mean_minus_std)")
    weight: float = Field(1.0, description="weight of the ensemble term in the summed reward")


class RewardConfig(Strict):
    """Scoring: the reward actors and the weighted sum of reward components."""

    components: list[RewardComponent] = Field(
        default_factory=lambda: [RewardComponent(kind="toy_rules")],
        description="reward terms, summed with their weights (see reward.components[])",
    )
    diversity_embedding: str | None = Field(
        None,
        description="the reward component (its args.name, else its kind) whose image embedding "
        "the figures diversity/pairwise and diversity/nn are measured in, in training rows and "
        "evaluation; it must embed (clip, toy_rules, toy_geneval, shapes_clip, shapes_judge). "
        "None: the heaviest component that embeds, the reward's own space, which the policy is "
        "pushed on; name another (weight 0 is enough) for a judge that is not the reward "
        "(docs/diversity.md)",
    )
    ensemble: EnsembleConfig | None = Field(
        None,
        description="a term mean - k * std (or min) over several reward components of weight 0, "
        "added to the weighted sum with its own weight (a defense against reward hacking: "
        "docs/monitors.md); None: none",
    )
    refresh: RewardRefreshConfig = Field(
        default_factory=RewardRefreshConfig,
        description="the learned reward keeps training during RL on reference renders against "
        "the policy's samples (Adv-GRPO; see reward.refresh)",
    )
    num_actors: int = Field(1, ge=1, description="reward actors (Ray backend)")
    num_cpus_per_actor: float = Field(0.5, ge=0, description="Ray CPUs reserved per reward actor")
    num_gpus_per_actor: float = Field(0.0, ge=0, description="Ray GPUs reserved per reward actor")
    custom_resources: dict[str, float] = Field(
        default_factory=dict,
        description="custom Ray resources each reward actor asks for besides CPUs and GPUs, e.g. "
        "{rollout_node: 0.01}: it is then placed only on nodes that advertise them (ray_cluster.yaml's "
        "rollout_gpu node type does); empty: any node",
    )
    max_restarts: int = Field(
        8, ge=0, description="dead or hung reward actors replaced per run; past it, dropped"
    )
    call_timeout_seconds: float = Field(
        0.0,
        ge=0,
        description=(
            "a score call running longer is taken as hung: the actor is killed and replaced, "
            "the chunk re-scored; 0: the executor's timeout (600 s)"
        ),
    )

    @model_validator(mode="after")
    def _ensemble(self) -> RewardConfig:
        e = self.ensemble
        if e is None:
            return self
        weights = {str(c.args.get("name", c.kind)): c.weight for c in self.components}
        for m in e.members:
            if m not in weights or weights[m] != 0.0:
                got = "no component" if m not in weights else f"weight {weights[m]}"
                raise ValueError(
                    f"reward.ensemble.members names {m!r} ({got}): each member must be a "
                    f"reward component of weight 0 (the components: {list(weights)}); the "
                    "ensemble's own weight is reward.ensemble.weight"
                )
        if len(set(e.members)) != len(e.members):
            raise ValueError(f"reward.ensemble.members {e.members} repeats a component")
        return self


class FilterConfig(Strict):
    """Sample filtering: drop groups whose reward std is low against the recent history."""

    enabled: bool = Field(True, description="drop low-variance groups and re-sample their prompts")
    percentile: float = Field(
        10.0, description="drop groups under this percentile (0-100) of the group-std history"
    )
    warmup_groups: int = Field(16, ge=0, description="groups in the history before any is dropped")
    max_history: int = Field(1024, ge=1, description="sliding window of group stds, in groups")
    max_resamples: int = Field(2, ge=0, description="re-sampling attempts per dropped prompt")

    @model_validator(mode="after")
    def _pct(self) -> FilterConfig:
        if not 0.0 <= self.percentile <= 100.0:
            raise ValueError(
                f"filter.percentile={self.percentile} is outside 0-100: it is a percentile of the "
                "group-std history (the paper uses 10); set a value in [0, 100]"
            )
        return self


class DiversityConfig(Strict):
    """Diversity-aware advantages (``train.diversity``): keep a prompt's images varied while the
    reward goes up (docs/diversity.md)."""

    kind: Literal["none", "gardo", "bonus"] = Field(
        "none",
        description=(
            "none: advantages from the reward alone; gardo: each positive advantage times the "
            "sample's diversity over its group's mean (GARDO, arXiv 2512.24138), negative ones "
            "unchanged; bonus: bonus_weight x the sample's diversity added to its reward before "
            "the advantage (group-relative, since the advantage centres each group)"
        ),
    )
    measure: Literal["nn", "pairwise"] = Field(
        "nn",
        description=(
            "the per-sample diversity it uses, in the image embedding of `embedding` (CLIP "
            "image features; the toy's palette cells): nn, 1 - cos to the nearest other member "
            "of the group (diversity/nn, GARDO's); pairwise, the mean 1 - cos to the others "
            "(diversity/pairwise)"
        ),
    )
    embedding: str | None = Field(
        None,
        description=(
            "the reward component (args.name, else kind) in whose image embedding `measure` "
            "is taken; None: the heaviest component that embeds (the reward's own space), "
            "whatever reward.diversity_embedding says. Where the two differ the reward also "
            "computes diversity_train/nn and diversity_train/pairwise, the figures this rule "
            "reads"
        ),
    )
    bonus_weight: float = Field(
        0.0, ge=0, description="kind bonus: the weight of the diversity added to the reward"
    )
    recentre: bool = Field(
        False,
        description=(
            "kind gardo: subtract each group's mean from the scaled advantages, so the group's "
            "update is zero-sum again: credit moves from repeated good images to novel ones "
            "(a repeat of a good image gets a negative advantage) instead of being dropped"
        ),
    )
    gardo_normalize: Literal["group", "positive"] = Field(
        "group",
        description=(
            "kind gardo: the mean the diversity is divided by: group (GARDO's: every member) "
            "or positive (the members with a positive advantage: the positive advantages are "
            "only redistributed towards the ones that stand apart, their sum's scale kept)"
        ),
    )

    @model_validator(mode="after")
    def _bonus(self) -> DiversityConfig:
        if self.kind == "bonus" and self.bonus_weight <= 0:
            raise ValueError(
                "train.diversity.kind='bonus' with bonus_weight=0 adds nothing; set "
                "train.diversity.bonus_weight > 0 (the toy: 1-10, on the scale of the reward "
                "per unit of 1 - cos) or kind 'none'"
            )
        return self


class TrainConfig(Strict):
    """The update: driver steps, optimizer, clipped GRPO objective and its guards."""

    steps: int = Field(
        120, ge=0, description="driver steps (generate-score-filter-update iterations) to run"
    )
    prompts_per_step: int = Field(16, ge=1, description="B, prompts (groups) per driver step")
    learning_rate: float = Field(1e-3, description="peak learning rate (AdamW), after warm-up")
    warmup_updates: int = Field(
        10, ge=0, description="optimizer updates of linear LR warm-up (Adam's first are sign-like)"
    )
    weight_decay: float = Field(
        0.0, ge=0, description="AdamW weight decay of matrices (biases, norms: none)"
    )
    adam_betas: tuple[float, float] = Field((0.9, 0.99), description="AdamW (beta1, beta2)")
    grad_clip_norm: float = Field(1.0, ge=0, description="global grad-norm clip; 0 disables it")
    clip_low: float = Field(0.2, ge=0, lt=1, description="ratio clip below: 1 - clip_low")
    clip_high: float = Field(0.28, ge=0, description="ratio clip above: 1 + clip_high")
    kl_coef: float = Field(0.0, ge=0, description="beta of the k3 KL to the frozen base model")
    kl_normalization: Literal["per_token", "per_transition"] = Field(
        "per_token",
        description=(
            "per_token: k3 of the transition's log-ratio divided by the tokens it covers (beta "
            "on the per-token scale of verl/TRL); per_transition: k3 of the summed log-ratio"
        ),
    )
    kl_clamp: float = Field(
        10.0, ge=0, description="clamp k3's log-ratio to [-c, c] before exp (0 disables)"
    )
    log_ratio_clamp: float = Field(
        20.0,
        ge=0,
        description="clamp logp - old_logp to [-c, c] before the ratio's exp (0 disables)",
    )
    dual_clip: float = Field(
        3.0,
        ge=0,
        description="dual-clip c > 1: for A < 0 the surrogate is at least c * A (0 disables)",
    )
    advantage_eps: float = Field(
        1e-4, gt=0, description="eps of A = (r - mean) / (std + eps) (Eq. 12)"
    )
    advantage: Literal["grpo", "centred", "gdpo", "batch_std"] = Field(
        "grpo",
        description=(
            "grpo: A = (r - mean) / (std + eps) per group (Eq. 12); centred: A = r - mean "
            "(GARDO's, Dr. GRPO's); gdpo: each reward component normalised within its group, "
            "their weighted sum normalised over the batch (GDPO, arXiv 2601.05242; needs two "
            "or more reward.components); batch_std: A = (r - group mean) / (the batch's reward "
            "std + eps) (Flow-GRPO's global std: a near-constant group keeps small advantages)"
        ),
    )
    advantage_clip: float = Field(
        0.0,
        ge=0,
        description="clamp every advantage to [-c, c] after train.advantage and train.diversity "
        "(Flow-GRPO clips at 5); 0: no clip",
    )
    ema_decay: float = Field(
        0.0,
        ge=0,
        lt=1,
        description=(
            "d of an exponential moving average of the trained tensors (LoRA: the adapter's), "
            "as Flow-GRPO's EMAModuleWrapper (github.com/yifan123/flow_grpo, flow_grpo/ema.py; "
            "decay 0.9 in scripts/train_sd3.py): after the n-th optimizer step ema <- d_n ema + "
            "(1 - d_n) theta, d_n = min(d, (1 + n) / (10 + n)) (its warm-up). Rollouts keep the "
            "live policy; the held-out evaluation, the monitor probe, the per-tag grids, the "
            "exported policy and a checkpoint's adapter use the EMA; checkpoints keep it; "
            "ema/distance logs ||EMA - live||. 0: off (Flow-GRPO: 0.9)"
        ),
    )
    diversity: DiversityConfig = Field(
        default_factory=DiversityConfig, description="diversity-aware advantages"
    )
    unmasking_step_selection: Literal[
        "all", "first", "last", "random", "group_random", "window", "auto", "critical"
    ] = Field(
        "all",
        description=(
            "which unmasking steps are trained (computational reduction): all; the first or "
            "last k; random: k drawn per update for the whole batch; group_random: k drawn "
            "anew for each group and update, every sample of a group on the same steps "
            "(iso-temporal, Flash-GRPO); window: k consecutive steps whose start slides one "
            "step every unmasking_window_shift_updates updates, early to late, then again "
            "(MixGRPO); auto: the steps the step-signal probe (step_signal_every_steps) "
            "measures above the shuffled floor (unmasking_step_auto_margin), at most k, "
            "re-measured at every probe; the first probe runs before the first update; "
            "critical: MaskFocus's critical steps (zghhui/MaskFocus), per group: the k steps "
            "whose prediction moved the intermediate image furthest towards the final sample "
            "(|a_t - a_(t-1)|, a_t the share of tokens where step t's predicted image equals "
            "the final one, averaged over the group; candidates 1 .. S-2 as MaskFocus's, steps "
            "0 and S-1 ranked last), recorded by the rollout; a group's samples train the same "
            "steps"
        ),
    )
    unmasking_steps_trained: int = Field(
        0,
        ge=0,
        description="k, unmasking steps trained by first/last/random/group_random/window; "
        "auto: the most it trains (the cap the planner's cost model uses)",
    )
    step_signal_every_steps: int = Field(
        0,
        ge=0,
        description=(
            "every N driver steps (step 0 included), before the step's update, measure each "
            "unmasking step's gradient signal on the run's own model (bench/step_signal.py's "
            "measurement: step_signal_batches fresh probe batches, their per-step gradients' "
            "mean cosine against the same with advantages shuffled within groups) and log it "
            "(metrics.jsonl step_signal/*, the trackers, summary.json, RUN_DIR/step_signal.png); "
            "0: off. Cost per probe (P = B): K steps' rollouts and 2K full-trajectory updates' "
            "learner passes (2 x K x S passes over B x G samples, no optimizer step): at the "
            "defaults (K = 6) and the paper's Show-o 512 batch, 57600 (sample, step) pairs "
            "against an update's 4800; on the toy (S = 8, 16 prompts) 3.1-3.6 s a probe at "
            "one torch thread on a shared 2-core machine, against 0.2-0.4 s for a training "
            "step of its default recipe, so it is off there. Its own RNG streams: the weights "
            "a run learns do not change"
        ),
    )
    step_signal_batches: int = Field(
        6,
        ge=3,
        description="K, independent probe batches per measurement (cosines of K(K-1)/2 pairs; "
        "the jackknife standard error needs a few: at K = 4 it is about 3x the spread of the "
        "per-batch means over sqrt(K), at 6 2.5x)",
    )
    step_signal_prompts_per_batch: int = Field(
        0,
        ge=0,
        description="P, prompts per probe batch (x G samples each); 0: train.prompts_per_step, "
        "the question being whether one update's gradient at a step has a direction (the "
        "signal's share falls with the batch: on the toy, 4 prompts a batch find nothing)",
    )
    unmasking_step_auto_margin: float = Field(
        2.0,
        ge=0,
        description=(
            "auto: a step is trained when its cosine exceeds the shuffled floor by this many "
            "standard errors of the difference (sqrt(se^2 + se_floor^2))"
        ),
    )
    unmasking_window_shift_updates: int = Field(
        1, ge=1, description="window selection: updates before the window moves one step"
    )
    anchor_unmasking_steps: int = Field(
        0,
        ge=0,
        description=(
            "m: the first m unmasking steps are trained towards the base model only (a k3 KL "
            "of their transitions, weight anchor_kl_coef, no reward advantage): where a masked "
            "model decides what goes where, held to the base's spread while the reward trains "
            "the late steps (trajectory estimator; docs/diversity.md)"
        ),
    )
    anchor_kl_coef: float = Field(
        0.0, ge=0, description="beta of the anchored steps' KL to the base (per transition)"
    )
    micro_batch_pairs_per_gpu: int = Field(
        256,
        ge=1,
        description="(sample, unmasking step) pairs per forward pass, per learner rank; under "
        "trajectory_shrinkage, model input rows (one per sample and block of s steps)",
    )
    updates_per_batch: int = Field(
        1, ge=1, description="optimizer updates (passes) over each driver step's batch"
    )
    onpolicy_ratio_tolerance: float = Field(
        1e-3,
        gt=0,
        description=(
            "on-policy check: when every sample of an update was generated with the learner's "
            "weights (lag 0), the first pass's max |ratio - 1| against the rollout's cached "
            "log-probs (every micro-batch; under trajectory_shrinkage the block starts only, "
            "onpolicy/measured_share of the pairs; NaN when none) is logged as "
            "onpolicy/first_ratio_max_abs_dev and a WARNING names the step when it exceeds "
            "this. float32 round-off of a transition log-prob summed over L tokens stays well "
            "under 1e-3 (the toy: under 1e-5); under learner.autocast bf16 raise it (bf16 "
            "logits move a summed log-prob by ~1e-2)"
        ),
    )
    likelihood_guidance_scale: float | None = Field(
        None,
        ge=0,
        description=(
            "the guidance of the trained likelihood (the ratio, its old log-probs and the KL "
            "term): null: the rollout's (rollout.guidance_scale, the sampler's own likelihood); "
            "a number: the learner scores every transition with this guidance instead, 0: the "
            "conditional logits alone (DanceGRPO trains without guidance, arXiv 2505.07818; "
            "one forward per pair instead of two). The rollout's cached log-probs are then of "
            "another likelihood: the learner recomputes the old log-probs of the trained pairs "
            "before the update (no gradient, one more forward pass per pair), so the first "
            "ratio is 1 and the clip is against the weights the update starts from (with "
            "rollout.max_policy_lag > 0 the lag's importance correction is then not applied)"
        ),
    )
    trajectory_shrinkage: int = Field(
        1,
        ge=1,
        description=(
            "s, TraceRL's trajectory shrinkage (Gen-Verse/dLLM-RL): s consecutive unmasking "
            "steps (a block t0 .. t0+s-1, t0 a multiple of s) are scored in ONE forward pass at "
            "the block's first state Y_t0, each step's newly unmasked tokens still scored as "
            "its own transition, so S steps cost ceil(S/s) forward passes per sample. Biased: "
            "a later step of a block is scored from an earlier, more masked state than it was "
            "sampled in; the old log-probs of the trained pairs are recomputed by the learner "
            "under the same shrunk scoring before the update (no gradient; ceil(S/s) more "
            "forward passes), so the first ratio is 1 and the clip is against the learner's "
            "weights before the update (with rollout.max_policy_lag > 0 the lag's importance "
            "correction is then not applied). 1: the exact trajectory (trajectory estimator "
            "only; docs/algorithm.md)"
        ),
    )

    @model_validator(mode="after")
    def _anchor(self) -> TrainConfig:
        if (self.anchor_unmasking_steps > 0) != (self.anchor_kl_coef > 0):
            raise ValueError(
                f"train.anchor_unmasking_steps={self.anchor_unmasking_steps} with "
                f"train.anchor_kl_coef={self.anchor_kl_coef}: anchoring needs both a number of "
                "steps and a KL weight; set both (e.g. 2 and 0.1) or both to 0"
            )
        return self

    @model_validator(mode="after")
    def _lr(self) -> TrainConfig:
        if 0.0 < self.dual_clip <= 1.0:
            raise ValueError(
                f"train.dual_clip={self.dual_clip}: the dual-clip bound must exceed 1 (it floors "
                "the surrogate of negative advantages at c * A beyond the usual clip); use 3.0 "
                "(verl's default) or 0 to disable it"
            )
        if not self.learning_rate > 0:
            raise ValueError(
                f"train.learning_rate={self.learning_rate} must be positive: a zero or negative "
                "rate stops or reverses learning; use e.g. 3e-4 (toy) or 3e-6 (Show-o)"
            )
        return self
