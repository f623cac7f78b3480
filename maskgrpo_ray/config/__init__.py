"""One config tree, loaded from YAML, validated before any actor starts.

Units are in the names (``prompts_per_step``, ``samples_per_prompt``, ``num_cpus_per_actor``).
"Step" alone means a driver step (one generate-score-filter-update iteration: ``train.steps``,
``eval.every_steps``); unmasking steps of the sampler are ``unmasking_steps`` and optimizer
updates are ``updates``. Every field has a ``description``; ``docs/config.md`` is rendered from
them (:mod:`maskgrpo_ray.config.docs`). Unknown keys are errors, and renamed keys
(:data:`RENAMED_FIELDS`) are errors that name the new key. Cross-field rules live in validators
whose messages say the rule, the reason and the fix. ``--set a.b.c=value`` overrides are applied
to the YAML before validation.

This module is the import point: the whole tree (:class:`Config`), its cross-section rules, and
loading. The sections live by role in :mod:`maskgrpo_ray.config.policy` (``model``, ``rollout``,
``likelihood``), :mod:`maskgrpo_ray.config.training` (``reward``, ``filter``, ``train``),
:mod:`maskgrpo_ray.config.learner` (``learner``) and :mod:`maskgrpo_ray.config.run` (``run``, ``data``, ``eval``, ``logging``), with
:mod:`maskgrpo_ray.config.evidence` (``evidence``) and :mod:`maskgrpo_ray.config.refresh`
(``reward.refresh``), and are re-exported here. Importing it loads
no torch and no model: a model kind's module is imported when a config naming it is validated
(:mod:`maskgrpo_ray.config.kinds`: the kinds register their own rules there).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, ValidationError, model_validator

from maskgrpo_ray.config import builtin
from maskgrpo_ray.config.base import Strict
from maskgrpo_ray.config.evidence import EvidenceConfig
from maskgrpo_ray.config.kinds import rules_for
from maskgrpo_ray.config.learner import LearnerConfig
from maskgrpo_ray.config.policy import (
    ForwardEstimatorConfig,
    LikelihoodConfig,
    LoraConfig,
    ModelConfig,
    RolloutConfig,
    ShapesModelConfig,
    ShowoModelConfig,
    ToyModelConfig,
)
from maskgrpo_ray.config.refresh import RewardRefreshConfig, refresh_rules
from maskgrpo_ray.config.run import DataConfig, EvalConfig, LoggingConfig, RunConfig
from maskgrpo_ray.config.training import (
    DiversityConfig,
    EnsembleConfig,
    FilterConfig,
    RewardComponent,
    RewardConfig,
    TrainConfig,
)
from maskgrpo_ray.errors import UserError, read_utf8
from maskgrpo_ray.runlog.probe_alarms import EVAL_ALARMS, PROBE_ALARMS

__all__ = [
    "RENAMED_FIELDS",
    "Config",
    "ConfigError",
    "DataConfig",
    "DiversityConfig",
    "EvalConfig",
    "EvidenceConfig",
    "FilterConfig",
    "ForwardEstimatorConfig",
    "LearnerConfig",
    "LikelihoodConfig",
    "LoggingConfig",
    "LoraConfig",
    "ModelConfig",
    "EnsembleConfig",
    "RewardComponent",
    "RewardConfig",
    "RewardRefreshConfig",
    "RolloutConfig",
    "RunConfig",
    "ShowoModelConfig",
    "ShapesModelConfig",
    "ToyModelConfig",
    "TrainConfig",
    "load_config",
    "parse_overrides",
    "validate_config",
]


class Config(Strict):
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
    evidence: EvidenceConfig = Field(
        EvidenceConfig(), description="what the recipe is known to keep (maskgrpo plan prints it)"
    )

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
        shares = {"learner.num_gpus_per_worker": lc.num_gpus_per_worker}
        shares["rollout.num_gpus_per_actor"] = ro.num_gpus_per_actor
        for name, share in shares.items():
            if 0 < share < 1:
                raise ValueError(
                    f"learner.weight_sync='collective' with {name}={share}: Ray packs "
                    "fractional GPU shares onto one GPU, and NCCL refuses two members of a "
                    "group on one device ('Duplicate GPU detected'); give whole GPUs (>= 1) to "
                    "the learner ranks and the rollout actors, or use weight_sync "
                    "'object_store' or 'auto' (which keeps the object store for fractional "
                    "shares)"
                )
        return self

    @model_validator(mode="after")
    def _step_signal(self) -> Config:
        t, est = self.train, self.likelihood.estimator
        if t.unmasking_step_selection == "auto" and t.step_signal_every_steps == 0:
            raise ValueError(
                "train.unmasking_step_selection='auto' with train.step_signal_every_steps=0: "
                "auto trains the steps the step-signal probe measures, and the probe is off; "
                "set train.step_signal_every_steps (e.g. 20), or choose another selection"
            )
        if t.step_signal_every_steps and est != "trajectory":
            raise ValueError(
                f"train.step_signal_every_steps={t.step_signal_every_steps} with "
                f"likelihood.estimator={est!r}: the probe measures unmasking steps' gradients, "
                "which only the trajectory estimator trains; set it to 0 or use the trajectory "
                "estimator"
            )
        if t.step_signal_every_steps and self.learner.zero_stage >= 2:
            raise ValueError(
                f"train.step_signal_every_steps={t.step_signal_every_steps} with "
                f"learner.zero_stage={self.learner.zero_stage}: the probe's gradients are taken "
                "outside the DeepSpeed engine, which ZeRO-2/3 reduce or partition inside every "
                "backward; use learner.zero_stage 0 or 1, or set step_signal_every_steps 0"
            )
        return self

    @model_validator(mode="after")
    def _shrinkage(self) -> Config:
        s, est = self.train.trajectory_shrinkage, self.likelihood.estimator
        if s > 1 and (est != "trajectory" or s > self.rollout.unmasking_steps):
            raise ValueError(
                f"train.trajectory_shrinkage={s}: it scores blocks of that many unmasking steps "
                "of the trajectory estimator in one forward pass, so it needs "
                f"likelihood.estimator trajectory (got {est!r}) and at most "
                f"rollout.unmasking_steps={self.rollout.unmasking_steps}; set it to 1 or lower it"
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
        if t.anchor_unmasking_steps and (est != "trajectory" or t.anchor_unmasking_steps > steps):
            raise ValueError(
                f"train.anchor_unmasking_steps={t.anchor_unmasking_steps}: anchoring holds the "
                f"first unmasking steps of the trajectory estimator, so it needs "
                f"likelihood.estimator trajectory (got {est!r}) and at most "
                f"rollout.unmasking_steps={steps} steps; lower it or set it to 0"
            )
        _gdpo_rules(self)
        _lever_rules(self)
        ro = self.rollout
        if est == "trajectory" and ro.sampler == "ancestral" and ro.transition != "p2":
            raise ValueError(
                f"rollout.sampler='ancestral' with rollout.transition={ro.transition!r}: the "
                "ancestral sampler commits positions independently of the policy, so only p2 "
                "(Eq. 15) is its exact transition log-prob; set rollout.transition p2, or "
                "likelihood.estimator forward"
            )
        check = rules_for(self.model.kind, self.model.plugins).check
        if check is not None:
            check(self)  # the model kind's own cross-field rules
        return self


def _gdpo_rules(cfg: Config) -> None:
    """``train.advantage: gdpo`` needs two or more reward components and no ensemble."""
    t = cfg.train
    if t.advantage == "gdpo" and cfg.reward.ensemble is not None:
        raise ValueError(
            "train.advantage='gdpo' with a reward.ensemble: GDPO normalises each weighted "
            "component, and the ensemble's members have weight 0 (its term is no "
            "component); use advantage 'grpo' with the ensemble, or drop the ensemble"
        )
    if t.advantage == "gdpo" and len(cfg.reward.components) < 2:
        raise ValueError(
            f"train.advantage='gdpo' with {len(cfg.reward.components)} reward component: "
            "GDPO normalises each component within its group before summing, which needs "
            "two or more reward.components; use advantage 'grpo', or add a component"
        )


def _lever_rules(cfg: Config) -> None:
    """Lever combinations that cannot work (issue 53): a KL to a base that was never trained,
    an EMA of ZeRO-3 partitions, an alarm that stops the run with no monitor or probe to trip
    it."""
    t, m = cfg.train, cfg.model
    steps = {"toy": m.toy.pretrain_steps, "shapes": m.shapes.pretrain_steps}.get(m.kind)
    if (t.kl_coef > 0 or t.anchor_kl_coef > 0) and steps == 0:
        raise ValueError(
            f"train.kl_coef={t.kl_coef} (anchor_kl_coef={t.anchor_kl_coef}) with "
            f"model.{m.kind}.pretrain_steps=0: the base is untrained random weights, so the KL "
            "holds the policy to noise; pre-train the base (pretrain_steps > 0) or set the KL "
            "coefficients to 0"
        )
    if t.ema_decay > 0 and cfg.learner.zero_stage == 3:
        raise ValueError(
            f"train.ema_decay={t.ema_decay} with learner.zero_stage=3: the EMA is kept of whole "
            "parameters, which ZeRO-3 partitions over the ranks (never gathered for it); use "
            "learner.zero_stage 0-2, or set train.ema_decay 0"
        )
    refresh_rules(cfg)  # reward.refresh: a component of the reward, the local backend
    mon = cfg.logging.monitors
    probing = mon.enabled and mon.probe_prompts > 0 and mon.probe_every_steps > 0
    for name in mon.stop_on:
        needs_probe = name in PROBE_ALARMS or name == "probe_hacking"
        if not mon.enabled or (needs_probe and not probing):
            raise ValueError(
                f"logging.monitors.stop_on names {name!r}, which cannot trip: the monitors "
                f"are off (enabled={mon.enabled}) or it needs the probe (probe_prompts="
                f"{mon.probe_prompts}, probe_every_steps={mon.probe_every_steps}); turn them "
                "on or drop it from stop_on"
            )
        evaluating = 0 < cfg.eval.every_steps < cfg.train.steps
        if name in EVAL_ALARMS and not (evaluating and mon.eval_diversity_share > 0):
            raise ValueError(
                f"logging.monitors.stop_on names {name!r}, which cannot trip without an in-run "
                f"evaluation (eval.every_steps={cfg.eval.every_steps} with train.steps="
                f"{cfg.train.steps}) and a rule (logging.monitors.eval_diversity_share="
                f"{mon.eval_diversity_share}); set eval.every_steps below train.steps and the "
                "share above 0, or drop it from stop_on"
            )
        if name == "kl_excess" and not mon.probe_kl:
            raise ValueError(
                "logging.monitors.stop_on names 'kl_excess', which cannot trip with "
                "logging.monitors.probe_kl=false (no KL to the base is measured); set probe_kl "
                "true or drop it from stop_on"
            )


class ConfigError(UserError, ValueError):
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
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError:
            raise ConfigError(
                f"--set {item!r}: the value {raw!r} is not a YAML scalar, list or mapping; "
                "quote it, e.g. --set 'run.name=\"my run\"'"
            ) from None
        out.append((key.strip(), value))
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


def read_yaml(p: Path) -> Any:
    """A YAML file's content (``safe_load``); ConfigError naming the file, the line and the fix
    when it is missing, a folder, unreadable, not UTF-8 or not YAML."""
    if not p.exists():
        raise ConfigError(f"--config {p}: no such file; check the path")
    if p.is_dir():
        raise ConfigError(f"--config {p}: a folder; give the YAML file (e.g. configs/toy.yaml)")
    text = read_utf8(p, ConfigError, "--config ")
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(
            f"--config {p}:{where}: not valid YAML ({problem}); fix the file there"
        ) from None


def load_config(
    path: str | Path | Mapping[str, Any] | None = None, overrides: list[str] | None = None
) -> Config:
    """Read YAML (``safe_load``), apply ``--set`` overrides, validate. Raises ConfigError.

    ``path``: a YAML file, a built-in config's name (``toy``: :mod:`maskgrpo_ray.config.builtin`),
    a config tree (a mapping, copied; what it leaves out takes the models' defaults), or None
    (the embedded default: the built-in ``toy`` config)."""
    tree: dict[str, Any] = {}
    if path is None:
        path = builtin.path_of("toy")
    if isinstance(path, Mapping):
        tree = copy.deepcopy(dict(path))
    elif path is not None:
        try:
            path = builtin.resolve(path)
        except builtin.NoSuchConfig as err:
            raise ConfigError(str(err)) from None
        loaded = read_yaml(Path(path)) or {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"--config {path}: the top level must be a mapping of sections")
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
