"""One config tree, loaded from YAML, validated before any actor starts.

Units are in the names (``prompts_per_step``, ``samples_per_prompt``, ``num_cpus_per_actor``).
"Step" alone means a driver step (one generate-score-filter-update iteration: ``train.steps``,
``eval.every_steps``); unmasking steps of the sampler are ``unmasking_steps`` and optimizer
updates are ``updates``. Every field has a ``description``; ``docs/config.md`` is rendered from
them (:mod:`maskgrpo_ray.config_docs`). Unknown keys are errors, and renamed keys
(:data:`RENAMED_FIELDS`) are errors that name the new key. Cross-field rules live in validators
whose messages say the rule, the reason and the fix. ``--set a.b.c=value`` overrides are applied
to the YAML before validation.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from maskgrpo_ray.evaluation.metrics import MetricSpec
from maskgrpo_ray.models.registry import entry_for


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ToyModelConfig(_Strict):
    """The embedded toy world's policy: a small transformer over a grid of palette tokens."""

    grid: int = Field(4, ge=2, description="image tokens per side (L = grid * grid); even")
    cell_px: int = Field(8, ge=1, description="pixels per token side in the palette decoder")
    d_model: int = Field(64, ge=8, description="transformer width (divisible by heads)")
    layers: int = Field(2, ge=1, description="transformer blocks")
    heads: int = Field(4, ge=1, description="attention heads per block")
    pretrain_steps: int = Field(
        600, ge=0, description="optimizer updates of the supervised pre-training of the base model"
    )
    pretrain_batch: int = Field(64, ge=1, description="scenes per pre-training update")
    pretrain_lr: float = Field(1e-3, gt=0, description="pre-training learning rate")
    noise_prob: float = Field(0.5, ge=0, le=1, description="share of corrupted pre-training scenes")

    @model_validator(mode="after")
    def _heads_divide(self) -> ToyModelConfig:
        if self.d_model % self.heads:
            raise ValueError(
                f"model.toy.d_model={self.d_model} is not divisible by model.toy.heads="
                f"{self.heads}: attention splits d_model evenly across heads; change one of them"
            )
        if self.grid % 2:
            raise ValueError(f"model.toy.grid={self.grid} must be even (positions name halves)")
        return self


class ShowoModelConfig(_Strict):
    """Show-o (Phi-1.5 transformer + MAGVIT-v2 tokenizer), from local folders or the HF cache."""

    showo_path: str | None = Field(None, description="local folder or HF cache repo id of Show-o")
    magvit_path: str | None = Field(
        None, description="local folder or HF cache repo id of MAGVIT-v2"
    )
    tokenizer_path: str | None = Field(None, description="local folder of the Phi-1.5 tokenizer")
    tiny_random: bool = Field(False, description="build a tiny random Show-o (tests, CPU demo)")
    resolution_px: Literal[256, 512] = Field(256, description="image side in pixels")
    max_text_tokens: int = Field(128, ge=1, description="prompt length in text tokens (padded)")
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="dtype of the Show-o transformer's weights"
    )


class ModelConfig(_Strict):
    """The policy: which registered masked image model, and its own settings."""

    kind: str = Field(
        "toy",
        description="registered model kind: 'toy', 'showo', or one registered by model.plugins",
    )
    plugins: list[str] = Field(
        default_factory=list,
        description=(
            "modules (names, or .py file paths) imported in the driver and every actor before "
            "model.kind is looked up, so that they register their kinds (see docs/models.md)"
        ),
    )
    toy: ToyModelConfig = Field(
        ToyModelConfig(), description="settings of the toy model (kind 'toy')"
    )
    showo: ShowoModelConfig = Field(
        ShowoModelConfig(), description="settings of Show-o (kind 'showo')"
    )
    args: dict[str, Any] = Field(
        default_factory=dict,
        description=(
            "settings of a plugin kind without a section here, validated by its registered "
            "config_section when it has one"
        ),
    )

    @model_validator(mode="after")
    def _registered(self) -> ModelConfig:
        section = entry_for(self).config_section  # imports model.plugins; unknown kinds fail
        own = {f.annotation for f in type(self).model_fields.values()}
        if section is not None and section not in own:
            section.model_validate(self.args)  # a plugin kind's settings live in model.args
        return self


