"""Which groups step ``k`` trains on: the :class:`GroupSource`.

The source owns the prompt stream, generate -> score -> filter -> re-sample (paper Section
3.3), the seed numbering of every rollout chunk, the background thread that runs the next
step's collection during an update (``rollout.max_policy_lag`` 1), and the state a checkpoint
needs (the stream's position and the filter's history). The driver's loop is the same in both
modes (the shape of slime's and verl's one-step-off trainers)::

    pending = source.submit(step)          # once, before the first step
    for step ...:
        collected = source.collect(pending) # this step's groups
        pending = source.submit(step + 1)   # if allowed: runs during the update (lag 1)
        update(collected); source.wait(pending); sync weights

With lag 0 ``submit`` is followed by ``collect`` of the same step. A backend (:class:`GroupWork`)
only generates and scores the chunks it is given and decides groups with its filter; the
local backend does the work inside ``submit`` (with the weights before the update, which is
exactly lag-1 semantics), the Ray backend in a thread while the learner trains.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from maskgrpo_ray.loop.executor import Executor, GroupWork, PhaseTimer
from maskgrpo_ray.pipeline.data_plane import Traffic
from maskgrpo_ray.pipeline.messages import (  # Chunk: the message, importable from here too
    Chunk,
    ScoredBatch,
)
from maskgrpo_ray.pipeline.settings import StepSettings

if TYPE_CHECKING:
    from maskgrpo_ray.config import Config

GROUP_STATS = ("groups_generated", "groups_dropped", "groups_invalid", "groups_exhausted")


def chunk_seed(run_seed: int, step: int, attempt: int, index: int) -> int:
    """The rollout seed of a chunk: a function of (run seed, driver step, re-sample attempt
    within the step, chunk index) only: never of the actor that runs it, of the backend, or of
    whether the step's rollouts ran ahead."""
    return ((((run_seed * 1_000_003) + step) * 10_007 + attempt) * 1_009 + index) % (2**63 - 1)


def make_chunks(
    prompts: list[str], positions: list[int], size: int, seed_of: Callable[[int], int]
) -> list[Chunk]:
    """Cut ``prompts`` into chunks of ``size``; ``seed_of(index)`` gives each chunk's seed."""
    return [
        Chunk(i, prompts[s : s + size], positions[s : s + size], seed_of(i))
        for i, s in enumerate(range(0, len(prompts), size))
    ]


