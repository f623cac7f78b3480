"""The step loop, as phases: collect (generate, score, filter, re-sample), advantages, update,
sync, log.

One loop for both backends (``local.LocalExecutor``, ``backend.ray_executor.RayExecutor``,
through the :class:`~maskgrpo_ray.loop.executor.Executor` protocol) and both modes: a step
collects its groups from the :class:`~maskgrpo_ray.loop.collect.GroupSource`, submits the next
step's when ``rollout.max_policy_lag`` allows (they are generated with the weights before this
step's update: on Ray during the update, locally at once), updates, waits for the submitted
rollouts and syncs the weights. With lag 0 nothing is submitted ahead.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from maskgrpo_ray.config import Config
from maskgrpo_ray.evaluation.weights import export_final_policy
from maskgrpo_ray.loop.collect import GroupSource, Pending, make_source, steps_ahead
from maskgrpo_ray.loop.executor import Executor, PhaseTimer
from maskgrpo_ray.loop.figures import (
    StepOutcome,
    closing_figures,
    collected_figures,
    count_step,
    grid_due,
    run_summary,
)
from maskgrpo_ray.loop.held_out import BaseDigest, EvalSet, evaluate_base, evaluate_held_out
from maskgrpo_ray.loop.monitoring import Monitor
from maskgrpo_ray.loop.recovery import (
    RUN_ENDS,
    Cadence,
    Checkpoints,
    Preemption,
    RunCursor,
    RunFailed,
    StepAbandoned,
)
from maskgrpo_ray.loop.staleness import check_rollout, onpolicy_check
from maskgrpo_ray.loop.step_signal_probe import StepSignalProbe
from maskgrpo_ray.pipeline.data_plane import fetch_rollout
from maskgrpo_ray.pipeline.diagnostics import group_figures
from maskgrpo_ray.pipeline.learner_core import LearnerLost
from maskgrpo_ray.pipeline.messages import TrainBatch, tensor_nbytes
from maskgrpo_ray.pipeline.phases import make_train_batch
from maskgrpo_ray.pipeline.settings import StepSettings, step_settings
from maskgrpo_ray.runlog.run_log import RunLog

__all__ = ["EvalSet", "RunFailed", "StepOutcome", "make_source", "run_step", "train"]

log = logging.getLogger(__name__)


def run_step(
    ex: Executor,
    settings: StepSettings,
    step: int,
    source: GroupSource,
    pending: list[Pending] | None = None,
    *,
    ahead: int = 0,
) -> tuple[StepOutcome, list[Pending]]:
    """One step's phases: this step's groups (the oldest of ``pending``, submitted by an
    earlier step, else submitted now), the next ``ahead`` steps' submissions topped up (their
    rollouts run during this update), advantages, update, the weight sync and the step's
    figures. With ``rollout.max_policy_lag`` 1 the sync first waits for the step submitted
    ahead (its rollouts use exactly the weights before this update: the local backend's
    reference); with a larger lag the rollouts never wait (each chunk records the version
    it used, at most ``max_policy_lag`` behind). Returns the outcome and the submissions
    still pending (oldest first)."""
    timer = PhaseTimer()
    t0 = time.perf_counter()
    queue = list(pending or [])
    current = queue.pop(0) if queue else source.submit(step)
    if current.step != step:
        raise RuntimeError(f"step {step} got the groups submitted for step {current.step}")
    with timer("wait_collect"):  # lag 0: done in submit; lag > 0: the rest of the background work
        col = source.collect(current)
    last = queue[-1].step if queue else step
    queue += [source.submit(j, ahead=True) for j in range(last + 1, step + ahead + 1)]
    row: dict[str, Any] = {"step": step, "policy_version": ex.policy_version}
    row.update(collected_figures(col))
    scored = col.kept if col.kept is not None else col.generated
    row["policy_version_lag"] = ex.policy_version - scored.rollout.policy_version
    keep = None
    if col.kept is not None:
        keep = check_rollout(
            col.kept.rollout, ex.policy_version, settings.max_policy_lag, step, row
        )
    if col.kept is not None and keep is not None and bool(keep.any()):
        with timer("advantages"):
            tb = make_train_batch(col.kept, keep, settings.advantage)
            g = col.kept.rollout.group_size
            kept = col.kept.rewards[keep.repeat_interleave(g)]
            row.update(group_figures(kept, tb.advantages, g))  # the trained groups' spread
        if isinstance(tb, TrainBatch):  # one process: the batch itself
            row["bytes/train_batch"] = float(tensor_nbytes(tb))
        with timer("update"):
            row.update(ex.update(tb))
        onpolicy_check(row, step, settings.onpolicy_ratio_tolerance)
        row["groups_trained"] = float(keep.sum())
        indices = col.kept.rollout.prompt_indices
        row["prompts_trained"] = [p for p, k in zip(indices, keep.tolist()) if k]
    else:
        row["groups_trained"], row["prompts_trained"] = 0.0, []
        log.warning(
            "step %d: no group survived scoring, filtering and the staleness check; update skipped",
            step,
        )
    if settings.max_policy_lag == 1:  # lag 1 is exact: no rollout sees the new weights
        with timer("wait_rollouts_ahead"):
            source.wait(queue[-1] if queue else None)
    if keep is not None and bool(keep.any()):
        with timer("sync"):
            row["weight_sync_seconds"] = ex.sync_weights()
    grid = None
    if grid_due(settings, step):  # the one time the driver fetches rollout tensors (Ray)
        grid = fetch_rollout(scored.rollout, images=True)
        row["bytes/driver_grid"] = float(tensor_nbytes(grid))
    row.update(col.filter_stats)
    row.update(ex.extra_metrics())
    for k, v in col.traffic.take().items():  # the collection's bytes join the update's
        if k in row:  # (a backend that counts none reports none)
            row[k] += v
    n_samples = int(col.stats["groups_generated"]) * settings.samples_per_prompt
    closing_figures(row, timer.seconds, time.perf_counter() - t0, n_samples)
    return StepOutcome(row, scored, col.generated.reward_failures, grid), queue


def _tag_grid(loop: _Loop, name: str) -> Path | None:
    """``samples/eval_tags_<name>.png``: the first held-out prompt of each GenEval tag under the
    evaluation sampler, one seed for the base and the tuned model (where the run saves grids and
    its evaluation prompts carry tags); to the trackers under ``eval_tags`` at step 0 (base:
    logged once the trackers open) or the last step (final), apart from the training samples."""
    ev = loop.eval_prompts
    if not loop.cfg.logging.sample_grid_every_steps or not isinstance(ev, EvalSet):
        return None
    first = {t: p for p, t in reversed(list(zip(ev.prompts, ev.tags))) if t is not None}
    prompts = [first[t] for t in sorted(first, key=lambda t: ev.tags.index(t))]
    if prompts:
        images = loop.ex.eval_images(prompts)
        step = 0 if name == "base" else loop.cfg.train.steps - 1
        return loop.runlog.save_sample_grid(
            images, step, len(images) // len(prompts), prompts, f"eval_tags_{name}", "eval_tags"
        )
    return None


@dataclass
class _Loop:
    """The state the step loop carries between steps."""

    cfg: Config
    settings: StepSettings  # what run_step reads, made once at the start
    ex: Executor
    source: GroupSource
    runlog: RunLog
    eval_prompts: list[str] | EvalSet
    base: dict[str, float]
    totals: dict[str, float]
    cadence: Cadence
    pending: list[Pending] = field(default_factory=list)  # submitted steps, oldest first
    # where a learner lost with no checkpoint to roll back to goes on from (RunCursor.source)
    redo: RunCursor = field(default_factory=lambda: RunCursor(0, None))
    probe: StepSignalProbe | None = None  # train.step_signal_every_steps
    monitor: Monitor | None = None  # logging.monitors
    base_grid: Path | None = None  # samples/eval_tags_base.png, drawn before the trackers open
    eval_seconds: dict[str, float] = field(default_factory=dict)  # "base", "final": wall seconds
    digest: BaseDigest | None = None  # the base weights' digest, taken once (held_out)
    base_reused: bool | None = None  # the base's evaluation read back (None: resumed)

    def step(self, step: int, stop: Preemption) -> dict[str, Any]:
        """One driver step, logged: run it, count it, evaluate and draw samples when due."""
        cfg = self.cfg
        probed = self.probe.run(step) if self.probe is not None else {}  # before the update
        if self.monitor is not None:  # the fixed probe set, before the update too
            probed.update(self.monitor.probe(step))
        pending, self.pending = self.pending, []
        # a time-based checkpoint is due: submit nothing ahead, so the next boundary is clean
        ahead = 0 if self.cadence.time_due() else steps_ahead(self.settings, step, stop.requested)
        out, self.pending = run_step(
            self.ex, self.settings, step, self.source, pending, ahead=ahead
        )
        row = out.row
        row.update(self.ex.refresh_reward(step, out.scored))  # reward.refresh, when due
        row.update(probed)
        count_step(cfg, out, self.totals)
        every = cfg.eval.every_steps
        if every and (step + 1) % every == 0 and step < cfg.train.steps - 1:
            t_eval = time.perf_counter()
            row.update(evaluate_held_out(cfg, self.ex, self.eval_prompts))
            row["time/eval"] = time.perf_counter() - t_eval  # the in-run held-out evaluation
        if out.grid is not None:
            rb = out.grid
            self.runlog.save_sample_grid(rb.images, step, rb.group_size, rb.prompts)
        if self.monitor is not None:
            row.update(self.monitor.observe(self.runlog.rows, row, self.base))
            alarm = self.monitor.stops()
            if alarm is not None and not stop.requested:  # logging.monitors.stop_on
                stop.signal_name, stop.t_signal = f"monitor alarm {alarm!r}", time.monotonic()
                log.warning("monitor alarm %r is in logging.monitors.stop_on: stopping", alarm)
        self.runlog.log_step(row)
        return row

    def drop_pending(self, *, rewind: bool) -> None:
        self.source.discard(self.pending, rewind=rewind)
        self.pending = []

    def move_to(self, at: RunCursor, bar: Any) -> RunCursor:
        """Put the loop at ``at`` (after a roll-back): the source's state, the base evaluation
        and the totals it names; the progress bar."""
        if at.source is not None:
            self.source.load_state_dict(at.source)
        self.base = self.base if at.base is None else at.base
        self.totals = self.totals if at.totals is None else at.totals
        if bar is not None:
            bar.n = at.step
            bar.refresh()
        return at


def _progress_bar(cfg: Config, start_step: int) -> Any:
    if not cfg.logging.progress_bar:
        return None
    from tqdm import tqdm

    return tqdm(total=cfg.train.steps, initial=start_step, desc="maskgrpo", unit="step")


def _start(loop: _Loop, ckpts: Checkpoints, resume_from: Path | None) -> int:
    """Restore from ``resume_from`` (the step to continue at), or evaluate the base model."""
    ckpts.remove_stale_staging()  # a crashed write's leftovers
    if resume_from is not None:
        start_step, loop.base, loop.totals = ckpts.restore(resume_from)
        return start_step
    loop.runlog.supersede(0, RUN_ENDS, "a start from step 0 (the folder has no checkpoint)")
    t0 = time.perf_counter()
    loop.base, loop.base_reused = evaluate_base(
        loop.cfg,
        loop.digest or BaseDigest(loop.ex.policy_state),
        lambda: evaluate_held_out(loop.cfg, loop.ex, loop.eval_prompts),
    )
    loop.eval_seconds["base"] = time.perf_counter() - t0
    log.info("base model: %s", loop.base)
    loop.base_grid = _tag_grid(loop, "base")
    if loop.cadence.enabled:  # the start is a checkpoint too: a lost learner can come back
        # in the foreground: its whole time sizes the SIGTERM reserve from the first step
        ckpts.save(0, loop.base, loop.totals, wait=True)
        loop.cadence.saved()
    return 0


def _steps(
    loop: _Loop, ckpts: Checkpoints, stop: Preemption, start_step: int, on_step_end: Any
) -> tuple[RunCursor, bool]:
    """The step loop: advance one step at a time or, after a lost learner, roll back to the
    cursor the recovery answers. Returns where it stopped and whether a step was abandoned."""
    saved = start_step if start_step or loop.cadence.enabled else None
    at, bar = RunCursor(start_step, saved), _progress_bar(loop.cfg, start_step)
    try:
        while at.step < loop.cfg.train.steps and not stop.requested:
            try:
                at = _advance(loop, ckpts, stop, at, on_step_end, bar)
            except LearnerLost as lost:
                loop.drop_pending(rewind=False)  # the cursor has the source's state
                at = loop.move_to(ckpts.roll_back(lost, redo=loop.redo), bar)
        loop.drop_pending(rewind=True)  # stopped: its prompts go back (the checkpoint has them)
        return at, False
    except StepAbandoned:  # its partial work is dropped: no checkpoint of this state
        loop.drop_pending(rewind=False)
        log.warning(
            "%s: step %d abandoned to stay within run.preemption_grace_seconds=%.0f",
            stop.signal_name,
            at.step,
            stop.grace_s,
        )
        return at, True
    finally:
        if bar is not None:
            bar.close()


def _advance(
    loop: _Loop,
    ckpts: Checkpoints,
    stop: Preemption,
    at: RunCursor,
    on_step_end: Any,
    bar: Any,
) -> RunCursor:
    """Step ``at.step``, then the checkpoint when one is due; the cursor after them. A learner
    lost in the step redoes it from its start, one lost writing the checkpoint goes on after
    it (``loop.redo``, when there is no checkpoint to roll back to)."""
    start = loop.pending[0].before if loop.pending else loop.source.state_dict()
    loop.redo = RunCursor(at.step, at.saved, source=start)
    with stop.step():
        row = loop.step(at.step, stop)
    at = loop.redo = RunCursor(at.step + 1, at.saved)
    if (loop.cadence.at_step(at.step) or loop.cadence.time_due()) and not loop.pending:
        ckpts.save(at.step, loop.base, loop.totals)
        loop.cadence.saved()
        # what a checkpoint before exit needs: a whole one (snapshot + the last finished write)
        stop.save_s = max(stop.save_s, ckpts.whole_save_s())
        at = RunCursor(at.step, at.step)
    if on_step_end is not None:
        on_step_end(at.step - 1, row)
    if bar is not None:
        bar.update(1)
        bar.set_postfix(reward=f"{row['reward_mean']:.3f}", sps=f"{row['samples_per_second']:.1f}")
    return at


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

    With ``resume_from`` (a local checkpoint folder) the executor, the group source (prompt
    stream, filter) and the step counter are restored and the loop continues where the
    checkpoint was taken (what the earlier attempt wrote after it is moved aside:
    ``RunLog.supersede``). SIGTERM or SIGINT during the loop stops it at a step boundary
    (:class:`~maskgrpo_ray.loop.recovery.Preemption`): a checkpoint is written, ``summary.json``
    says ``"completed": false`` and the final evaluation is skipped. A run that completes its
    steps checkpoints its last one before the final evaluation, so a resume with more
    ``train.steps`` continues it.
    """
    runlog = RunLog(run_dir)
    t_start = time.perf_counter()
    source = make_source(ex, cfg, stream)
    totals = {"samples": 0.0, "train_seconds": 0.0}
    loop = _Loop(
        cfg, step_settings(cfg), ex, source, runlog, eval_prompts, {}, totals, Cadence(cfg)
    )
    if cfg.train.step_signal_every_steps:
        loop.probe = StepSignalProbe(cfg, ex, list(stream.prompts), loop.settings.advantage)
    loop.digest = BaseDigest(ex.policy_state)  # what the base evaluation and probe share
    if cfg.logging.monitors.enabled:
        loop.monitor = Monitor(cfg, ex, eval_prompts, loop.digest)
        runlog.monitor_rules = loop.monitor.rules  # monitors.png beside the reward curve
    ckpts = Checkpoints(cfg, ex, source, run_dir, runlog)
    start_step = _start(loop, ckpts, resume_from)
    lc = cfg.logging
    config = cfg.model_dump(mode="json")
    with runlog.tracking(lc.trackers, lc.tracker_args, config, start_step, cfg.run.name):
        if loop.base_grid is not None:
            runlog.trackers.log_image(0, "eval_tags", loop.base_grid)
        return _run(loop, ckpts, run_dir, start_step, t_start, on_step_end)