class RolloutConfig(_Strict):
    """Sampling: the rollout actors that generate G images per prompt."""

    samples_per_prompt: int = Field(6, description="G, images per prompt (a group); at least 2")
    unmasking_steps: int = Field(8, ge=1, description="S, unmasking steps in training rollouts")
    temperature: float = Field(1.0, gt=0, description="token sampling temperature")
    gumbel_temperature: float = Field(
        0.0, ge=0, description="tau_0 of the choose-and-move noise (Show-o uses 1.0)"
    )
    guidance_scale: float = Field(0.0, ge=0, description="Show-o CFG w: (1+w) cond - w uncond")
    transition: Literal["p1", "p2", "ar"] = Field(
        "p1",
        description="transition log-prob: p1 (Eq. 14), p2 (Eq. 15) or ar (Eq. 13, the baseline)",
    )
    remask_likelihood: Literal["marginal", "eq14"] = Field(
        "marginal",
        description=(
            "how p1 treats the Gumbel remasking noise (gumbel_temperature > 0): 'marginal' "
            "integrates it out, the exact probability of Show-o's transition (equal to Eq. 14 "
            "at tau = 0); 'eq14' uses Eq. 14 as printed, exact only without noise"
        ),
    )
    sampler: Literal["showo", "ancestral"] = Field(
        "showo",
        description=(
            "'showo': commit the most confident tokens (Gumbel-perturbed), Show-o's sampler; "
            "'ancestral': each masked token commits independently with probability "
            "(k_t - k_s)/k_t (MaskGRPO on MMaDA); with the trajectory estimator only p2 is exact"
        ),
    )
    num_actors: int = Field(2, ge=1, description="rollout actors (Ray backend)")
    num_cpus_per_actor: float = Field(0.5, ge=0, description="Ray CPUs reserved per rollout actor")
    num_gpus_per_actor: float = Field(0.0, ge=0, description="Ray GPUs reserved per rollout actor")
    prompts_per_chunk: int = Field(
        0, ge=0, description="prompts per pull-based rollout request; 0: ceil(B / num_actors)"
    )
    max_policy_lag: int = Field(
        0,
        ge=0,
        le=1,
        description=(
            "asynchronous rollouts: 1 generates step k+1's rollouts with the weights before step "
            "k's update (one policy version behind; the cached old log-probs are the behaviour "
            "policy's, so the ratio is against them), except across a checkpoint: on Ray while "
            "the learner trains, on the local backend at once (the reference of the Ray run); "
            "0: the synchronous loop"
        ),
    )
    max_restarts: int = Field(
        8,
        ge=0,
        description=(
            "dead or hung rollout actors replaced (with the current weights) per run; past it "
            "a lost actor is dropped and the run goes on with fewer"
        ),
    )
    call_timeout_seconds: float = Field(
        0.0,
        ge=0,
        description=(
            "a generate call running longer is taken as hung: the actor is killed and "
            "replaced, its chunk re-issued; 0: the executor's timeout (600 s)"
        ),
    )

    @model_validator(mode="after")
    def _group(self) -> RolloutConfig:
        if self.samples_per_prompt < 2:
            raise ValueError(
                f"rollout.samples_per_prompt={self.samples_per_prompt}: GRPO needs G >= 2 samples "
                "per prompt, since advantages are rewards relative to the group; set it to 2 or "
                "more (the paper uses 6)"
            )
        return self


