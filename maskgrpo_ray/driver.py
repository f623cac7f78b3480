"""The step loop, as phases: generate + score, filter + re-sample, advantages, update, sync, log.

The same loop drives both backends through an :class:`Executor`: ``LocalExecutor`` (one process,
the baseline) and ``maskgrpo_ray.ray_executor.RayExecutor`` (rollout, reward, filter and
learner actors on a Ray cluster).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from maskgrpo_ray.checkpoint import save_checkpoint
from maskgrpo_ray.config import Config
from maskgrpo_ray.metrics import RunLog, write_json_atomic
from maskgrpo_ray.phases import (
    FilterResult,
    make_train_batch,
    merge_reward_failures,
    reward_failure_metrics,
)
from maskgrpo_ray.types import ScoredBatch

log = logging.getLogger(__name__)


class Executor(Protocol):
    """Where the phases run. Every method is synchronous from the driver's point of view."""

    policy_version: int

    def generate_and_score(self, prompts: list[str], positions: list[int]) -> ScoredBatch: ...

    def filter(self, scored: ScoredBatch) -> FilterResult: ...

    def filter_stats(self) -> dict[str, float]: ...

    def update(self, batch: Any) -> dict[str, float]: ...

    def sync_weights(self) -> float: ...

    def evaluate(self, prompts: list[str]) -> dict[str, float]: ...

    def extra_metrics(self) -> dict[str, float]: ...

    def save(self, folder: Path) -> None:
        """Write weights, optimizer, RNG streams, filter state and version into ``folder``."""

    def load(self, folder: Path) -> None:
        """Restore what :meth:`save` wrote."""

    def shutdown(self) -> None: ...


class PhaseTimer:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0


@dataclass
class StepOutcome:
    row: dict[str, Any]
    scored: ScoredBatch | None  # the trained groups, or every generated one if none was
    reward_failures: dict[str, dict[str, int]] = field(default_factory=dict)  # this step's


def _merge(parts: list[ScoredBatch]) -> ScoredBatch:
    from maskgrpo_ray.types import RolloutBatch

    rb = RolloutBatch.concat([p.rollout for p in parts])
    keys = set(parts[0].reward_parts)
    acc = None
    if all(p.accuracy is not None for p in parts):
        acc = torch.cat([p.accuracy for p in parts])  # type: ignore[misc]
    return ScoredBatch(
        rb,
        torch.cat([p.rewards for p in parts]),
        {k: torch.cat([p.reward_parts[k] for p in parts]) for k in keys},
        acc,
        merge_reward_failures(*(p.reward_failures for p in parts)),
    )


@dataclass(frozen=True)
class Collected:
    """One step's groups: every generated one (all attempts) and the ones kept for training."""

    generated: ScoredBatch  # every group of every attempt, invalid and dropped ones included
    kept: ScoredBatch | None  # the groups to train on; None if none survived
    stats: dict[str, float]  # groups_generated / _dropped / _invalid / _exhausted


def collect_groups(
    ex: Executor, cfg: Config, prompts: list[str], positions: list[int], timer: PhaseTimer
) -> Collected:
    """Generate, score and filter; re-sample dropped groups up to ``filter.max_resamples`` times.

    A re-sampled prompt's earlier groups stay in ``generated`` (each attempt is a group that was
    generated and scored); ``kept`` holds the groups that passed, in the order they passed.
    """
    kept_parts: list[ScoredBatch] = []
    all_parts: list[ScoredBatch] = []
    stats = {
        "groups_generated": 0.0,
        "groups_dropped": 0.0,
        "groups_invalid": 0.0,
        "groups_exhausted": 0.0,
    }
    todo_prompts, todo_pos = prompts, positions
    for attempt in range(cfg.filter.max_resamples + 1):
        with timer("generate_score"):
            scored = ex.generate_and_score(todo_prompts, todo_pos)
        all_parts.append(scored)
        with timer("filter"):
            res = ex.filter(scored)
        stats["groups_generated"] += len(todo_prompts)
        stats["groups_invalid"] += float(res.invalid.sum())
        dropped = ~res.keep & ~res.invalid
        stats["groups_dropped"] += float(dropped.sum())
        if res.keep.any():
            kept_parts.append(_scored_groups(scored, res.keep))
        if not dropped.any():
            break
        idx = dropped.nonzero().squeeze(1).tolist()
        todo_prompts = [todo_prompts[i] for i in idx]
        todo_pos = [todo_pos[i] for i in idx]
        if attempt == cfg.filter.max_resamples:
            stats["groups_exhausted"] += len(idx)
    kept = _merge(kept_parts) if kept_parts else None
    return Collected(_merge(all_parts), kept, stats)


