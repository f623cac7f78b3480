"""The policy's config sections: which masked image model (``model``), how it samples
(``rollout``) and which likelihood the objective's ratio uses (``likelihood``).

Part of the one config tree (:mod:`maskgrpo_ray.config`, the import point); plain pydantic, no
torch. A model kind's own settings are looked up where the kinds register them
(:mod:`maskgrpo_ray.config.kinds`) when a config is validated, not when this module loads.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from maskgrpo_ray.config.base import Strict
from maskgrpo_ray.config.kinds import rules_for


class ToyModelConfig(Strict):
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


class ShapesModelConfig(Strict):
    """The GenEval-shaped world (docs/shapes_world.md): its canvas and tokenizer, the base
    policy's size and pre-training, and the reward model's (all pre-trained once, cached)."""

    grid: int = Field(8, ge=4, description="image tokens per side (L = grid * grid)")
    patch_px: int = Field(
        4, ge=3, description="pixels per token side (the canvas is grid * patch_px)"
    )
    max_codes: int = Field(
        512, ge=16, description="the tokenizer's codebook size limit (k-means over the patches)"
    )
    codebook_renders: int = Field(
        20000, ge=100, description="random renders the tokenizer's codebook is learned from"
    )
    d_model: int = Field(128, ge=8, description="policy transformer width (divisible by heads)")
    layers: int = Field(4, ge=1, description="policy transformer blocks")
    heads: int = Field(4, ge=1, description="attention heads per block")
    ff_mult: int = Field(3, ge=1, description="feed-forward width in units of d_model")
    pretrain_steps: int = Field(3000, ge=0, description="pre-training updates of the base policy")
    pretrain_batch: int = Field(64, ge=1, description="renders per pre-training update")
    pretrain_lr: float = Field(2e-3, gt=0, description="pre-training peak learning rate")
    noise_prob: float = Field(
        0.0, ge=0, le=1, description="share of pre-training captions that describe a near miss"
    )
    reward_dim: int = Field(128, ge=8, description="the reward model's embedding size")
    reward_width: int = Field(64, ge=8, description="the reward model's tower width")
    reward_steps: int = Field(3000, ge=0, description="the reward model's training updates")
    reward_batch: int = Field(96, ge=8, description="distinct prompts per reward-model update")
    reward_lr: float = Field(2e-3, gt=0, description="the reward model's peak learning rate")
    reward_clutter: float = Field(
        0.5,
        ge=0,
        le=1,
        description="share of the reward model's training pairs given stray pieces on both sides",
    )
    seed: int = Field(0, description="seed of the world's pre-training (tokenizer, base, reward)")

    @model_validator(mode="after")
    def _heads_divide(self) -> ShapesModelConfig:
        if self.d_model % self.heads:
            raise ValueError(
                f"model.shapes.d_model={self.d_model} is not divisible by model.shapes.heads="
                f"{self.heads}: attention splits d_model evenly across heads; change one of them"
            )
        return self


class ShowoModelConfig(Strict):
    """Show-o (Phi-1.5 transformer + MAGVIT-v2 tokenizer), from local folders or the HF cache."""

    showo_path: str | None = Field(
        None,
        description="Show-o: local folder, HF cache repo id, or hub id hf://org/name[@revision]",
    )
    magvit_path: str | None = Field(
        None,
        description="MAGVIT-v2: local folder, HF cache repo id, or hub id hf://org/name[@revision]",
    )
    tokenizer_path: str | None = Field(
        None, description="Phi-1.5 tokenizer: local folder or hub id hf://org/name[@revision]"
    )
    tiny_random: bool = Field(False, description="build a tiny random Show-o (tests, CPU demo)")
    resolution_px: Literal[256, 512] = Field(256, description="image side in pixels")
    max_text_tokens: int = Field(128, ge=1, description="prompt length in text tokens (padded)")
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="dtype of the Show-o transformer's weights"
    )


class LoraConfig(Strict):
    """A LoRA adapter (peft) trained instead of the model's weights: the base stays frozen, the
    optimizer and the weight sync hold the adapter only, the KL reference is the base with the
    adapter disabled (docs/models.md, "LoRA")."""

    rank: int = Field(8, ge=1, description="r, the adapter's rank")
    alpha: float = Field(16.0, gt=0, description="lora_alpha: the update is scaled alpha / rank")
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear",
        description=(
            "names (or name suffixes) of the linear layers that get an adapter, as peft's "
            "LoraConfig.target_modules; 'all-linear': every linear layer"
        ),
    )
    dropout: float = Field(0.0, ge=0, lt=1, description="lora_dropout (training passes only)")
    init_seed: int = Field(
        0, description="seed of the adapter's A matrices (B starts at zero): every process the same"
    )
    save_merged: bool = Field(
        False,
        description=(
            "also write RUN_DIR/final_policy_merged.safetensors: the base with the adapter "
            "merged in (a full-size file)"
        ),
    )

    @model_validator(mode="after")
    def _targets(self) -> LoraConfig:
        if isinstance(self.target_modules, list) and not self.target_modules:
            raise ValueError(
                "model.lora.target_modules=[]: no layer would get an adapter; name the linear "
                "layers (e.g. [qkv, proj]) or use 'all-linear'"
            )
        return self


class ModelConfig(Strict):
    """The policy: which registered masked image model, and its own settings."""

    kind: str = Field(
        "toy",
        description=(
            "registered model kind: 'toy', 'shapes', 'showo', 'amused', 'sim', or one "
            "registered by model.plugins"
        ),
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
    shapes: ShapesModelConfig = Field(
        ShapesModelConfig(), description="settings of the GenEval-shaped world (kind 'shapes')"
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
    lora: LoraConfig | None = Field(
        None,
        description=(
            "train a LoRA adapter (peft) instead of the weights: {rank, alpha, target_modules, "
            "dropout}; null: full fine-tuning"
        ),
    )

    @model_validator(mode="after")
    def _registered(self) -> ModelConfig:
        section = rules_for(self.kind, self.plugins).section  # imports them; unknown kinds fail
        own = {f.annotation for f in type(self).model_fields.values()}
        if section is not None and section not in own:
            section.model_validate(self.args)  # a plugin kind's settings live in model.args
        return self


class RolloutConfig(Strict):
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
    custom_resources: dict[str, float] = Field(
        default_factory=dict,
        description="custom Ray resources each rollout actor asks for besides CPUs and GPUs, e.g. "
        "{rollout_node: 0.01}: it is then placed only on nodes that advertise them (ray_cluster.yaml's "
        "rollout_gpu node type does); empty: any node",
    )
    prompts_per_chunk: int = Field(
        0, ge=0, description="prompts per pull-based rollout request; 0: ceil(B / num_actors)"
    )
    max_policy_lag: int = Field(
        0,
        ge=0,
        le=2,
        description=(
            "asynchronous rollouts: 1 generates step k+1's rollouts with the weights before step "
            "k's update (one policy version behind; the cached old log-probs are the behaviour "
            "policy's, so the ratio is against them), except across a checkpoint: on Ray while "
            "the learner trains, on the local backend at once (the reference of the Ray run); "
            "2: up to two steps ahead and the rollouts never wait for a weight sync (each chunk "
            "records the version it used, at most 2 behind; not reproducible bit for bit on "
            "Ray); 0: the synchronous loop"
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


class ForwardEstimatorConfig(Strict):
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
            "counts of the K critical steps of the sample's group (MaskFocus-style, the same "
            "steps train.unmasking_step_selection critical trains)"
        ),
    )
    reduction: Literal["mean", "sum"] = Field(
        "mean",
        description=(
            "log-prob of a draw: 'mean' or 'sum' over its masked tokens ('sum' moves the ratio "
            "out of the clip band far sooner at hundreds of tokens)"
        ),
    )
    coupling: Literal["none", "complementary"] = Field(
        "none",
        description=(
            "'complementary' (coupled-GRPO, arXiv 2506.20639): draws come in pairs, the second "
            "masking exactly the positions the first leaves, so every token is scored once per "
            "pair (mask_draws even; the K/2 pairs' ratios follow mask_ratios, each clamped to "
            "leave both masks non-empty)"
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
    def _coupled(self) -> ForwardEstimatorConfig:
        if self.coupling == "complementary" and (
            self.mask_draws % 2 or self.mask_ratios == "step_focus"
        ):
            raise ValueError(
                f"likelihood.forward.coupling='complementary' with mask_draws={self.mask_draws} "
                f"and mask_ratios={self.mask_ratios!r}: the draws come in complementary pairs, "
                "so mask_draws must be even and mask_ratios stratified or uniform"
            )
        return self

    @model_validator(mode="after")
    def _range(self) -> ForwardEstimatorConfig:
        if self.mask_ratio_min > self.mask_ratio_max:
            raise ValueError(
                f"likelihood.forward.mask_ratio_min={self.mask_ratio_min} exceeds "
                f"mask_ratio_max={self.mask_ratio_max}: masks cover a share of the tokens in "
                "[min, max]; swap them or make them equal"
            )
        return self


class LikelihoodConfig(Strict):
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