class ForwardEstimatorConfig(_Strict):
    """The forward estimator: score the final tokens re-masked by K seeded masks."""

    mask_draws: int = Field(
        4, ge=1, description="K, seeded masks per sample (forward passes per sample and update)"
    )
    mask_ratio_min: float = Field(
        0.2, gt=0, le=1, description="smallest share of the image tokens a mask covers"
    )
    mask_ratio_max: float = Field(
        1.0, gt=0, le=1, description="largest share of the image tokens a mask covers"
    )
    mask_ratios: Literal["stratified", "uniform", "step_focus"] = Field(
        "stratified",
        description=(
            "'stratified': draw k masks ratio min + (max-min)(k+1)/K (MaskGRPO on MMaDA); "
            "'uniform': ratios drawn from U(min, max) per sample; 'step_focus': the masked "
            "counts of the K trajectory steps where the prediction changes most (MaskFocus-style)"
        ),
    )
    reduction: Literal["mean", "sum"] = Field(
        "mean",
        description=(
            "log-prob of a draw: 'mean' or 'sum' over its masked tokens ('sum' moves the ratio "
            "out of the clip band far sooner at hundreds of tokens)"
        ),
    )

    draws_per_update: Literal["all", "one"] = Field(
        "all",
        description=(
            "'all': every inner update (train.updates_per_batch) scores all K draws; 'one': "
            "inner update i scores draw i mod K only, one mask ratio per inner iteration as "
            "MaskGRPO on MMaDA (set updates_per_batch to a multiple of mask_draws)"
        ),
    )

    @model_validator(mode="after")
    def _range(self) -> ForwardEstimatorConfig:
        if self.mask_ratio_min > self.mask_ratio_max:
            raise ValueError(
                f"likelihood.forward.mask_ratio_min={self.mask_ratio_min} exceeds "
                f"mask_ratio_max={self.mask_ratio_max}: masks cover a share of the tokens in "
                "[min, max]; swap them or make them equal"
            )
        return self


class LikelihoodConfig(_Strict):
    """Which likelihood the objective's ratio uses: the unmasking trajectory or the re-masked
    final sample (docs/algorithm.md compares them)."""

    estimator: Literal["trajectory", "forward"] = Field(
        "trajectory",
        description=(
            "'trajectory': Mask-GRPO's per-unmasking-step transition (rollout.transition); "
            "'forward': K seeded re-maskings of the final tokens (likelihood.forward)"
        ),
    )
    forward: ForwardEstimatorConfig = Field(
        ForwardEstimatorConfig(), description="settings of the forward estimator"
    )


class RewardComponent(_Strict):
    """One term of the reward: a registered scorer, its weight and its arguments."""

    kind: str = Field(
        description="registered reward kind: toy_rules, toy_geneval (reads each prompt's "
        "GenEval metadata), clip, imagereward"
    )
    weight: float = Field(1.0, description="weight of this component in the summed reward")
    args: dict[str, Any] = Field(
        default_factory=dict, description="keyword arguments of the reward kind (paths, ...)"
    )


class RewardConfig(_Strict):
    """Scoring: the reward actors and the weighted sum of reward components."""

    components: list[RewardComponent] = Field(
        default_factory=lambda: [RewardComponent(kind="toy_rules")],
        description="reward terms, summed with their weights (see reward.components[])",
    )
    num_actors: int = Field(1, ge=1, description="reward actors (Ray backend)")
    num_cpus_per_actor: float = Field(0.5, ge=0, description="Ray CPUs reserved per reward actor")
    num_gpus_per_actor: float = Field(0.0, ge=0, description="Ray GPUs reserved per reward actor")
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


class FilterConfig(_Strict):
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


class TrainConfig(_Strict):
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
    unmasking_step_selection: Literal["all", "first", "last", "random"] = Field(
        "all", description="which unmasking steps are trained (computational reduction)"
    )
    unmasking_steps_trained: int = Field(
        0, ge=0, description="k, unmasking steps trained by first/last/random selection"
    )
    micro_batch_pairs_per_gpu: int = Field(
        256, ge=1, description="(sample, unmasking step) pairs per forward pass, per learner rank"
    )
    updates_per_batch: int = Field(
        1, ge=1, description="optimizer updates (passes) over each driver step's batch"
    )

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


