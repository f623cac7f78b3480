"""The ways back: checkpoints (save, restore), learner recovery, preemption, early stop.

A checkpoint is the executor's files (weights, optimizer, RNG streams, version) and
``driver.pt``: the next step, the group source's state (prompt stream and filter history),
the base evaluation and the run's totals. It is only ever taken between steps with no
rollout in flight, so a resume is the run it continues. A restore sets aside what the run
folder holds past the checkpoint (``RunLog.supersede``): history is moved, never overwritten.
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
from typing import Any

import torch

from maskgrpo_ray.checkpoints.run_store import run_store
from maskgrpo_ray.config import Config
from maskgrpo_ray.evaluation.weights import FINAL_ADAPTER, FINAL_MERGED, FINAL_POLICY
from maskgrpo_ray.loop.collect import GroupSource
from maskgrpo_ray.loop.executor import Executor
from maskgrpo_ray.loop.snapshot import BackgroundWriter, host_copy
from maskgrpo_ray.pipeline.learner_core import LearnerLost
from maskgrpo_ray.runlog.run_log import RunLog
from maskgrpo_ray.weights.safe_files import check_pickles, load_torch_file

log = logging.getLogger(__name__)

# what the end of a run writes: a resume from an earlier step sets them aside (RunLog.supersede)
RUN_ENDS = (
    "summary.json",
    FINAL_POLICY,
    FINAL_MERGED,
    FINAL_ADAPTER,
    "reward_curve.png",
    "samples/eval_tags_final.png",
)


class RunFailed(RuntimeError):
    """The run cannot go on by itself; the message names the checkpoint and the command that
    resumes it (the CLI exits non-zero with it)."""


@dataclass(frozen=True)
class RunCursor:
    """Where the step loop stands between steps: what it advances from, and what a roll-back
    after a lost learner puts it back to.

    Attributes:
        step: the next step to run.
        saved: the step the newest checkpoint resumes at (None: no checkpoint yet).
        source: the group source's state to put back before ``step`` runs (a step redone with
            no checkpoint to roll back to); None: the source is already there.
        base, totals: the base evaluation and the run's totals to put back (a checkpoint's);
            None: unchanged.
    """

    step: int
    saved: int | None
    source: dict[str, Any] | None = None
    base: dict[str, float] | None = None
    totals: dict[str, float] | None = None


class Cadence:
    """When the step loop checkpoints: every ``run.checkpoint_every_steps`` steps, and at the
    first step boundary ``run.checkpoint_every_minutes`` after the last checkpoint that has no
    rollout submitted ahead (the loop submits none while such a checkpoint is due, so a
    checkpoint never holds one in flight); with either on, also at the start (step 0)."""

    def __init__(self, cfg: Config) -> None:
        self.every_steps = cfg.run.checkpoint_every_steps
        self.every_s = cfg.run.checkpoint_every_minutes * 60.0
        self.last = time.monotonic()

    @property
    def enabled(self) -> bool:
        return bool(self.every_steps or self.every_s)

    def time_due(self) -> bool:
        return bool(self.every_s) and time.monotonic() - self.last >= self.every_s

    def at_step(self, next_step: int) -> bool:
        """A step-count checkpoint falls on the boundary before ``next_step``."""
        return bool(self.every_steps) and next_step % self.every_steps == 0

    def saved(self) -> None:
        self.last = time.monotonic()


@dataclass
class Checkpoints:
    """Save and restore a run: the executor, the group source and the driver's counters."""

    cfg: Config
    ex: Executor
    source: GroupSource
    run_dir: Path
    runlog: RunLog
    learner_restarts: int = 0  # new learner groups so far (run.max_learner_restarts bounds it)
    writer: BackgroundWriter = field(default_factory=BackgroundWriter)  # run.checkpoint_async

    def save(
        self,
        next_step: int,
        base: dict[str, float],
        totals: dict[str, float],
        *,
        wait: bool = False,
    ) -> None:
        """Stage the checkpoint in a local folder (executor files + ``driver.pt``) and publish
        it to the run's storage (``run.storage``, else ``run_dir/checkpoints``) with its
        manifest. With ``run.checkpoint_async`` the state is snapshotted into host memory
        here and written by the background writer (:mod:`~maskgrpo_ray.loop.snapshot`; the
        previous write is waited for first); ``wait``: and this one too."""
        cfg, t0 = self.cfg, time.monotonic()
        asynchronous = cfg.run.checkpoint_async
        self.writer.wait()  # one write at a time; a failed one raises here
        executor = self.ex.snapshot() if asynchronous else self.ex.save
        state = {"next_step": next_step, "base": base, "totals": totals}
        state = {**state, "source": self.source.state_dict()}
        adapter = None
        if cfg.model.lora is not None:  # the adapter, as peft saves it (eval reads it)
            adapter = self.ex.policy_state()
        if asynchronous:
            state, adapter = host_copy(state), host_copy(adapter)

        def write(folder: Path) -> None:
            executor(folder)
            torch.save(state, folder / "driver.pt")
            if adapter is not None and cfg.model.lora is not None:
                from maskgrpo_ray.models.lora import save_adapter

                save_adapter(folder / "adapter", adapter, cfg.model.lora)

        store = run_store(cfg.run, self.run_dir)
        if not asynchronous:
            where = store.save(next_step, write, cfg.run.keep_checkpoints)
            self.writer.last_write_s = self.writer.last_snapshot_s = time.monotonic() - t0
            log.info("checkpoint %s (%.2f s)", where, self.writer.last_write_s)
            return
        self.writer.last_snapshot_s = time.monotonic() - t0
        log.info("checkpoint step %d: snapshot %.2f s", next_step, self.writer.last_snapshot_s)
        self.writer.submit(
            lambda: store.save(next_step, write, cfg.run.keep_checkpoints),
            f"checkpoint step {next_step}",
        )
        if wait:
            self.writer.wait()

    def flush(self) -> None:
        """Wait for a background checkpoint write (none in flight: returns at once)."""
        self.writer.wait()

    def whole_save_s(self) -> float:
        """The seconds the last checkpoint took from its start to its publication: the write
        alone (synchronous), or the snapshot plus the background write (``run.checkpoint_async``)."""
        w = self.writer
        if self.cfg.run.checkpoint_async:
            return w.last_snapshot_s + w.last_write_s
        return w.last_write_s

    def remove_stale_staging(self) -> None:
        """Staging folders a crashed write left (``.tmp-step_*``): removed at the run's start."""
        for gone in run_store(self.cfg.run, self.run_dir).remove_staging():
            log.warning("removed the staging folder of an unfinished checkpoint write: %s", gone)

    def restore(self, folder: Path) -> tuple[int, dict, dict]:
        """Executor, group source and driver counters from a checkpoint: (next step, base,
        totals). ``folder`` is a local, verified copy (``CheckpointStore.fetch_valid``)."""
        check_pickles(folder)  # DeepSpeed unpickles its files freely: nothing foreign in them
        state = load_torch_file(folder / "driver.pt", "a checkpoint's driver state")
        self.ex.load(folder)
        source = state.get("source")
        if source is None:  # a checkpoint written before the group source kept the filter
            old = load_torch_file(folder / "executor.pt", "a checkpoint's executor state")
            source = {"stream": state["stream"], "filter": old.get("filter")}
        self.source.load_state_dict(source)
        start_step = int(state["next_step"])
        why = f"the run goes on from checkpoint {folder.name}"
        self.runlog.supersede(start_step, RUN_ENDS, why)  # the rows it replaces, kept aside
        log.info("resumed from %s at step %d", folder, start_step)
        return start_step, dict(state["base"]), dict(state["totals"])

    def roll_back(self, lost: LearnerLost, redo: RunCursor) -> RunCursor:
        """After a lost learner rank: a new learner group and the cursor the loop goes on from
        (:meth:`recover_learner`), tried again while the new group is itself lost during its
        restore (a second fault in the recovery); each try counts against
        ``run.max_learner_restarts``."""
        while True:
            self.learner_restarts += 1
            try:
                return self.recover_learner(lost, self.learner_restarts, redo)
            except LearnerLost as again:
                log.warning("the new learner group was lost during its restore: %s", again)
                lost = again

    def recover_learner(self, lost: LearnerLost, attempt: int, redo: RunCursor) -> RunCursor:
        """A new learner group, and the executor, the source, the driver's counters and
        ``metrics.jsonl`` rolled back to the newest valid checkpoint (:meth:`restore`): the
        cursor at it. The steps after it run again, so none is lost or trained twice. With no
        checkpoint (both cadences 0): the new group starts from the rollout actors' weights with
        fresh optimizer state, announced in one warning and counted (``learner_fallbacks``),
        and the loop goes on from ``redo``. Bounded by ``run.max_learner_restarts``; past it,
        :class:`RunFailed`."""
        cfg, run_dir = self.cfg, self.run_dir
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
        try:  # the newest checkpoint is the one being written, if any
            self.flush()
        except RuntimeError as err:  # e.g. the lost rank took its snapshot's chunks with it
            log.warning(
                "%s: the checkpoint being written when the learner was lost failed (%s); it is "
                "discarded (never published) and the run rolls back to the newest published one",
                lost,
                err,
            )
        t0 = time.monotonic()
        with tempfile.TemporaryDirectory(prefix=".recover-", dir=run_dir) as scratch:
            folder = store.fetch_valid(Path(scratch))
            if folder is None:
                self._continue_from_rollouts(lost, store.location)
                return redo
            log.warning(
                "%s: restoring the learner group and the run from checkpoint %s (attempt %d of %d)",
                lost,
                folder.name,
                attempt,
                budget,
            )
            try:
                self.ex.restart_learner(lost)
            except Exception as err:
                raise RunFailed(
                    f"{lost}; a new learner group could not be started ({err}). Newest "
                    f"checkpoint: {store.location}/{folder.name}; resume it with `{resume}`"
                ) from err
            step, base, totals = self.restore(folder)
        log.warning(
            "learner restored in %.1f s; the run continues at step %d", time.monotonic() - t0, step
        )
        return RunCursor(step, step, base=base, totals=totals)

    def _continue_from_rollouts(self, lost: LearnerLost, location: str) -> None:
        cfg = self.cfg
        log.warning(
            "%s; no checkpoint at %s (run.checkpoint_every_steps=%d, "
            "run.checkpoint_every_minutes=%g): the learner continues from the rollout actors' "
            "weights with fresh optimizer state, so the run is no longer the one an "
            "uninterrupted run would be (counted in learner_fallbacks; set either cadence > 0 "
            "for an exact roll-back)",
            lost,
            location,
            cfg.run.checkpoint_every_steps,
            cfg.run.checkpoint_every_minutes,
        )
        try:
            self.ex.restart_learner(lost, from_rollouts=True)
        except LearnerLost:  # the new group lost in its first sync: the caller tries again
            raise
        except Exception as err:
            raise RunFailed(
                f"{lost}; a new learner group could not be started from the rollout actors' "
                f"weights ({err}) and the run has no checkpoint at {location}"
            ) from err


