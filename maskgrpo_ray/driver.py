"""The step loop, as phases: generate + score, filter + re-sample, advantages, update, sync, log.

The same loop drives both backends through an :class:`Executor`: ``LocalExecutor`` (one process,
the baseline) and ``maskgrpo_ray.ray_executor.RayExecutor`` (rollout, reward, filter and
learner actors on a Ray cluster).
"""

from __future__ import annotations

import contextlib
import logging
import signal
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from maskgrpo_ray.checkpoint import run_store
from maskgrpo_ray.config import Config
from maskgrpo_ray.data_plane import concat_rollouts, fetch_rollout, rollout_nbytes
from maskgrpo_ray.evaluation.weights import save_final_policy
from maskgrpo_ray.learner_core import LearnerLost
from maskgrpo_ray.metrics import RunLog, write_json_atomic
from maskgrpo_ray.phases import (
    FilterResult,
    make_train_batch,
    merge_reward_failures,
    reward_failure_metrics,
)
from maskgrpo_ray.types import RolloutBatch, ScoredBatch, TrainBatch, tensor_nbytes

log = logging.getLogger(__name__)


class Executor(Protocol):
    """Where the phases run. Every method is synchronous from the driver's point of view."""

    policy_version: int

    def generate_and_score(self, prompts: list[str], positions: list[int]) -> ScoredBatch:
        """The prompts' groups, generated and scored (on Ray the rollout stays in the object
        store: ``scored.rollout`` is a ``data_plane.RolloutRefs``)."""

    def filter(self, scored: ScoredBatch) -> FilterResult: ...

    def filter_stats(self) -> dict[str, float]: ...

    def update(self, batch: Any) -> dict[str, float]: ...

    def sync_weights(self) -> float: ...

    def evaluate(
        self, prompts: list[str], tags: list[str | None] | None = None
    ) -> dict[str, float]: ...

    def policy_state(self) -> dict[str, torch.Tensor]:
        """The learner's trained tensors on the CPU (what a weight sync sends)."""

    def extra_metrics(self) -> dict[str, float]: ...

    def save(self, folder: Path) -> None:
        """Write weights, optimizer, RNG streams, filter state and version into ``folder``."""

    def load(self, folder: Path) -> None:
        """Restore what :meth:`save` wrote."""

    def restart_learner(self, lost: Exception) -> None:
        """A new learner after ``lost`` (:class:`LearnerLost`); :meth:`load` restores it."""

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
    grid: RolloutBatch | None = None  # ``scored``'s tensors with images, on sample-grid steps