class LearnerConfig(_Strict):
    """The learner group: DeepSpeed ranks that compute the update."""

    num_workers: int = Field(1, ge=1, description="learner ranks (torch.distributed world size)")
    zero_stage: Literal[0, 1, 2, 3] = Field(0, description="DeepSpeed ZeRO stage")
    bf16: bool = Field(False, description="DeepSpeed bf16 mixed precision")
    num_cpus_per_worker: float = Field(0.5, ge=0, description="Ray CPUs reserved per learner rank")
    num_gpus_per_worker: float = Field(0.0, ge=0, description="Ray GPUs reserved per learner rank")
    torch_threads_per_worker: int = Field(
        0,
        ge=0,
        description=(
            "torch threads per rank; 0: on GPU torch's default; on CPU the node's cores / "
            "num_workers in the synchronous loop, and num_cpus_per_worker (at least 1) with "
            "rollout.max_policy_lag > 0, where rollouts run on the same cores during the update"
        ),
    )
    activation_checkpointing: bool = Field(
        False,
        description=(
            "recompute each transformer layer's activations in the backward pass (less memory "
            "per micro-batch, about one more forward of compute; the same gradients); a model "
            "kind without it says so in a warning"
        ),
    )
    autocast: Literal["off", "bf16"] = Field(
        "off",
        description="'bf16': the learner's forward passes under torch.autocast in bfloat16 "
        "(float32 weights, gradients, optimizer and loss; the standard mixed precision). "
        "learner.bf16 is DeepSpeed's bf16 mode instead (bf16 weights, float32 master copy)",
    )
    weight_sync: Literal["auto", "object_store", "collective"] = Field(
        "auto",
        description=(
            "learner -> rollout weights: 'object_store' (one ray.put, fetched per node), "
            "'collective' (learner rank 0 broadcasts packed buckets in a torch.distributed "
            "group with the rollout actors: NCCL on GPUs, gloo on CPUs), 'auto': collective "
            "when the learner and the rollout actors have GPUs and zero_stage < 3"
        ),
    )
    weight_sync_bucket_mb: float = Field(
        256.0, gt=0, description="collective weight sync: bytes per broadcast bucket, in MiB"
    )


class EvalConfig(_Strict):
    """Held-out evaluation with a fixed seed; unset sampler fields default to the rollout's."""

    every_steps: int = Field(
        30, ge=0, description="driver steps between evaluations; 0: only before and after training"
    )
    samples_per_prompt: int = Field(32, ge=1, description="images per eval prompt")
    unmasking_steps: int | None = Field(
        None, ge=1, description="eval unmasking steps (default: rollout.unmasking_steps)"
    )
    guidance_scale: float | None = Field(
        None, ge=0, description="eval Show-o CFG w (default: rollout's)"
    )
    gumbel_temperature: float | None = Field(
        None,
        ge=0,
        description="eval sampler's Gumbel tau_0 (default: rollout's); fix it to compare runs "
        "trained with different rollout samplers on the same evaluation",
    )
    sampler: Literal["showo", "ancestral"] | None = Field(
        None, description="eval sampler (default: rollout.sampler)"
    )
    metrics: list[MetricSpec] = Field(
        default_factory=list,
        description="metrics `maskgrpo eval` computes besides the training reward: a list of "
        "{kind: clip_score|imagereward|pickscore|fid, weights: local path, ...} "
        "(docs/evaluation.md)",
    )
    prompts_per_unit: int = Field(
        8,
        ge=1,
        description="prompts per evaluation work unit; a unit's seed depends on its index only, "
        "so the images are the same whatever the number of rollout actors",
    )