def _run(
    loop: _Loop,
    ckpts: Checkpoints,
    run_dir: Path,
    start_step: int,
    t_start: float,
    on_step_end: Any,
) -> dict[str, Any]:
    """The step loop under the preemption handler, then the end of a stopped or a whole run."""
    stop = Preemption(loop.cfg.run.preemption_grace_seconds, ckpts.writer)
    stop.save_s = ckpts.whole_save_s()  # the start's checkpoint (0 on a resume until one)
    stop.install()  # until the last checkpoint is written: a second signal loses nothing
    try:
        try:
            at, abandoned = _steps(loop, ckpts, stop, start_step, on_step_end)
            next_step, saved_step = at.step, at.saved
        finally:
            loop.source.shutdown()
            ckpts.flush()  # a background write finishes (or raises) before the run ends
        if not stop.requested and saved_step != next_step:
            # the run's end is a checkpoint: a resume with more steps goes on
            ckpts.save(next_step, loop.base, loop.totals, wait=True)
            saved_step = next_step
        if stop.requested:
            return _stopped(
                loop, ckpts, stop, (start_step, next_step, saved_step), abandoned, t_start
            )
    finally:
        stop.uninstall()
    return _finish(loop, run_dir, start_step, t_start)


def _stopped(
    loop: _Loop,
    ckpts: Checkpoints,
    stop: Preemption,
    steps: tuple[int, int, int | None],
    abandoned: bool,
    t_start: float,
) -> dict[str, Any]:
    """The end of a run stopped by a signal: the checkpoint before exit (unless the step was
    abandoned or the checkpoint is there) and ``summary.json`` with ``"completed": false``."""
    cfg, (start_step, next_step, saved_step) = loop.cfg, steps
    resume_at = saved_step
    if not abandoned:
        resume_at = stop.checkpoint_before_exit(
            ckpts, next_step, saved_step, loop.base, loop.totals
        )
    loop.runlog.plot_reward_curve()
    summary = run_summary(
        cfg, loop.ex.policy_version, start_step, loop.base, {}, loop.totals, t_start
    )
    summary.update(eval_prompts=len(loop.eval_prompts), completed=False, steps_done=next_step)
    summary.update(stopped_by=stop.signal_name, resume_step=resume_at)
    loop.runlog.write_summary(summary)
    log.warning(
        "stopped by %s %.1f s after it, %d of %d steps done; run the same command to resume",
        stop.signal_name,
        stop.grace_s - stop.seconds_left(),
        next_step,
        cfg.train.steps,
    )
    return summary