class StepAbandoned(Exception):
    """Raised in the driver's thread when a preempted step would overrun the grace period."""


class Preemption:
    """SIGTERM/SIGINT during the step loop: a flag the loop checks between steps. (The run's
    actors and its own local cluster keep serving meanwhile: ``actors.base.outlive_sigterm``,
    ``backend.cluster.sigterm_blocked``.)

    A signal during a step lets the step finish, unless it would leave too little of
    ``grace_s`` for the checkpoint (the longest save seen so far plus a margin): then a
    SIGALRM at that moment raises :class:`StepAbandoned` and the step's partial work is
    dropped (the previous checkpoint stays the resume point). A second signal abandons at once.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, grace_s: float, writer: BackgroundWriter | None = None) -> None:
        self.grace_s = grace_s
        self.signal_name: str | None = None
        self.t_signal = 0.0
        self.save_s = 0.0  # the longest whole checkpoint so far (snapshot + write)
        self.writer = writer  # run.checkpoint_async's: a write in flight finishes first
        self.in_step = False
        self._previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    def seconds_left(self) -> float:
        return self.grace_s - (time.monotonic() - self.t_signal)

    def reserve_s(self) -> float:
        """Time kept back for the checkpoint and the exit: the checkpoint before exit (a whole
        one, ``save_s``: the start's checkpoint is written in the foreground so that it is known
        from the first step) and, while a background write is in flight, that write (the save
        waits for it; at most one more whole checkpoint), with half again as margin, plus
        ``min(5 s, a tenth of the grace period)`` for the exit."""
        in_flight = self.save_s if self.writer is not None and self.writer.busy else 0.0
        return (self.save_s + in_flight) * 1.5 + min(5.0, 0.1 * self.grace_s)

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
            log.warning("second %s: the checkpoint before exit goes on (nothing is lost)", name)
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

    def checkpoint_before_exit(
        self,
        ckpts: Checkpoints,
        next_step: int,
        saved_step: int | None,
        base: dict[str, float],
        totals: dict[str, float],
    ) -> int | None:
        """After a signal: checkpoint at ``next_step`` unless one is there or time is too
        short. Returns the step a resume continues at (None: no checkpoint)."""
        if next_step == saved_step:
            return saved_step
        left, need = self.seconds_left(), self.reserve_s()
        if left < need:
            log.warning(
                "%s: %.1f s of the grace period left, a checkpoint needs about %.1f s: none "
                "written; a resume continues at %s",
                self.signal_name,
                left,
                need,
                "step 0" if saved_step is None else f"step {saved_step}",
            )
            return saved_step
        ckpts.save(next_step, base, totals, wait=True)
        return next_step
