"""The run's config sections: backend and bookkeeping (``run``), prompts (``data``), held-out
evaluation (``eval``) and outputs (``logging``).

Part of the one config tree (:mod:`maskgrpo_ray.config`, the import point); plain pydantic, no
torch (``eval.metrics[i]`` is a :class:`~maskgrpo_ray.config.metrics.MetricSpec`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from maskgrpo_ray.config.base import Strict
from maskgrpo_ray.config.metrics import GenEvalJudgeConfig, MetricSpec
from maskgrpo_ray.runlog.probe_alarms import ALL_ALARMS
from maskgrpo_ray.runlog.trackers import TrackerName, check_args, check_installed


class EvalConfig(Strict):
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
    reuse_base_evaluation: bool = Field(
        False,
        description="keep the base model's held-out evaluation and its step-0 monitor probe on "
        "disk ($MASKGRPO_CACHE_DIR/base_eval/) and reuse them in later runs with the same base "
        "weights (hashed), model, data, rollout, reward, evaluation settings and run.seed (the "
        "probe: and the monitors' settings and backend): recipes compared on a seed evaluate "
        "the base once (the evaluation draws from its own seeded generators, so skipping it "
        "changes nothing a run learns); a reuse is logged",
    )
    geneval: GenEvalJudgeConfig | None = Field(
        None,
        description="GenEval's scorer (Mask2Former + CLIP colours + GenEval's rule) for a real "
        "model's evaluation, in the run and in `maskgrpo eval`: with GenEval metadata on the "
        "evaluation prompts, eval_accuracy is GenEval's correctness, per tag and "
        "eval_accuracy/tag_mean (GenEval's overall); {} takes the defaults (docs/evaluation.md)",
    )


class DataConfig(Strict):
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


class MonitorsConfig(Strict):
    """Reward hacking and collapse seen as they start (docs/monitors.md): image statistics of
    the training samples, the agreement of the reward components, the reward against the judge
    (the reward's accuracy: whatever the evaluation uses for it) on the training samples and on
    a fixed probe set, and alarms that log one line when they trip."""

    enabled: bool = Field(
        True,
        description="compute the monitors' figures and alarms each step (monitor/*, agreement/*, "
        "probe/*; image/* are computed beside the reward always) and draw RUN_DIR/monitors.png",
    )
    probe_prompts: int = Field(
        8,
        ge=0,
        description="held-out prompts in the fixed probe set (the first of each GenEval tag in "
        "turn), judged with eval's sampler and seeds every probe_every_steps; 0: no probe",
    )
    probe_every_steps: int = Field(
        10,
        ge=0,
        description="driver steps between probes, taken before the step's update (step 0: the "
        "base model); 0: no probe. Costs probe_prompts * eval.samples_per_prompt images each",
    )
    window_steps: int = Field(
        10, ge=2, description="training steps the reward's and the judge's trends are fitted over"
    )
    probe_window: int = Field(
        3, ge=2, description="probe evaluations the probe's trends are fitted over"
    )
    reward_rise: float = Field(
        0.5,
        description="the hacking rule's reward rise over a window, in units of the run's first "
        "reward_std (the per-sample spread of the reward at its first step)",
    )
    judge_rise: float = Field(
        0.0, description="the hacking rule's judge: a rise over the window at or below this stalls"
    )
    persist_steps: int = Field(
        3, ge=1, description="steps in a row the training hacking rule must hold to trip"
    )
    baseline_steps: int = Field(
        5,
        ge=1,
        description="the image statistics' baseline is their mean over the first this many steps, "
        "compared with their mean over the last this many",
    )
    entropy_drift_bits: float = Field(
        1.0, gt=0, description="colour-entropy drift (bits, of 6) that trips the drift alarm"
    )
    share_drift: float = Field(
        0.2,
        gt=0,
        description="drift of the dark, saturated or edge share (0-1) that trips the drift alarm",
    )
    judge_drop_se: float = Field(
        3.0,
        gt=0,
        description="judge_drop alarm: a probe's judge below the base's probe by more than this "
        "many standard errors (the base's own, from two draws of the step-0 probe)",
    )
    reward_drop_se: float = Field(
        3.0,
        gt=0,
        description="reward_drop alarm: a probe's reward below the base's probe by more than "
        "this many standard errors (GRPO lowering its own reward is a failure)",
    )
    diversity_share: float = Field(
        0.75,
        ge=0,
        le=1,
        description="diversity_loss alarm: a probe's pairwise diversity (eval_diversity/pairwise) "
        "below this share of the base probe's ...",
    )
    diversity_drop_se: float = Field(
        2.0,
        ge=0,
        description="... and below it by more than this many standard errors of the base",
    )
    drift_z: float = Field(
        2.5,
        gt=0,
        description="probe_drift alarm: a probe's image statistic (colour entropy, dark, "
        "saturated, edges; a detector's malformed share) further from the base probe's than "
        "this many spreads of the base's per-prompt values",
    )
    kl_share: float = Field(
        1.75,
        gt=0,
        description="kl_excess alarm: a probe's KL to the base per token (probe/kl) above this "
        "share of the base's own entropy per token (probe/entropy at step 0, in nats): the "
        "policy has moved that share of its base's uncertainty away; needs probe_kl",
    )
    persist_probes: int = Field(
        2,
        ge=1,
        description="probes in a row a probe alarm's rule must hold to trip (2: a one-probe dip "
        "is the probe's own noise more often than not; docs/alarm_calibration.md)",
    )
    eval_diversity_share: float = Field(
        0.8,
        ge=0,
        le=1,
        description="eval_diversity_loss alarm: the in-run evaluation's pairwise diversity "
        "(eval.every_steps; its prompts and seeds) below this share of the base model's "
        "evaluation's; 0: off. 0.8 is about 7 of the diversity's own noise below the base in "
        "the shapes world (docs/alarm_calibration.md)",
    )
    probe_kl: bool = Field(
        True,
        description="log probe/kl, the KL of the policy to its base on the probe's samples "
        "(k1 per token), and probe/entropy, the policy's entropy per token on them (local backend: the KL term's reference, else a frozen copy of the base "
        "kept from the start, one model's memory; Ray: each rollout actor keeps a frozen copy, "
        "one model's memory per actor; a LoRA policy's base is its adapter disabled)",
    )
    stop_on: list[str] = Field(
        default_factory=list,
        description="alarms that stop the run when they trip (a checkpoint, summary.json "
        "'completed': false, 'stopped_by': 'monitor alarm ...'); empty: an alarm only logs",
    )

    @field_validator("stop_on")
    @classmethod
    def _alarm_names(cls, names: list[str]) -> list[str]:
        bad = [n for n in names if n not in ALL_ALARMS]
        if bad:
            raise ValueError(
                f"logging.monitors.stop_on names {bad}: not an alarm; the alarms are {list(ALL_ALARMS)}"
            )
        return names


class LoggingConfig(Strict):
    """Run outputs besides metrics.jsonl."""

    monitors: MonitorsConfig = Field(
        default_factory=MonitorsConfig,
        description="reward-hacking and collapse monitors (docs/monitors.md)",
    )

    diagnostics: bool = Field(
        False,
        description="log why a seed fails, per step (docs/monitors.md, Diagnostics; local "
        "backend): diag/update_over_lr (||delta theta|| / lr) and diag/grad_half_cosine (the "
        "cosine of two half-batches' gradients: two more passes over the batch without an "
        "optimizer step, about the update's compute again; the RNG and the update unchanged)",
    )
    sample_grid_every_steps: int = Field(
        20, ge=0, description="driver steps between saved sample grids (and the last); 0: never"
    )
    progress_bar: bool = Field(True, description="show a tqdm progress bar")
    trackers: list[TrackerName] = Field(
        default_factory=list,
        description="experiment trackers the driver also logs to: step metrics, sample grids, "
        "the config, the summary (docs/operations.md#trackers); each needs its library "
        "(tensorboard, wandb, mlflow-skinny)",
    )
    tracker_args: dict[TrackerName, dict[str, str | int | float | bool]] = Field(
        default_factory=dict,
        description="per-tracker settings: tensorboard {log_dir}, wandb {project, entity, group, "
        "mode, dir}, mlflow {tracking_uri, experiment_name}; defaults write into the run folder",
    )

    @field_validator("trackers")
    @classmethod
    def _installed(cls, names: list[TrackerName]) -> list[TrackerName]:
        check_installed(names)
        return names

    @model_validator(mode="after")
    def _tracker_args(self) -> LoggingConfig:
        check_args(list(self.trackers), self.tracker_args)
        return self


class RunConfig(Strict):
    """Backend and bookkeeping: cluster, seed, run folder, checkpoints."""

    backend: Literal["ray", "local"] = Field("ray", description="'local' = single-process baseline")
    seed: int = Field(0, description="seed of prompts, sampling and the update")
    run_dir: str | None = Field(
        None, description="run folder; default: runs/{run.name}-{timestamp}"
    )
    name: str = Field("toy", description="run name (run folder prefix, Ray control actor name)")
    ray_address: str | None = Field(None, description="None: RAY_ADDRESS or a new local cluster")
    num_cpus: int | None = Field(None, ge=1, description="CPUs of a new local Ray cluster")
    num_gpus: int | None = Field(
        None,
        ge=0,
        description="GPUs of a new local Ray cluster (None: Ray counts them); on a machine "
        "without CUDA they are logical, for model.kind sim (docs/simulation.md)",
    )
    export_final_policy: bool = Field(
        True,
        description="write RUN_DIR/final_policy.safetensors (the trained tensors) when the run "
        "finishes: what `maskgrpo eval --weights RUN_DIR` evaluates",
    )
    checkpoint_every_steps: int = Field(
        100,
        ge=0,
        description="driver steps between checkpoints (or checkpoint_every_minutes, whichever "
        "comes first: a kill loses at most that, on a short run too); 0: none by step count",
    )
    checkpoint_every_minutes: float = Field(
        10.0,
        ge=0,
        description="also checkpoint at the first step boundary this many minutes after the "
        "last checkpoint; with this or checkpoint_every_steps on, a checkpoint of the start "
        "(step 0) is written too, so a lost learner always has one to come back to; 0 and "
        "checkpoint_every_steps 0: no checkpoints but the run's end and a SIGTERM's (a lost "
        "learner then restarts from the rollout actors' weights with fresh optimizer state: "
        "the run goes on, no longer exact); `maskgrpo plan` predicts a checkpoint's cost",
    )
    checkpoint_async: bool = Field(
        False,
        description=(
            "write checkpoints off the step loop's path: the learner's state and the driver's "
            "counters are copied to host memory at the step boundary (the snapshot; on Ray the "
            "ranks' DeepSpeed files into the object store), a background thread writes, hashes "
            "and publishes them while the next steps run; the next checkpoint, a restore, a "
            "SIGTERM's checkpoint and the run's end wait for it. The manifest and `latest` are "
            "written last, so a crash mid-write leaves the previous checkpoint the newest "
            "valid one; a learner rank lost mid-write discards that write and rolls back to "
            "the newest published checkpoint. On in configs/showo_*.yaml. Host memory: up to "
            "two copies of the learner state (bench/checkpoint_cost.py)"
        ),
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
            "it the run exits non-zero naming the checkpoint (with no checkpoint the new group "
            "starts from the rollout actors' weights with fresh optimizer state)"
        ),
    )
    preemption_grace_seconds: float = Field(
        60.0,
        gt=0,
        description=(
            "on SIGTERM/SIGINT the driver finishes the current step (abandons it if the grace "
            "would run out), writes a checkpoint and exits 0 within this many seconds (the "
            "run's actors ignore SIGTERM meanwhile); give Kubernetes "
            "terminationGracePeriodSeconds, RAY_JOB_STOP_WAIT_TIME_S and SLURM's KillWait more"
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
            _check_storage_package(self.storage, protocol)
        secret = sorted(k for k in self.storage_options if k.lower() in _SECRET_OPTIONS)
        if secret:
            raise ValueError(
                f"run.storage_options has {secret}: credentials do not belong in the config (it "
                "is saved as config.yaml in the run folder); set them in the environment "
                "(AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN or AWS_PROFILE)"
            )
        return self


def _check_storage_package(storage: str, protocol: str) -> None:
    """ValueError (one line, the install command) when ``protocol``'s fsspec implementation
    lives in a package that is not installed (s3fs for ``s3://``: the ``s3`` extra)."""
    import importlib.util

    from fsspec.registry import known_implementations

    from maskgrpo_ray.extras import EXTRAS, install_hint

    impl = known_implementations.get(protocol, {})
    package = str(impl.get("class", "")).split(".")[0]
    if not package or importlib.util.find_spec(package) is not None:
        return
    fix = install_hint(package) if package in EXTRAS else f"pip install {package}"
    raise ValueError(f"run.storage={storage!r} needs the {package!r} package: {fix}")


_SECRET_OPTIONS = {"key", "secret", "token", "password", "session_token", "access_key"}