def _scored_groups(scored: ScoredBatch, keep: torch.Tensor) -> ScoredBatch:
    """The groups where ``keep``; failure counts stay with the whole batch they describe."""
    rows = keep.repeat_interleave(scored.rollout.group_size)
    return ScoredBatch(
        scored.rollout.group_slice(keep),
        scored.rewards[rows],
        {k: v[rows] for k, v in scored.reward_parts.items()},
        None if scored.accuracy is None else scored.accuracy[rows],
    )


def run_step(
    ex: Executor,
    cfg: Config,
    step: int,
    prompts: list[str],
    positions: list[int],
) -> StepOutcome:
    timer = PhaseTimer()
    t0 = time.perf_counter()
    col = collect_groups(ex, cfg, prompts, positions, timer)
    row: dict[str, Any] = {"step": step, "policy_version": ex.policy_version, **col.stats}
    row.update(reward_figures(col.generated, col.kept))
    scored = col.kept if col.kept is not None else col.generated
    row["policy_version_lag"] = ex.policy_version - scored.rollout.policy_version
    n_samples = int(col.stats["groups_generated"]) * cfg.rollout.samples_per_prompt
    if col.kept is not None:
        keep = torch.ones(len(col.kept.rollout.prompts), dtype=torch.bool)
        with timer("advantages"):
            tb = make_train_batch(col.kept, keep, cfg.train.advantage_eps)
        with timer("update"):
            row.update(ex.update(tb))
        with timer("sync"):
            row["weight_sync_seconds"] = ex.sync_weights()
        row["groups_trained"] = float(keep.sum())
    else:
        row["groups_trained"] = 0.0
        log.warning("step %d: no group survived scoring and filtering; update skipped", step)
    row.update(ex.filter_stats())
    row.update(ex.extra_metrics())
    row.update({f"time/{k}": v for k, v in timer.seconds.items()})
    wall = time.perf_counter() - t0
    row["step_seconds"] = wall
    row["samples_per_second"] = n_samples / wall if wall > 0 else float("nan")
    return StepOutcome(row, scored, col.generated.reward_failures)


def _finite_mean(x: torch.Tensor) -> float:
    x = x[torch.isfinite(x)]
    return float(x.mean()) if x.numel() else float("nan")


