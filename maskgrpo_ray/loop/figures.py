"""The figures of a step and of a run: rewards, bytes per hop, busy fractions, the summary.

Pure bookkeeping over the step's typed messages; nothing here decides anything.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from maskgrpo_ray.config import Config
from maskgrpo_ray.loop.collect import Collected
from maskgrpo_ray.pipeline.data_plane import rollout_nbytes
from maskgrpo_ray.pipeline.geneval_judge import geneval_detectors
from maskgrpo_ray.pipeline.messages import RolloutBatch, ScoredBatch
from maskgrpo_ray.pipeline.phases import reward_failure_metrics
from maskgrpo_ray.pipeline.settings import StepSettings, settings_from_config
from maskgrpo_ray.runlog.monitors import reward_agreement


@dataclass
class StepOutcome:
    row: dict[str, Any]
    scored: ScoredBatch | None  # the trained groups, or every generated one if none was
    reward_failures: dict[str, dict[str, int]] = field(default_factory=dict)  # this step's
    grid: RolloutBatch | None = None  # ``scored``'s tensors with images, on sample-grid steps


def tensor_nbytes_of(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _finite_mean(x: torch.Tensor) -> float:
    x = x[torch.isfinite(x)]
    return float(x.mean()) if x.numel() else float("nan")


def reward_figures(generated: ScoredBatch, kept: ScoredBatch | None) -> dict[str, float]:
    """The step's reward figures over finite values.

    ``reward_mean``, ``reward_std``, ``reward/<part>``, ``agreement/*``, ``image/*`` and
    ``accuracy`` describe every generated
    group of the step (every attempt, dropped and invalid groups included), so they measure the
    policy; ``reward_mean_kept`` and ``accuracy_kept`` the groups trained on (NaN if none).
    """
    finite = generated.rewards[torch.isfinite(generated.rewards)]
    out = {
        "reward_mean": _finite_mean(generated.rewards),
        "reward_std": float(finite.std()) if finite.numel() > 1 else float("nan"),
        "reward_mean_kept": _finite_mean(kept.rewards) if kept is not None else float("nan"),
    }
    for k, v in generated.reward_parts.items():
        out[f"reward/{k}"] = _finite_mean(v)
    for k, v in generated.diversity.items():  # "diversity/distinct", ..., "image/dark", ...
        out[k] = _finite_mean(v)
    # the components' agreement within groups (docs/monitors.md); weight-0 components count
    out.update(reward_agreement(generated.reward_parts, generated.rollout.group_size))
    if generated.accuracy is not None:
        out["accuracy"] = _finite_mean(generated.accuracy)
        acc_kept = None if kept is None else kept.accuracy
        out["accuracy_kept"] = _finite_mean(acc_kept) if acc_kept is not None else float("nan")
    return out


def collected_figures(col: Collected) -> dict[str, float]:
    """Group counts, reward figures, the filter's figures, the phase seconds (``time/ahead_*``
    when collected during the previous update) and the data plane's bytes of the collection
    (docs/ray_system.md, "Bytes per hop")."""
    row: dict[str, float] = {**col.stats, **reward_figures(col.generated, col.kept)}
    prefix = "time/ahead_" if col.ahead else "time/"
    row.update({f"{prefix}{k}": v for k, v in col.seconds.items()})
    tensors, images = rollout_nbytes(col.generated.rollout)
    row["bytes/rollouts"] = float(tensors + images)
    row["bytes/rollouts_without_images"] = float(tensors)
    row["bytes/rewards"] = float(
        tensor_nbytes_of(col.generated.rewards)
        + sum(tensor_nbytes_of(v) for v in col.generated.reward_parts.values())
    )
    return row


def closing_figures(
    row: dict[str, Any], seconds: dict[str, float], wall: float, n_samples: int
) -> None:
    """The step's shares: the driver's bytes over the rollouts' (grid steps aside), phase
    seconds, wall time, learner busy fraction and samples per second (into ``row``)."""
    if "bytes/driver_received" in row and row["bytes/rollouts"] > 0:
        handled = row["bytes/driver_received"] + row["bytes/driver_sent"]
        row["driver_bytes_fraction"] = handled / row["bytes/rollouts"]
    row.update({f"time/{k}": v for k, v in seconds.items()})
    row["step_seconds"] = wall
    row["learner_busy_fraction"] = seconds.get("update", 0.0) / wall if wall > 0 else 0.0
    row["samples_per_second"] = n_samples / wall if wall > 0 else float("nan")


def count_step(cfg: Config, out: StepOutcome, totals: dict[str, float]) -> None:
    """Add the step to the run's totals; the row gets the cumulative reward-failure counts
    (in ``totals``, so a resumed run continues them)."""
    row = out.row
    for key, n in reward_failure_metrics(out.reward_failures).items():
        totals[key] = totals.get(key, 0.0) + n
    row.update({k: v for k, v in totals.items() if k.startswith("reward_failures/")})
    totals["samples"] += row["groups_generated"] * cfg.rollout.samples_per_prompt
    totals["train_seconds"] += row["step_seconds"]


def run_summary(
    cfg: Config,
    policy_version: int,
    start_step: int,
    base: dict,
    final: dict,
    totals: dict,
    t0: float,
) -> dict[str, Any]:
    """``summary.json``'s common part: throughput, base and final figures, and which GenEval
    detector scored the reward and which the evaluation (``geneval_detectors``, when any)."""
    reward = settings_from_config(cfg).reward
    train_seconds = totals["train_seconds"]
    summary = {
        "backend": cfg.run.backend,
        "steps": cfg.train.steps,
        "start_step": start_step,
        "wall_seconds": time.perf_counter() - t0,
        "train_seconds": train_seconds,
        "samples_per_second": totals["samples"] / train_seconds if train_seconds else None,
        "base_reward": base.get("eval_reward"),
        "final_reward": final.get("eval_reward"),
        "base_accuracy": base.get("eval_accuracy"),
        "final_accuracy": final.get("eval_accuracy"),
        "eval_samples_per_prompt": cfg.eval.samples_per_prompt,
        "policy_version": policy_version,
        "base_eval": base,  # every figure, per GenEval tag too
        "final_eval": final,
    }
    detectors = geneval_detectors(reward.specs, reward.judge)
    if detectors:
        summary["geneval_detectors"] = detectors
    return summary


def grid_due(settings: StepSettings, step: int) -> bool:
    """Whether ``step`` draws a sample grid (``logging.sample_grid_every_steps``, and the last)."""
    g = settings.sample_grid_every_steps
    return bool(g) and (step % g == 0 or step == settings.steps - 1)