class DataConfig(_Strict):
    """Prompts for training and evaluation."""

    prompts: str = Field(
        "toy", description="'toy' (built-in grammar) or a .txt/.json/.jsonl/.parquet file"
    )
    eval_prompts: str | None = Field(None, description="eval prompts file (default: data.prompts)")
    prompt_column: str | None = Field(
        None,
        description="the column (Parquet) or key (JSON, JSONL) that holds the prompt text "
        "(default: 'prompt', else 'caption')",
    )
    shuffle: bool = Field(True, description="shuffle the training prompts each epoch (seeded)")


class LoggingConfig(_Strict):
    """Run outputs besides metrics.jsonl."""

    sample_grid_every_steps: int = Field(
        20, ge=0, description="driver steps between saved sample grids (and the last); 0: never"
    )
    progress_bar: bool = Field(True, description="show a tqdm progress bar")


class RunConfig(_Strict):
    """Backend and bookkeeping: cluster, seed, run folder, checkpoints."""

    backend: Literal["ray", "local"] = Field("ray", description="'local' = single-process baseline")
    seed: int = Field(0, description="seed of prompts, sampling and the update")
    run_dir: str | None = Field(
        None, description="run folder; default: runs/{run.name}-{timestamp}"
    )
    name: str = Field("toy", description="run name (run folder prefix, Ray control actor name)")
    ray_address: str | None = Field(None, description="None: RAY_ADDRESS or a new local cluster")
    num_cpus: int | None = Field(None, ge=1, description="CPUs of a new local Ray cluster")
    export_final_policy: bool = Field(
        True,
        description="write RUN_DIR/final_policy.safetensors (the trained tensors) when the run "
        "finishes: what `maskgrpo eval --weights RUN_DIR` evaluates",
    )
    checkpoint_every_steps: int = Field(
        0, ge=0, description="driver steps between checkpoints; 0: none"
    )
    keep_checkpoints: int = Field(
        2,
        ge=1,
        description="most recent checkpoints kept; 2 or more lets a resume skip a corrupt one",
    )
    storage: str | None = Field(
        None,
        description=(
            "where checkpoints go, one location per run that the driver reaches: a local/NFS path "
            "or an fsspec URL such as s3://bucket/prefix/run (credentials and endpoint from the "
            "standard environment, e.g. AWS_ACCESS_KEY_ID, AWS_ENDPOINT_URL); a run started "
            "with a location that holds checkpoints resumes from them; None: {run_dir}/checkpoints"
        ),
    )
    storage_options: dict[str, str | int | float | bool] = Field(
        default_factory=dict,
        description=(
            "extra options of run.storage's fsspec filesystem, e.g. {endpoint_url: ..., "
            "requester_pays: true} for S3; no credentials (this config is saved in the run folder)"
        ),
    )
    max_learner_restarts: int = Field(
        2,
        ge=0,
        description=(
            "a lost learner rank (dead or hung) makes the run restore a new learner group and "
            "itself from the newest checkpoint, in the same job, this many times per run; past "
            "it, or with no checkpoint, the run exits non-zero naming the checkpoint"
        ),
    )
    preemption_grace_seconds: float = Field(
        60.0,
        gt=0,
        description=(
            "on SIGTERM/SIGINT the driver finishes the current step (abandons it if the grace "
            "would run out), writes a checkpoint and exits 0 within this many seconds; give "
            "Kubernetes terminationGracePeriodSeconds and RAY_JOB_STOP_WAIT_TIME_S more"
        ),
    )

    @model_validator(mode="after")
    def _storage(self) -> RunConfig:
        if self.storage is not None and "://" in self.storage:
            import fsspec

            protocol = self.storage.split("://", 1)[0]
            if protocol not in fsspec.available_protocols():
                raise ValueError(
                    f"run.storage={self.storage!r}: fsspec knows no protocol {protocol!r}; use a "
                    "path or a URL such as s3://bucket/prefix (see fsspec.available_protocols())"
                )
        secret = sorted(k for k in self.storage_options if k.lower() in _SECRET_OPTIONS)
        if secret:
            raise ValueError(
                f"run.storage_options has {secret}: credentials do not belong in the config (it "
                "is saved as config.yaml in the run folder); set them in the environment "
                "(AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN or AWS_PROFILE)"
            )
        return self