def _finish(loop: _Loop, run_dir: Path, start_step: int, t_start: float) -> dict[str, Any]:
    """The final evaluation, the exported policy, the reward curve and ``summary.json``."""
    cfg, ex = loop.cfg, loop.ex
    t0 = time.perf_counter()
    final = evaluate_held_out(cfg, ex, loop.eval_prompts)
    loop.eval_seconds["final"] = time.perf_counter() - t0
    log.info("tuned model: %s", final)
    _tag_grid(loop, "final")
    if cfg.run.export_final_policy:
        info: dict[str, Any] = {"step": cfg.train.steps, "policy_version": ex.policy_version}
        info["model_kind"] = cfg.model.kind
        paths = export_final_policy(run_dir, cfg, ex.policy_state(), info)
        log.info(
            "final policy: %s (maskgrpo eval --weights %s)", ", ".join(map(str, paths)), run_dir
        )
    loop.runlog.plot_reward_curve()
    summary = run_summary(
        cfg, ex.policy_version, start_step, loop.base, final, loop.totals, t_start
    )
    probe_reused = loop.monitor.reused if loop.monitor else None  # eval.reuse_base_evaluation
    summary.update(eval_prompts=len(loop.eval_prompts), completed=True)
    summary.update(base_eval_reused=loop.base_reused, probe_reused=probe_reused)
    # the held-out evaluations' wall seconds (the base's absent on a resumed run)
    summary.update({f"{k}_eval_seconds": v for k, v in loop.eval_seconds.items()})
    loop.runlog.write_summary(summary)
    return summary