def _merge(parts: list[ScoredBatch]) -> ScoredBatch:
    rb = concat_rollouts([p.rollout for p in parts])
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
    ex: Executor,
    cfg: Config,
    prompts: list[str],
    positions: list[int],
    timer: PhaseTimer,
) -> Collected:
    """Generate, score and filter; re-sample dropped groups up to ``filter.max_resamples`` times.

    A re-sampled prompt's earlier groups stay in ``generated`` (each attempt is a group that was
    generated and scored); ``kept`` holds the groups that passed, in the order they passed.
    With asynchronous rollouts ``ex`` is the executor's view for the step ahead
    (``RayExecutor.start_ahead``), and this runs in a background thread during the previous
    step's update.
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


class RolloutsAhead:
    """The next step's groups, generated, scored, filtered and re-sampled while the learner
    trains (``rollout.max_policy_lag`` 1; the Ray backend's ``start_ahead``).

    ``start`` takes the next step's prompts from the stream (remembering the stream's and the
    filter's state before, so an abandoned prefetch gives them back) and runs
    :func:`collect_groups` for them in the background, against the weights the rollout actors
    hold (the version before the update) and with chunk seeds fixed by the step; ``wait``
    blocks until they are collected; ``take`` hands them to the next step; ``discard`` drops
    them.
    """

    def __init__(self, ex: Any, cfg: Config, stream: Any) -> None:
        self.ex, self.cfg, self.stream = ex, cfg, stream
        self.future: Any = None
        self.taken: tuple[list[str], list[int]] | None = None
        self.stream_before: Any = None
        self.filter_before: Any = None

    @property
    def pending(self) -> bool:
        return self.future is not None

    def start(self, step: int) -> None:
        self.stream_before = self.stream.state_dict()
        self.filter_before = self.ex.filter_snapshot()
        self.taken = prompts, positions = self.stream.take(self.cfg.train.prompts_per_step)
        cfg = self.cfg

        def work(view: Any) -> tuple[Collected, dict[str, float]]:
            timer = PhaseTimer()
            return collect_groups(view, cfg, prompts, positions, timer), timer.seconds

        self.future = self.ex.start_ahead(step, work)

    def wait(self) -> None:
        if self.future is not None:
            self.future.result()

    def take(self) -> tuple[list[str], list[int], Collected, dict[str, float]]:
        assert self.future is not None and self.taken is not None
        collected, seconds = self.future.result()
        prompts, positions = self.taken
        self.future = self.taken = None
        return prompts, positions, collected, seconds

    def discard(self, rewind: bool) -> None:
        """Drop a pending prefetch (waiting for it); ``rewind``: its prompts go back to the
        stream and the filter forgets its decisions on them, so a checkpoint taken now
        resumes as if they had never started."""
        if self.future is None:
            return
        with contextlib.suppress(Exception):  # its failure no longer matters
            self.future.result()
        if rewind:
            self.stream.load_state_dict(self.stream_before)
            self.ex.load_filter_state(self.filter_before)
        self.future = self.taken = None


def _may_prefetch(cfg: Config, step: int) -> bool:
    """Whether step ``step`` starts the next step's rollouts ahead: not after the last step,
    and not across a checkpoint (so a checkpoint holds no rollout in flight, and a resume is
    the run it continues)."""
    ck = cfg.run.checkpoint_every_steps
    nxt = step + 1
    return cfg.rollout.max_policy_lag > 0 and nxt < cfg.train.steps and not (ck and nxt % ck == 0)


def run_step(
    ex: Executor,
    cfg: Config,
    step: int,
    prompts: list[str],
    positions: list[int],
    *,
    collected: tuple[Collected, dict[str, float]] | None = None,
    ahead: RolloutsAhead | None = None,
) -> StepOutcome:
    """One step's phases. ``collected``: these prompts' groups collected ahead (and the
    background's phase seconds); ``ahead``: start the next step's collection before the update
    and wait for it before the weight sync, so the rollout, reward and filter actors work while
    the learner trains (``rollout.max_policy_lag`` 1)."""
    timer = PhaseTimer()
    t0 = time.perf_counter()
    row: dict[str, Any] = {"step": step}
    if collected is None:
        col = collect_groups(ex, cfg, prompts, positions, timer)
    else:
        col, ahead_seconds = collected
        row.update({f"time/ahead_{k}": v for k, v in ahead_seconds.items()})
    filter_stats = ex.filter_stats()  # after this step's decisions, before the next step's
    if ahead is not None:
        ahead.start(step + 1)
    row.update({"policy_version": ex.policy_version, **col.stats})
    row.update(reward_figures(col.generated, col.kept))
    scored = col.kept if col.kept is not None else col.generated
    row["policy_version_lag"] = ex.policy_version - scored.rollout.policy_version
    # the data plane per step (docs/ray_system.md, "Bytes per hop")
    tensors, images = rollout_nbytes(col.generated.rollout)
    row["bytes/rollouts"] = float(tensors + images)
    row["bytes/rollouts_without_images"] = float(tensors)
    row["bytes/rewards"] = float(
        tensor_nbytes_of(col.generated.rewards)
        + sum(tensor_nbytes_of(v) for v in col.generated.reward_parts.values())
    )
    n_samples = int(col.stats["groups_generated"]) * cfg.rollout.samples_per_prompt
    if col.kept is not None:
        keep = torch.ones(len(col.kept.rollout.prompts), dtype=torch.bool)
        with timer("advantages"):
            tb = make_train_batch(col.kept, keep, cfg.train.advantage_eps)
        if isinstance(tb, TrainBatch):  # one process: the batch itself
            row["bytes/train_batch"] = float(tensor_nbytes(tb))
        with timer("update"):
            row.update(ex.update(tb))
        if ahead is not None:
            with timer("wait_rollouts_ahead"):
                ahead.wait()
        with timer("sync"):
            row["weight_sync_seconds"] = ex.sync_weights()
        row["groups_trained"] = float(keep.sum())
        row["prompts_trained"] = list(col.kept.rollout.prompt_indices)  # per-prompt accounting
    else:
        row["prompts_trained"] = []
        if ahead is not None:
            ahead.wait()
        row["groups_trained"] = 0.0
        log.warning("step %d: no group survived scoring and filtering; update skipped", step)
    grid = None
    if _grid_due(cfg, step):  # the one time the driver fetches rollout tensors (Ray)
        grid = fetch_rollout(scored.rollout, images=True)
        row["bytes/driver_grid"] = float(tensor_nbytes(grid))
    row.update(filter_stats)
    row.update(ex.extra_metrics())
    if "bytes/driver_received" in row and row["bytes/rollouts"] > 0:
        handled = row["bytes/driver_received"] + row["bytes/driver_sent"]
        row["driver_bytes_fraction"] = handled / row["bytes/rollouts"]  # grid steps aside
    row.update({f"time/{k}": v for k, v in timer.seconds.items()})
    wall = time.perf_counter() - t0
    row["step_seconds"] = wall
    row["learner_busy_fraction"] = timer.seconds.get("update", 0.0) / wall if wall > 0 else 0.0
    row["samples_per_second"] = n_samples / wall if wall > 0 else float("nan")
    return StepOutcome(row, scored, col.generated.reward_failures, grid)


def tensor_nbytes_of(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


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
    """Stage the checkpoint in a local folder (executor files + ``driver.pt``) and publish it
    to the run's storage (``run.storage``, else ``run_dir/checkpoints``) with its manifest."""

    def write(folder: Path) -> None:
        ex.save(folder)
        torch.save(
            {"next_step": next_step, "stream": stream.state_dict(), "base": base, "totals": totals},
            folder / "driver.pt",
        )

    where = run_store(cfg.run, run_dir).save(next_step, write, cfg.run.keep_checkpoints)
    log.info("checkpoint %s", where)


def _restore(ex: Executor, stream: Any, runlog: RunLog, folder: Path) -> tuple[int, dict, dict]:
    """Executor, prompt stream and driver counters from a checkpoint: (next step, base, totals).

    ``folder`` is a local, verified copy (``CheckpointStore.fetch_valid``)."""
    state = torch.load(folder / "driver.pt", weights_only=True)
    ex.load(folder)
    stream.load_state_dict(state["stream"])
    start_step = int(state["next_step"])
    runlog.truncate_from(start_step)
    log.info("resumed from %s at step %d", folder, start_step)
    return start_step, dict(state["base"]), dict(state["totals"])


class RunFailed(RuntimeError):
    """The run cannot go on by itself; the message names the checkpoint and the command that
    resumes it (the CLI exits non-zero with it)."""


def _recover_learner(
    cfg: Config,
    ex: Executor,
    run_dir: Path,
    stream: Any,
    runlog: RunLog,
    lost: LearnerLost,
    attempt: int,
) -> tuple[int, dict, dict]:
    """After a lost learner rank: a new learner group, and the executor, the prompt stream, the
    driver's counters and ``metrics.jsonl`` rolled back to the newest valid checkpoint
    (``_restore``). The steps after it run again, so none is lost or trained twice. Bounded by
    ``run.max_learner_restarts``; past it, or with no checkpoint, :class:`RunFailed`."""
    store = run_store(cfg.run, run_dir)
    resume = f"maskgrpo train --resume {run_dir}"
    budget = cfg.run.max_learner_restarts
    if attempt > budget:
        newest = store.latest()
        raise RunFailed(
            f"{lost}; the learner group was already restored {budget} times "
            f"(run.max_learner_restarts={budget}). Newest checkpoint: "
            f"{store.location}/{newest if newest else '(none)'}; resume it with `{resume}` "
            "once the cause is found (raise run.max_learner_restarts to retry more in-job)"
        ) from lost
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=".recover-", dir=run_dir) as scratch:
        folder = store.fetch_valid(Path(scratch))
        if folder is None:
            raise RunFailed(
                f"{lost}; the run has no checkpoint at {store.location} to restore the learner "
                f"from (run.checkpoint_every_steps={cfg.run.checkpoint_every_steps}): start it "
                "again with run.checkpoint_every_steps > 0"
            ) from lost
        log.warning(
            "%s: restoring the learner group and the run from checkpoint %s (attempt %d of %d)",
            lost,
            folder.name,
            attempt,
            budget,
        )
        try:
            ex.restart_learner(lost)
        except Exception as err:
            raise RunFailed(
                f"{lost}; a new learner group could not be started ({err}). Newest checkpoint: "
                f"{store.location}/{folder.name}; resume it with `{resume}`"
            ) from err
        out = _restore(ex, stream, runlog, folder)
    log.warning(
        "learner restored in %.1f s; the run continues at step %d", time.monotonic() - t0, out[0]
    )
    return out


class StepAbandoned(Exception):
    """Raised in the driver's thread when a preempted step would overrun the grace period."""


class Preemption:
    """SIGTERM/SIGINT during the step loop: a flag the loop checks between steps.

    A signal during a step lets the step finish, unless it would leave too little of
    ``grace_s`` for the checkpoint (the longest save seen so far plus a margin): then a
    SIGALRM at that moment raises :class:`StepAbandoned` and the step's partial work is
    dropped (the previous checkpoint stays the resume point). A second signal abandons at once.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.signal_name: str | None = None
        self.t_signal = 0.0
        self.save_s = 0.0  # the longest checkpoint write so far
        self.in_step = False
        self._previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    def seconds_left(self) -> float:
        return self.grace_s - (time.monotonic() - self.t_signal)

    def reserve_s(self) -> float:
        """Time kept back for the checkpoint and the exit."""
        return self.save_s * 1.5 + min(5.0, 0.1 * self.grace_s)

    def install(self) -> bool:
        if threading.current_thread() is not threading.main_thread():
            log.warning("not the main thread: SIGTERM/SIGINT will not stop the run gracefully")
            return False
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, self._on_signal)
        self._previous[signal.SIGALRM] = signal.signal(signal.SIGALRM, self._on_alarm)
        return True

    def uninstall(self) -> None:
        signal.setitimer(signal.ITIMER_REAL, 0)
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        self.in_step = True
        try:
            yield
        finally:
            self.in_step = False
            signal.setitimer(signal.ITIMER_REAL, 0)

    def _on_signal(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if self.requested:
            if self.in_step:
                log.warning("second %s: abandoning the current step", name)
                raise StepAbandoned(name)
            return
        self.signal_name, self.t_signal = name, time.monotonic()
        log.warning(
            "%s received: stopping after the current step, with a checkpoint, within %.0f s "
            "(run.preemption_grace_seconds)",
            name,
            self.grace_s,
        )
        if self.in_step:
            budget = self.seconds_left() - self.reserve_s()
            if budget <= 0:
                raise StepAbandoned(name)
            signal.setitimer(signal.ITIMER_REAL, budget)

    def _on_alarm(self, signum: int, frame: Any) -> None:
        if self.in_step:
            raise StepAbandoned(self.signal_name or "SIGALRM")


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
        "base_eval": base,  # every figure, per GenEval tag too
        "final_eval": final,
    }


def _grid_due(cfg: Config, step: int) -> bool:
    """Whether ``step`` draws a sample grid (``logging.sample_grid_every_steps``, and the last)."""
    g = cfg.logging.sample_grid_every_steps
    return bool(g) and (step % g == 0 or step == cfg.train.steps - 1)


@dataclass(frozen=True)
class EvalSet:
    """Held-out prompts with their GenEval tags (one per prompt; None: untagged): evaluations
    then also report ``eval_<key>/<tag>``."""

    prompts: list[str]
    tags: list[str | None]

    def __len__(self) -> int:
        return len(self.prompts)


def _evaluate(ex: Executor, eval_prompts: list[str] | EvalSet) -> dict[str, float]:
    if isinstance(eval_prompts, EvalSet):
        return ex.evaluate(eval_prompts.prompts, eval_prompts.tags)
    return ex.evaluate(eval_prompts)


def _one_step(
    cfg: Config,
    ex: Executor,
    step: int,
    stream: Any,
    eval_prompts: list[str] | EvalSet,
    runlog: RunLog,
    totals: dict[str, float],
    ahead: RolloutsAhead | None = None,
    stop: Preemption | None = None,
) -> dict[str, Any]:
    """One driver step, logged: run it, count it, evaluate and draw samples when due. With
    ``ahead`` (asynchronous rollouts) the step uses the rollouts started by the step before,
    and starts the next step's unless :func:`_may_prefetch` says no or a stop is requested."""
    last = cfg.train.steps - 1
    collected = None
    if ahead is not None and ahead.pending:
        prompts, positions, col, seconds = ahead.take()
        collected = (col, seconds)
    else:
        prompts, positions = stream.take(cfg.train.prompts_per_step)
    go_ahead = ahead is not None and _may_prefetch(cfg, step)
    if stop is not None and stop.requested:
        go_ahead = False
    kw: dict[str, Any] = {}  # none in the synchronous loop: its call is what it always was
    if collected is not None:
        kw["collected"] = collected
    if go_ahead:
        kw["ahead"] = ahead
    out = run_step(ex, cfg, step, prompts, positions, **kw)
    row = out.row
    _count(cfg, out, totals)
    every = cfg.eval.every_steps
    if every and (step + 1) % every == 0 and step < last:
        row.update(_evaluate(ex, eval_prompts))
    if out.grid is not None:
        rb = out.grid
        runlog.save_sample_grid(rb.images, step, rb.group_size, rb.prompts)
    runlog.log_step(row)
    return row


def _stop_early(
    cfg: Config,
    ex: Executor,
    run_dir: Path,
    stream: Any,
    stop: Preemption,
    next_step: int,
    saved_step: int | None,
    base: dict[str, float],
    totals: dict[str, float],
) -> int | None:
    """After a signal: checkpoint at ``next_step`` unless one is there or time is too short.
    Returns the step a resume continues at (None: no checkpoint)."""
    if next_step == saved_step:
        return saved_step
    left, need = stop.seconds_left(), stop.reserve_s()
    if left < need:
        log.warning(
            "%s: %.1f s of the grace period left, a checkpoint needs about %.1f s: none written; "
            "a resume continues at %s",
            stop.signal_name,
            left,
            need,
            "step 0" if saved_step is None else f"step {saved_step}",
        )
        return saved_step
    _save(cfg, ex, run_dir, next_step, stream, base, totals)
    return next_step


def train(
    cfg: Config,
    ex: Executor,
    run_dir: Path,
    stream: Any,
    eval_prompts: list[str] | EvalSet,
    resume_from: Path | None = None,
    on_step_end: Any = None,
) -> dict[str, Any]:
    """The whole run: base eval, the step loop, final eval, ``summary.json``.

    With ``resume_from`` (a local checkpoint folder) the executor, the prompt stream and the
    step counter are restored and the loop continues where the checkpoint was taken. SIGTERM or
    SIGINT during the loop stops it at a step boundary (:class:`Preemption`): a checkpoint is
    written, ``summary.json`` says ``"completed": false`` and the final evaluation is skipped.
    """
    runlog = RunLog(run_dir)
    t_start = time.perf_counter()
    totals = {"samples": 0.0, "train_seconds": 0.0}
    start_step = 0
    saved_step: int | None = None  # the step the newest checkpoint of this run resumes at
    if resume_from is not None:
        start_step, base, totals = _restore(ex, stream, runlog, resume_from)
        saved_step = start_step
    else:
        if runlog.rows:
            log.warning(
                "%s holds metrics of %d steps but no checkpoint: starting from step 0, "
                "dropping them",
                runlog.path,
                len(runlog.rows),
            )
            runlog.truncate_from(0)
        base = _evaluate(ex, eval_prompts)
        log.info("base model: %s", base)
    bar = None
    if cfg.logging.progress_bar:
        from tqdm import tqdm

        bar = tqdm(total=cfg.train.steps, initial=start_step, desc="maskgrpo", unit="step")
    stop = Preemption(cfg.run.preemption_grace_seconds)
    stop.install()
    step, next_step, abandoned, learner_restarts = start_step, start_step, False, 0
    ahead = None
    if cfg.rollout.max_policy_lag > 0:
        ahead = RolloutsAhead(ex, cfg, stream)
    try:
        while step < cfg.train.steps:
            if stop.requested:
                if ahead is not None:  # its prompts go back: the checkpoint resumes with them
                    ahead.discard(rewind=True)
                break
            try:
                with stop.step():
                    row = _one_step(
                        cfg, ex, step, stream, eval_prompts, runlog, totals, ahead, stop
                    )
                next_step = step + 1
                ck = cfg.run.checkpoint_every_steps
                if ck and next_step % ck == 0:
                    t0 = time.monotonic()
                    _save(cfg, ex, run_dir, next_step, stream, base, totals)
                    stop.save_s, saved_step = max(stop.save_s, time.monotonic() - t0), next_step
            except LearnerLost as lost:  # roll the whole run back to its newest checkpoint
                if ahead is not None:
                    ahead.discard(rewind=False)  # the checkpoint has the stream's position
                learner_restarts += 1
                step, base, totals = _recover_learner(
                    cfg, ex, run_dir, stream, runlog, lost, learner_restarts
                )
                next_step = saved_step = step
                if bar is not None:
                    bar.n = step
                    bar.refresh()
                continue
            if on_step_end is not None:
                on_step_end(step, row)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(
                    reward=f"{row['reward_mean']:.3f}", sps=f"{row['samples_per_second']:.1f}"
                )
            step += 1
    except StepAbandoned:  # its partial work is dropped: no checkpoint of this state
        abandoned = True
        if ahead is not None:
            ahead.discard(rewind=False)
        log.warning(
            "%s: step %d abandoned to stay within run.preemption_grace_seconds=%.0f",
            stop.signal_name,
            next_step,
            stop.grace_s,
        )
    finally:
        stop.uninstall()
        if bar is not None:
            bar.close()
    if stop.requested:
        resume_at = saved_step
        if not abandoned:
            resume_at = _stop_early(
                cfg, ex, run_dir, stream, stop, next_step, saved_step, base, totals
            )
        runlog.plot_reward_curve()
        summary = _summary(cfg, ex, start_step, base, {}, totals, t_start)
        summary.update(
            eval_prompts=len(eval_prompts),
            completed=False,
            stopped_by=stop.signal_name,
            steps_done=next_step,
            resume_step=resume_at,
        )
        write_json_atomic(run_dir / "summary.json", summary)
        log.warning(
            "stopped by %s %.1f s after it, %d of %d steps done; run the same command to resume",
            stop.signal_name,
            stop.grace_s - stop.seconds_left(),
            next_step,
            cfg.train.steps,
        )
        return summary
    final = _evaluate(ex, eval_prompts)
    log.info("tuned model: %s", final)
    if cfg.run.export_final_policy:
        info: dict[str, Any] = {"step": cfg.train.steps, "policy_version": ex.policy_version}
        info["model_kind"] = cfg.model.kind
        path = save_final_policy(run_dir, ex.policy_state(), info)
        log.info("final policy: %s (maskgrpo eval --weights %s)", path, run_dir)
    runlog.plot_reward_curve()
    summary = _summary(cfg, ex, start_step, base, final, totals, t_start)
    summary["eval_prompts"] = len(eval_prompts)
    summary["completed"] = True
    write_json_atomic(run_dir / "summary.json", summary)
    return summary