def chunk_prompts_of(prompts_per_chunk: int, prompts_per_step: int, rollout_actors: int) -> int:
    """Prompts per chunk: ``rollout.prompts_per_chunk``, or 0 for ``ceil(B / actors)`` (one
    chunk per rollout actor). Both backends cut a step the same way, so they seed it the same
    way."""
    return prompts_per_chunk or -(-prompts_per_step // max(1, rollout_actors))


def seeded_chunks(
    prompts: list[str],
    positions: list[int],
    size: int,
    run_seed: int,
    step: int,
    attempt: int = 0,
) -> list[Chunk]:
    """A step's (re-sample attempt's) prompts in chunks of ``size``, each with its seed."""
    return make_chunks(prompts, positions, size, lambda i: chunk_seed(run_seed, step, attempt, i))


class PromptSource(Protocol):
    """The prompt stream (``data.PromptStream``)."""

    def take(self, n: int) -> tuple[list[str], list[int]]: ...

    def state_dict(self) -> dict[str, int]: ...

    def load_state_dict(self, state: dict[str, int]) -> None: ...


@dataclass(frozen=True)
class Collected:
    """One step's groups: every generated one (all attempts) and the ones kept for training."""

    step: int
    generated: ScoredBatch  # every group of every attempt, invalid and dropped ones included
    kept: ScoredBatch | None  # the groups to train on; None if none survived
    stats: dict[str, float]  # groups_generated / _dropped / _invalid / _exhausted
    filter_stats: dict[str, float]  # the filter's figures after this step's decisions
    seconds: dict[str, float]  # generate_score, filter
    traffic: Traffic = field(default_factory=Traffic)  # the driver's bytes for it
    ahead: bool = False  # collected while the previous step's update ran


@dataclass
class Pending:
    """A submitted step: its prompts, the state to rewind to, and the work (done or running)."""

    step: int
    prompts: list[str]
    positions: list[int]
    before: dict[str, Any]  # the source's state before the submission
    future: Future[Collected] | None = None  # running in the background
    done: Collected | None = None  # done at once


class GroupSource:
    """Which groups each step trains on (see the module docstring).

    Args:
        work: the backend's generate/score/filter.
        stream: the prompt stream.
        prompts_per_step: ``train.prompts_per_step``.
        max_resamples: ``filter.max_resamples``.
        chunk_prompts: prompts per chunk (the unit of rollout work and of seeding); None: the
            work's ``chunk_prompts`` when a step is submitted (on Ray it follows the rollout
            actor count, so a pool scaled up mid-run gets smaller chunks and all its actors
            work).
        run_seed: ``run.seed``.
        background: run a submission in a thread (the Ray backend, where the rollout actors
            hold the weights before the update until the sync); else at once, in ``submit``.
    """

    def __init__(
        self,
        work: GroupWork,
        stream: PromptSource,
        *,
        prompts_per_step: int,
        max_resamples: int,
        chunk_prompts: int | None,
        run_seed: int,
        background: bool,
    ) -> None:
        self.work, self.stream = work, stream
        self.prompts_per_step, self.max_resamples = prompts_per_step, max_resamples
        self.chunk_prompts, self.run_seed = chunk_prompts, run_seed
        self.background = background
        self._thread: ThreadPoolExecutor | None = None

    # ------------------------------------------------------------------ the loop's calls

    def submit(self, step: int, *, ahead: bool = False) -> Pending:
        """Take step ``step``'s prompts from the stream and start collecting their groups.

        ``ahead``: the previous step's update has not run yet (lag 1); in the background where
        the backend can, else at once with the weights as they are now."""
        before = self.state_dict()
        prompts, positions = self.stream.take(self.prompts_per_step)
        p = Pending(step, prompts, positions, before)
        if ahead and self.background:
            if self._thread is None:
                self._thread = ThreadPoolExecutor(1, thread_name_prefix="maskgrpo-rollouts-ahead")
            p.future = self._thread.submit(self._collect, step, prompts, positions, True)
        else:
            p.done = self._collect(step, prompts, positions, ahead)
        return p

    def wait(self, pending: Pending | None) -> None:
        """Block until ``pending``'s groups are collected (before the weights change)."""
        if pending is not None and pending.future is not None:
            pending.future.result()

    def collect(self, pending: Pending) -> Collected:
        """``pending``'s groups (waiting for them)."""
        if pending.future is not None:
            return pending.future.result()
        assert pending.done is not None
        return pending.done

    def discard(self, pending: Pending | list[Pending] | None, *, rewind: bool) -> None:
        """Drop submissions (waiting for their work to end). ``rewind``: their prompts go back
        to the stream and the filter forgets its decisions on them (the oldest one's state
        before it), so a checkpoint taken now resumes as if they had never been submitted."""
        queue = [pending] if isinstance(pending, Pending) else list(pending or [])
        for p in queue:
            if p.future is not None:
                with contextlib.suppress(Exception):  # its failure no longer matters
                    p.future.result()
        if rewind and queue:
            self.load_state_dict(min(queue, key=lambda p: p.step).before)

    def state_dict(self) -> dict[str, Any]:
        return {"stream": self.stream.state_dict(), "filter": self.work.filter_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stream.load_state_dict(state["stream"])
        self.work.load_filter_state(state["filter"])

    def shutdown(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True, cancel_futures=True)
            self._thread = None

    # ------------------------------------------------------------------ the work

    def _collect(
        self, step: int, prompts: list[str], positions: list[int], ahead: bool
    ) -> Collected:
        """Generate, score and filter; re-sample dropped groups up to ``max_resamples`` times.

        A re-sampled prompt's earlier groups stay in ``generated`` (each attempt is a group
        that was generated and scored); ``kept`` holds the groups that passed, in the order
        they passed."""
        timer, traffic = PhaseTimer(), Traffic()
        size = max(1, self.chunk_prompts or self.work.chunk_prompts)
        kept_parts: list[ScoredBatch] = []
        all_parts: list[ScoredBatch] = []
        stats = dict.fromkeys(GROUP_STATS, 0.0)
        todo_prompts, todo_pos = prompts, positions
        for attempt in range(self.max_resamples + 1):
            with timer("generate_score"):
                chunks = seeded_chunks(todo_prompts, todo_pos, size, self.run_seed, step, attempt)
                scored = self.work.generate_and_score(chunks, traffic)
            all_parts.append(scored)
            with timer("filter"):
                res = self.work.filter(scored, traffic)
            stats["groups_generated"] += len(todo_prompts)
            stats["groups_invalid"] += float(res.invalid.sum())
            dropped = ~res.keep & ~res.invalid
            stats["groups_dropped"] += float(dropped.sum())
            if res.keep.any():
                kept_parts.append(scored.groups(res.keep))
            if not dropped.any():
                break
            idx = dropped.nonzero().squeeze(1).tolist()
            todo_prompts = [todo_prompts[i] for i in idx]
            todo_pos = [todo_pos[i] for i in idx]
            if attempt == self.max_resamples:
                stats["groups_exhausted"] += len(idx)
        kept = ScoredBatch.concat(kept_parts) if kept_parts else None
        generated = ScoredBatch.concat(all_parts)
        filter_stats = self.work.filter_stats()
        return Collected(step, generated, kept, stats, filter_stats, timer.seconds, traffic, ahead)


def make_source(ex: Executor, cfg: Config, stream: Any) -> GroupSource:
    """The run's group source over ``ex`` and the prompt stream."""
    return GroupSource(
        ex,
        stream,
        prompts_per_step=cfg.train.prompts_per_step,
        max_resamples=cfg.filter.max_resamples,
        chunk_prompts=None,  # the executor's, when each step is submitted
        run_seed=cfg.run.seed,
        background=ex.runs_ahead,
    )


def steps_ahead(settings: StepSettings, step: int, stopping: bool) -> int:
    """How many steps after ``step`` may have their rollouts submitted during its update: up
    to ``rollout.max_policy_lag``, never past the last step, never across a checkpoint (so a
    checkpoint holds no rollout in flight and a resume is the run it continues), none once a
    stop is requested (``stopping``)."""
    if stopping:
        return 0
    ck, n = settings.checkpoint_every_steps, 0
    for j in range(step + 1, step + settings.max_policy_lag + 1):
        if j >= settings.steps or (ck and j % ck == 0):
            break
        n += 1
    return n