_SECRET_OPTIONS = {"key", "secret", "token", "password", "session_token", "access_key"}


class Config(_Strict):
    """The whole run: one section per role."""

    run: RunConfig = Field(RunConfig(), description="backend and bookkeeping")
    model: ModelConfig = Field(
        default_factory=ModelConfig, description="the policy"
    )  # a factory: validating a kind imports its module, which imports this one
    data: DataConfig = Field(DataConfig(), description="prompts")
    rollout: RolloutConfig = Field(RolloutConfig(), description="sampling")
    likelihood: LikelihoodConfig = Field(
        LikelihoodConfig(), description="the likelihood estimator of the objective"
    )
    reward: RewardConfig = Field(RewardConfig(), description="scoring")
    filter: FilterConfig = Field(FilterConfig(), description="sample filtering")
    train: TrainConfig = Field(TrainConfig(), description="the update")
    learner: LearnerConfig = Field(LearnerConfig(), description="the learner group (DeepSpeed)")
    eval: EvalConfig = Field(EvalConfig(), description="held-out evaluation")
    logging: LoggingConfig = Field(LoggingConfig(), description="outputs")

    @model_validator(mode="after")
    def _weight_sync(self) -> Config:
        lc, ro = self.learner, self.rollout
        if lc.weight_sync != "collective":
            return self
        if lc.zero_stage == 3:
            raise ValueError(
                "learner.weight_sync='collective' with learner.zero_stage=3: rank 0 alone does "
                "not hold the whole parameters under ZeRO-3; use weight_sync 'object_store' or "
                "'auto', or zero_stage 0-2"
            )
        if (lc.num_gpus_per_worker > 0) != (ro.num_gpus_per_actor > 0):
            raise ValueError(
                f"learner.weight_sync='collective' with learner.num_gpus_per_worker="
                f"{lc.num_gpus_per_worker} and rollout.num_gpus_per_actor="
                f"{ro.num_gpus_per_actor}: one group must be all GPU (NCCL) or all CPU (gloo); "
                "give both GPUs or neither, or use weight_sync 'object_store'"
            )
        return self

    @model_validator(mode="after")
    def _cross(self) -> Config:
        steps = self.rollout.unmasking_steps
        t = self.train
        if t.unmasking_step_selection != "all" and not 1 <= t.unmasking_steps_trained <= steps:
            raise ValueError(
                f"train.unmasking_steps_trained={t.unmasking_steps_trained} with "
                f"train.unmasking_step_selection={t.unmasking_step_selection!r}: it must be in "
                f"[1, rollout.unmasking_steps={steps}] (how many unmasking steps to train); set "
                "it, or use unmasking_step_selection 'all'"
            )
        est, fwd = self.likelihood.estimator, self.likelihood.forward
        if est == "forward" and t.unmasking_step_selection != "all":
            raise ValueError(
                f"train.unmasking_step_selection={t.unmasking_step_selection!r} with "
                "likelihood.estimator='forward': the forward estimator trains on mask draws, "
                "not unmasking steps; set unmasking_step_selection 'all' and choose the work per "
                "sample with likelihood.forward.mask_draws"
            )
        if est == "forward" and fwd.mask_ratios == "step_focus" and fwd.mask_draws > steps:
            raise ValueError(
                f"likelihood.forward.mask_draws={fwd.mask_draws} with mask_ratios 'step_focus': "
                f"it picks that many of the rollout.unmasking_steps={steps} steps; lower "
                "mask_draws or raise unmasking_steps"
            )
        one = est == "forward" and fwd.draws_per_update == "one"
        if one and t.updates_per_batch < fwd.mask_draws:
            raise ValueError(
                f"likelihood.forward.draws_per_update='one' with train.updates_per_batch="
                f"{t.updates_per_batch} < mask_draws={fwd.mask_draws}: inner update i scores "
                "draw i mod K, so some draws would never be trained; raise updates_per_batch "
                "to a multiple of mask_draws or lower mask_draws"
            )
        ro = self.rollout
        if est == "trajectory" and ro.sampler == "ancestral" and ro.transition != "p2":
            raise ValueError(
                f"rollout.sampler='ancestral' with rollout.transition={ro.transition!r}: the "
                "ancestral sampler commits positions independently of the policy, so only p2 "
                "(Eq. 15) is its exact transition log-prob; set rollout.transition p2, or "
                "likelihood.estimator forward"
            )
        check = entry_for(self.model).check
        if check is not None:
            check(self)  # the model kind's own cross-field rules
        return self