def reward_figures(generated: ScoredBatch, kept: ScoredBatch | None) -> dict[str, float]:
    """The step's reward figures over finite values.

    ``reward_mean``, ``reward_std``, ``reward/<part>`` and ``accuracy`` describe every generated
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
    if generated.accuracy is not None:
        out["accuracy"] = _finite_mean(generated.accuracy)
        acc_kept = None if kept is None else kept.accuracy
        out["accuracy_kept"] = _finite_mean(acc_kept) if acc_kept is not None else float("nan")
    return out


def _save(
    cfg: Config,
    ex: Executor,
    run_dir: Path,
    next_step: int,
    stream: Any,
    base: dict[str, float],
    totals: dict[str, float],
) -> None:
    def write(folder: Path) -> None:
        ex.save(folder)
        torch.save(
            {"next_step": next_step, "stream": stream.state_dict(), "base": base, "totals": totals},
            folder / "driver.pt",
        )

    path = save_checkpoint(run_dir, next_step, write, cfg.run.keep_checkpoints)
    log.info("checkpoint %s", path)


def _restore(ex: Executor, stream: Any, runlog: RunLog, folder: Path) -> tuple[int, dict, dict]:
    """Executor, prompt stream and driver counters from a checkpoint: (next step, base, totals)."""
    state = torch.load(folder / "driver.pt", weights_only=True)
    ex.load(folder)
    stream.load_state_dict(state["stream"])
    start_step = int(state["next_step"])
    runlog.truncate_from(start_step)
    log.info("resumed from %s at step %d", folder, start_step)
    return start_step, dict(state["base"]), dict(state["totals"])


def _count(cfg: Config, out: StepOutcome, totals: dict[str, float]) -> None:
    """Add the step to the run's totals; the row gets the cumulative reward-failure counts
    (in ``totals``, so a resumed run continues them)."""
    row = out.row
    for key, n in reward_failure_metrics(out.reward_failures).items():
        totals[key] = totals.get(key, 0.0) + n
    row.update({k: v for k, v in totals.items() if k.startswith("reward_failures/")})
    totals["samples"] += row["groups_generated"] * cfg.rollout.samples_per_prompt
    totals["train_seconds"] += row["step_seconds"]


def _summary(
    cfg: Config, ex: Executor, start_step: int, base: dict, final: dict, totals: dict, t0: float
) -> dict[str, Any]:
    train_seconds = totals["train_seconds"]
    return {
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
        "policy_version": ex.policy_version,
    }


def train(
    cfg: Config,
    ex: Executor,
    run_dir: Path,
    stream: Any,
    eval_prompts: list[str],
    resume_from: Path | None = None,
    on_step_end: Any = None,
) -> dict[str, Any]:
    """The whole run: base eval, the step loop, final eval, ``summary.json``.

    With ``resume_from`` (a checkpoint folder) the executor, the prompt stream and the step
    counter are restored and the loop continues where the checkpoint was taken.
    """
    runlog = RunLog(run_dir)
    t_start = time.perf_counter()
    totals = {"samples": 0.0, "train_seconds": 0.0}
    start_step = 0
    if resume_from is not None:
        start_step, base, totals = _restore(ex, stream, runlog, resume_from)
    else:
        base = ex.evaluate(eval_prompts)
        log.info("base model: %s", base)
    bar = None
    if cfg.logging.progress_bar:
        from tqdm import tqdm

        bar = tqdm(total=cfg.train.steps, initial=start_step, desc="maskgrpo", unit="step")
    last = cfg.train.steps - 1
    for step in range(start_step, cfg.train.steps):
        prompts, positions = stream.take(cfg.train.prompts_per_step)
        out = run_step(ex, cfg, step, prompts, positions)
        row = out.row
        _count(cfg, out, totals)
        every = cfg.eval.every_steps
        if every and (step + 1) % every == 0 and step < last:
            row.update(ex.evaluate(eval_prompts))
        g = cfg.logging.sample_grid_every_steps
        if g and out.scored is not None and (step % g == 0 or step == last):
            rb = out.scored.rollout
            runlog.save_sample_grid(rb.images, step, rb.group_size, rb.prompts)
        runlog.log_step(row)
        ck = cfg.run.checkpoint_every_steps
        if ck and (step + 1) % ck == 0:
            _save(cfg, ex, run_dir, step + 1, stream, base, totals)
        if on_step_end is not None:
            on_step_end(step, row)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(
                reward=f"{row['reward_mean']:.3f}", sps=f"{row['samples_per_second']:.1f}"
            )
    if bar is not None:
        bar.close()
    final = ex.evaluate(eval_prompts)
    log.info("tuned model: %s", final)
    runlog.plot_reward_curve()
    summary = _summary(cfg, ex, start_step, base, final, totals, t_start)
    summary["eval_prompts"] = len(eval_prompts)
    write_json_atomic(run_dir / "summary.json", summary)
    return summary
