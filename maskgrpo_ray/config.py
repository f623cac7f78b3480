"""One config tree, loaded from YAML, validated before any actor starts.

Units are in the names (``prompts_per_step``, ``samples_per_prompt``, ``num_cpus_per_actor``).
Unknown keys are errors. Cross-field rules live in validators whose messages say the rule, the
reason and the fix. ``--set a.b.c=value`` overrides are applied to the YAML before validation.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ToyModelConfig(_Strict):
    grid: int = Field(4, ge=2, description="image tokens per side (L = grid**2)")
    cell_px: int = Field(8, ge=1, description="pixels per token side in the palette decoder")
    d_model: int = Field(64, ge=8)
    layers: int = Field(2, ge=1)
    heads: int = Field(4, ge=1)
    pretrain_steps: int = Field(600, ge=0)
    pretrain_batch: int = Field(64, ge=1)
    pretrain_lr: float = Field(1e-3, gt=0)
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
    showo_path: str | None = Field(None, description="local folder or HF cache repo id of Show-o")
    magvit_path: str | None = Field(
        None, description="local folder or HF cache repo id of MAGVIT-v2"
    )
    tokenizer_path: str | None = Field(None, description="local folder of the Phi-1.5 tokenizer")
    tiny_random: bool = Field(False, description="build a tiny random Show-o (tests, CPU demo)")
    resolution_px: Literal[256, 512] = 256
    max_text_tokens: int = Field(128, ge=1)
    dtype: Literal["float32", "bfloat16"] = "float32"


class ModelConfig(_Strict):
    kind: Literal["toy", "showo"] = "toy"
    toy: ToyModelConfig = ToyModelConfig()
    showo: ShowoModelConfig = ShowoModelConfig()


class RolloutConfig(_Strict):
    samples_per_prompt: int = Field(6, description="G, images per prompt (a group)")
    num_steps: int = Field(8, ge=1, description="unmasking steps in training rollouts")
    temperature: float = Field(1.0, gt=0)
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
    num_actors: int = Field(2, ge=1)
    num_cpus_per_actor: float = Field(0.5, ge=0)
    num_gpus_per_actor: float = Field(0.0, ge=0)
    prompts_per_chunk: int = Field(
        0, ge=0, description="prompts per pull-based rollout request; 0: ceil(B / num_actors)"
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


class RewardComponent(_Strict):
    kind: str = Field(description="registered reward kind: toy_rules, clip, imagereward")
    weight: float = 1.0
    args: dict[str, Any] = Field(default_factory=dict)


class RewardConfig(_Strict):
    components: list[RewardComponent] = Field(
        default_factory=lambda: [RewardComponent(kind="toy_rules")]
    )
    num_actors: int = Field(1, ge=1)
    num_cpus_per_actor: float = Field(0.5, ge=0)
    num_gpus_per_actor: float = Field(0.0, ge=0)


class FilterConfig(_Strict):
    enabled: bool = True
    percentile: float = Field(10.0, description="drop groups under this percentile of the history")
    warmup_groups: int = Field(16, ge=0)
    max_history: int = Field(1024, ge=1)
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
    steps: int = Field(120, ge=0)
    prompts_per_step: int = Field(16, ge=1, description="B, prompts (groups) per update")
    learning_rate: float = 1e-3
    warmup_steps: int = Field(
        10, ge=0, description="linear LR warm-up (Adam's first steps are sign-like)"
    )
    weight_decay: float = Field(0.0, ge=0)
    adam_betas: tuple[float, float] = (0.9, 0.99)
    grad_clip_norm: float = Field(1.0, ge=0, description="0 disables clipping")
    clip_low: float = Field(0.2, ge=0, lt=1)
    clip_high: float = Field(0.28, ge=0)
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
    advantage_eps: float = Field(1e-4, gt=0)
    step_selection: Literal["all", "first", "last", "random"] = "all"
    steps_trained: int = Field(0, ge=0, description="k for first/last/random step selection")
    micro_batch_samples_per_gpu: int = Field(
        256, ge=1, description="(sample, step) pairs per forward"
    )
    updates_per_batch: int = Field(1, ge=1, description="optimizer passes over each batch")

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
    num_workers: int = Field(1, ge=1, description="learner ranks (torch.distributed world size)")
    zero_stage: Literal[0, 1, 2, 3] = 0
    bf16: bool = False
    num_cpus_per_worker: float = Field(0.5, ge=0)
    num_gpus_per_worker: float = Field(0.0, ge=0)
    torch_threads_per_worker: int = Field(
        0,
        ge=0,
        description="torch threads per rank; 0: on CPU the node's cores / num_workers, on GPU Ray's",
    )


class EvalConfig(_Strict):
    every_steps: int = Field(0, ge=0, description="0: evaluate only before and after training")
    samples_per_prompt: int = Field(32, ge=1)
    num_steps: int | None = Field(
        None, ge=1, description="eval unmasking steps (default: rollout's)"
    )
    guidance_scale: float | None = Field(None, ge=0)
    gumbel_temperature: float | None = Field(
        None,
        ge=0,
        description="eval sampler's Gumbel tau_0 (default: rollout's); fix it to compare runs "
        "trained with different rollout samplers on the same evaluation",
    )


class DataConfig(_Strict):
    prompts: str = Field("toy", description="'toy' (built-in grammar) or a .txt/.json/.jsonl file")
    eval_prompts: str | None = None
    shuffle: bool = True


class LoggingConfig(_Strict):
    sample_grid_every_steps: int = Field(20, ge=0)
    progress_bar: bool = True


class RunConfig(_Strict):
    backend: Literal["ray", "local"] = Field("ray", description="'local' = single-process baseline")
    seed: int = 0
    run_dir: str | None = Field(None, description="default: runs/<name>-<timestamp>")
    name: str = "toy"
    ray_address: str | None = Field(None, description="None: RAY_ADDRESS or a new local cluster")
    num_cpus: int | None = Field(None, ge=1, description="CPUs of a new local Ray cluster")
    checkpoint_every_steps: int = Field(0, ge=0)
    keep_checkpoints: int = Field(2, ge=1)


class Config(_Strict):
    run: RunConfig = RunConfig()
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    rollout: RolloutConfig = RolloutConfig()
    reward: RewardConfig = RewardConfig()
    filter: FilterConfig = FilterConfig()
    train: TrainConfig = TrainConfig()
    learner: LearnerConfig = LearnerConfig()
    eval: EvalConfig = EvalConfig()
    logging: LoggingConfig = LoggingConfig()

    @model_validator(mode="after")
    def _cross(self) -> Config:
        steps = self.rollout.num_steps
        if self.train.step_selection != "all" and not 1 <= self.train.steps_trained <= steps:
            raise ValueError(
                f"train.steps_trained={self.train.steps_trained} with train.step_selection="
                f"{self.train.step_selection!r}: it must be in [1, rollout.num_steps={steps}] "
                "(how many unmasking steps to train); set it, or use step_selection 'all'"
            )
        if self.model.kind == "toy" and steps > self.model.toy.grid**2:
            raise ValueError(
                f"rollout.num_steps={steps} exceeds the toy image's {self.model.toy.grid**2} "
                "tokens: every step must commit at least one token; lower rollout.num_steps"
            )
        if self.model.kind == "showo" and not (
            self.model.showo.tiny_random or self.model.showo.showo_path
        ):
            raise ValueError(
                "model.kind='showo' needs model.showo.showo_path (a local folder or HF cache id) "
                "or model.showo.tiny_random=true"
            )
        return self


class ConfigError(ValueError):
    """A config that cannot run; the message names the field, the value and the fix."""


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
    try:
        return Config.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(_format_errors(err)) from None
