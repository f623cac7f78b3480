"""What the driver's loop calls: the :class:`Executor` of a backend, and the phase timer.

Two backends implement it: ``local.LocalExecutor`` (one process, the baseline and the
reference) and ``backend.ray_executor.RayExecutor`` (rollout, reward, filter and learner actors on a
Ray cluster). The part a :class:`~maskgrpo_ray.loop.collect.GroupSource` uses (generate, score,
filter) is :class:`GroupWork`; the loop itself calls update, sync, evaluate, save and load; the
``train`` command calls the rest (prompt checks and metadata, the step-end hook, shutdown).

Ground floor of the loop: this module imports only the messages (``pipeline.messages``, ``pipeline.data_plane``),
and those only for annotations.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from maskgrpo_ray.pipeline.data_plane import Traffic
    from maskgrpo_ray.pipeline.messages import Chunk, FilterResult, ScoredBatch, TrainBatch


class PhaseTimer:
    """Seconds per named phase, summed over the phase's calls."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0


class GroupWork(Protocol):
    """What a backend does for the group source: generate and score chunks, decide groups."""

    def generate_and_score(self, chunks: list[Chunk], traffic: Traffic) -> ScoredBatch:
        """Every chunk's groups, generated (each chunk with its own seed) and scored, in chunk
        order; the bytes the driver moves for it are added to ``traffic``. On Ray the rollout
        stays in the object store (``scored.rollout`` is a ``data_plane.RolloutRefs``)."""

    @property
    def chunk_prompts(self) -> int:
        """Prompts per rollout chunk (the unit of work and of seeding) for the next step."""

    def filter(self, scored: ScoredBatch, traffic: Traffic) -> FilterResult:
        """Keep / drop / invalid per group, recording every valid group in the std history."""

    def filter_stats(self) -> dict[str, float]:
        """The filter's figures after its last decision."""

    def filter_state(self) -> dict[str, Any] | None:
        """The filter's state (what a checkpoint and a rewind restore; None: no filter)."""

    def load_filter_state(self, state: dict[str, Any] | None) -> None: ...


class Executor(GroupWork, Protocol):
    """Where the phases run. Every method is synchronous from the driver's point of view."""

    policy_version: int
    runs_ahead: bool  # a step's rollouts can run in the background during an update

    def update(self, batch: Any) -> dict[str, float]: ...

    def sync_weights(self) -> float: ...

    def refresh_reward(self, step: int, scored: ScoredBatch | None) -> dict[str, float]:
        """After step ``step``'s update: ``reward.refresh``'s training of the learned reward on
        the step's samples ``scored`` when due (``pipeline.reward_refresh``); its figures."""

    def evaluate(
        self, prompts: list[str], tags: list[str | None] | None = None, *, probe: bool = False
    ) -> dict[str, float]:
        """Held-out evaluation with fixed seeds (``evaluation.generation``); ``probe``: the
        monitor probe's figures too (``PROBE_FIGURES``: the image statistics and, where the
        backend holds the base, the KL to it)."""

    def eval_images(self, prompts: list[str]) -> torch.Tensor:
        """Images of ``prompts`` under the evaluation sampler with a fixed seed (the run's
        per-tag grid, ``evaluation.generation.grid_unit``): uint8 ``[N, H, W, 3]``."""

    def policy_state(self) -> dict[str, torch.Tensor]:
        """The learner's trained tensors on the CPU (what a weight sync sends), or their EMA
        under ``train.ema_decay``: the policy a run evaluates, checkpoints as an adapter and
        exports (``evaluate`` and ``eval_images`` use the EMA too; rollouts never do)."""

    def extra_metrics(self) -> dict[str, float]: ...

    def save(self, folder: Path) -> None:
        """Write weights, optimizer, RNG streams and version into ``folder``."""

    def snapshot(self) -> Callable[[Path], None]:
        """What :meth:`save` writes, taken now into host memory; the returned call writes it
        into a folder later, on any thread (``run.checkpoint_async``)."""

    def load(self, folder: Path) -> None:
        """Restore what :meth:`save` wrote."""

    def probe_rollouts(self, chunks: list[Chunk]) -> list[ScoredBatch]:
        """The step-signal probe's batches, one per chunk, generated with the current weights
        and scored with the run's reward, whole (images dropped); nothing of the run's own
        collection (prompt stream, filter, seeds) is touched."""

    def step_signal(
        self, real: list[TrainBatch], shuffled: list[TrainBatch]
    ) -> tuple[Any, list[int] | None]:
        """The step-signal measurement of the probe batches on the learner's current weights
        (a ``loop.step_signal_probe.StepSignal``), and the ``auto`` selection it leaves in force
        (None: the selection is not ``auto``)."""

    def restart_learner(self, lost: Exception, *, from_rollouts: bool = False) -> None:
        """A new learner after ``lost`` (:class:`LearnerLost`); :meth:`load` restores it. With
        ``from_rollouts`` (no checkpoint to restore) it starts from the rollout actors' weights
        and version, with fresh optimizer state, and the rollout actors are re-synced."""

    # the train command's calls (maskgrpo_ray.cli.app.run_train)

    def check_prompts(self, prompts: list[str]) -> list[str | None]:
        """Per prompt, None or why the policy cannot read it (the command drops those)."""

    def set_prompt_metadata(self, table: dict[str, Any]) -> None:
        """Prompt text -> its metadata, for rewards that read it (``uses_prompt_metadata``)."""

    def on_step_end(self, step: int, row: dict[str, Any]) -> None:
        """After a step is logged: live control (Ray: a requested scale, the job's status)."""

    def shutdown(self) -> None: ...