class ConfigError(ValueError):
    """A config that cannot run; the message names the field, the value and the fix."""


_DRIVER_STEPS = "'steps' alone now means driver steps"
RENAMED_FIELDS: dict[str, tuple[str, str]] = {
    # old dotted key: (new dotted key, why)
    "train.warmup_steps": ("train.warmup_updates", f"it counts optimizer updates; {_DRIVER_STEPS}"),
    "rollout.num_steps": ("rollout.unmasking_steps", _DRIVER_STEPS),
    "eval.num_steps": ("eval.unmasking_steps", _DRIVER_STEPS),
    "train.step_selection": ("train.unmasking_step_selection", _DRIVER_STEPS),
    "train.steps_trained": ("train.unmasking_steps_trained", _DRIVER_STEPS),
    "train.micro_batch_samples_per_gpu": (
        "train.micro_batch_pairs_per_gpu",
        "it counts (sample, unmasking step) pairs, not samples",
    ),
}
"""Config keys that were renamed: old dotted key -> (new dotted key, reason). Old keys fail."""


def _renamed_keys(tree: dict[str, Any]) -> list[str]:
    """One message per renamed key present in the raw ``tree``: the old key, the new, the why."""
    found = []
    for old, (new, why) in RENAMED_FIELDS.items():
        node: Any = tree
        *sections, leaf = old.split(".")
        for key in sections:
            node = node.get(key) if isinstance(node, dict) else None
        if isinstance(node, dict) and leaf in node:
            found.append(f"  {old} was renamed {new}: {why}; rename the key in your YAML or --set")
    return found


def _set_path(tree: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for k in keys[:-1]:
        if not isinstance(node.setdefault(k, {}), dict):
            raise ConfigError(f"--set {dotted}: {k!r} is not a section")
        node = node[k]
    node[keys[-1]] = value


def parse_overrides(items: list[str]) -> list[tuple[str, Any]]:
    """``["a.b=1", "c=x"]`` -> ``[("a.b", 1), ("c", "x")]`` with YAML scalar parsing (no eval)."""
    out = []
    for item in items:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected key.path=value, e.g. train.steps=20")
        key, raw = item.split("=", 1)
        out.append((key.strip(), yaml.safe_load(raw)))
    return out


def _format_errors(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"]) or "(config)"
        value = e.get("input")
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown key; check the spelling against configs/toy.yaml or docs/config.md"
        shown = "" if isinstance(value, dict) else f" = {value!r}"
        lines.append(f"  {loc}{shown}: {msg}")
    return "invalid config:\n" + "\n".join(lines)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Read YAML (``safe_load``), apply ``--set`` overrides, validate. Raises ConfigError."""
    tree: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.exists():
            raise ConfigError(f"--config {p}: no such file")
        loaded = yaml.safe_load(p.read_text()) or {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"--config {p}: the top level must be a mapping of sections")
        tree = loaded
    for key, value in parse_overrides(overrides or []):
        _set_path(tree, key, value)
    return validate_config(tree)


def validate_config(tree: dict[str, Any]) -> Config:
    """Validate a raw config tree; renamed keys and broken rules raise ConfigError."""
    renamed = _renamed_keys(tree)
    if renamed:
        raise ConfigError("invalid config:\n" + "\n".join(renamed))
    try:
        return Config.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(_format_errors(err)) from None
