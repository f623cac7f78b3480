"""RayExecutor: the Executor protocol of ``loop/driver.py`` on a Ray cluster.

The executor keeps the learner side and the wiring: a :class:`learner.group.LearnerGroup` of
DeepSpeed ranks updates, saves and loads (and is replaced when a rank is lost); one filter actor
keeps the std history (``backend.filter.RemoteFilter``); a control actor carries ``maskgrpo scale``
and ``maskgrpo status``. The rollout and reward actors belong to the
:class:`~maskgrpo_ray.backend.fleet.RolloutFleet` (pools, healing, scaling, prompt metadata, the
weight sync's membership, behind one lock): chunks run through it, weights are pushed through
it. Every actor gets the typed settings of its role (``maskgrpo_ray.pipeline.settings``), never the
config.

Threads: the driver's main thread calls every method here; with ``rollout.max_policy_lag`` >=
1 the group source's collection thread calls :meth:`generate_and_score` and :meth:`filter`
(one submission at a time, so the filter actor is never asked by both). What those reach that
the main thread also changes is the fleet's, under its lock.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray
import torch

from maskgrpo_ray.backend.checkpoint import load_learner, snapshot_learner
from maskgrpo_ray.backend.control import ControlChannel
from maskgrpo_ray.backend.filter import RemoteFilter
from maskgrpo_ray.backend.fleet import RolloutFleet
from maskgrpo_ray.cluster.attach import ClusterHandle, connect, disconnect
from maskgrpo_ray.cluster.ray_metrics import process_metrics
from maskgrpo_ray.config import Config
from maskgrpo_ray.evaluation.generation import PROBE_FIGURES, grid_unit, make_units, summarize
from maskgrpo_ray.learner.group import LearnerGroup
from maskgrpo_ray.learner.weight_sync import WeightSync, make_weight_sync
from maskgrpo_ray.loop.collect import chunk_prompts_of
from maskgrpo_ray.loop.step_signal_probe import StepSignal
from maskgrpo_ray.models.registry import prepare_model
from maskgrpo_ray.pipeline.data_plane import Traffic, TrainRefs
from maskgrpo_ray.pipeline.messages import Chunk, FilterResult, ScoredBatch, TrainBatch
from maskgrpo_ray.pipeline.settings import settings_from_config

log = logging.getLogger(__name__)


class RayExecutor:
    """Generate, score, filter and update with Ray actors (see the module docstring).

    A step's rollouts can run in the background during the update (``runs_ahead``): the
    rollout actors keep the weights before the update until the driver syncs after them.

    Args:
        cfg: the validated config; turned into per-role settings once, here.
        chunk_prompts: prompts per rollout request (the unit of pull-based work); default
            ``rollout.prompts_per_chunk``, where 0 means ``ceil(B / rollout actors)``.
        timeout_s: longest wait for any single actor call.
        include_dashboard: for a new local cluster (None: Ray's default).
        weight_sync: learner -> rollout transport (default: the object store).
    """

    def __init__(
        self,
        cfg: Config,
        *,
        chunk_prompts: int | None = None,
        timeout_s: float = 600.0,
        include_dashboard: bool | None = None,
        weight_sync: WeightSync | None = None,
    ) -> None:
        self.settings = s = settings_from_config(cfg)
        self.run_seed, self.run_name = cfg.run.seed, cfg.run.name
        self.fixed_chunk_prompts = chunk_prompts or cfg.rollout.prompts_per_chunk
        self.prompts_per_step, self.timeout_s = cfg.train.prompts_per_step, timeout_s
        self.cluster: ClusterHandle = connect(
            cfg.run.ray_address, cfg.run.num_cpus, include_dashboard, cfg.run.num_gpus
        )
        self.metrics = process_metrics()
        prepare_model(cfg.model)  # the kind's one-off preparation (toy: pre-train, cache)
        self.policy_version = 0
        self.runs_ahead = True
        self.last_sync_bytes = 0
        self.syncs_adapter = cfg.model.lora is not None  # LoRA: the sync moves the adapter only
        self.ema = s.update.ema_decay > 0  # learner rank 0 keeps the EMA (learner.ema_rank)
        self.traffic = Traffic()  # the driver's data-plane bytes (data_plane.Traffic)
        self.live = ControlChannel(cfg.run.name, timeout_s)  # maskgrpo scale / status
        self.last_recovery_s = 0.0
        # (time.monotonic(), role, "lost" | "replaced" | "restored"): when faults were seen
        # and healed, for operators' logs and the fault drill (bench/fault_drill.py)
        self.events: list[tuple[float, str, str]] = []
        sync = weight_sync or make_weight_sync(
            s.learner.weight_sync, s.learner.weight_sync_bucket_bytes, timeout_s
        )
        # the rollout and reward actors: pools, healing, scaling, the sync's membership
        self.fleet = RolloutFleet(s, timeout_s, self.metrics, sync, self._event)
        self.filters = RemoteFilter(s.filter, timeout_s, self.metrics, self._event)
        self.fleet.spawn(cfg.rollout.num_actors, cfg.reward.num_actors)
        self.learner = LearnerGroup(s, timeout_s)  # built while the actors build their models
        self.fleet.wait_ready()
        self.filters.wait_ready()
        self.fleet.attach(self.learner)
        self.sync_weights()  # version 0: every replica starts from the learner's weights

    def _event(self, role: str, what: str) -> None:
        """A fault seen or healed (the fleet's and the filter's), for :attr:`events`."""
        self.events.append((time.monotonic(), role, what))
        if role == "filter" and what == "lost":
            self.counters["filter_actors_lost"] = self.counters.get("filter_actors_lost", 0.0) + 1
        if what == "replaced":  # the healer timed it
            healer = self.filters if role == "filter" else self.fleet
            self.last_recovery_s = healer.last_recovery_s

    @property
    def chunk_prompts(self) -> int:
        """``rollout.prompts_per_chunk``, or ``ceil(B / rollout actors now)`` (0, the default):
        a pool scaled up or down between steps keeps every actor busy. With the configured
        actor count this is the local backend's chunking, so both seed a step alike."""
        n = len(self.fleet.rollouts)
        return chunk_prompts_of(self.fixed_chunk_prompts, self.prompts_per_step, n)

    @property
    def control(self) -> Any:
        """The control actor's handle (``ControlChannel.actor``; started again if lost)."""
        return self.live.actor

    @property
    def counters(self) -> dict[str, float]:
        return self.fleet.counters

    @property
    def chunks_by_actor(self) -> dict[int, int]:
        return self.fleet.scheduler.chunks_by_actor

    # ------------------------------------------------------------------ the learner

    def restart_learner(self, lost: Exception, *, from_rollouts: bool = False) -> None:
        """Replace the whole learner group after ``lost`` (its state is gone): the old ranks
        are killed (survivors may be stuck in a collective with the lost one) and a new group
        is started with the base weights. The caller restores it from a checkpoint
        (:meth:`load`), which also re-syncs the rollout actors. ``from_rollouts`` (no
        checkpoint): the new group starts from the newest weights a rollout actor holds, at
        that version, with fresh optimizer state, and every rollout actor is synced to it."""
        self._event("learner", "lost")
        t0 = time.perf_counter()
        log.warning("%s: killing the learner group and starting a new one", lost)
        self.learner.shutdown(graceful=False)
        planner = self.learner.planner.state()
        initial, version = self.fleet.newest_weights() if from_rollouts else (None, 0)
        self.learner = LearnerGroup(self.settings, self.timeout_s, initial)
        self.fleet.attach(self.learner)
        self.counters["learner_restarts"] = self.counters.get("learner_restarts", 0.0) + 1
        if from_rollouts:
            self.learner.planner.load_state(planner)
            self.learner.version = self.policy_version = version
            self.sync_weights()
            self.counters["learner_fallbacks"] = self.counters.get("learner_fallbacks", 0.0) + 1
            if self.ema:
                log.warning("the EMA (train.ema_decay) starts again from those weights")
            self.metrics.count("maskgrpo_learner_fallbacks_total")
            self._event("learner", "restored")
        why = getattr(lost, "why", "died")
        self.metrics.count("maskgrpo_actors_lost_total", tags={"role": "learner", "why": why})
        self.metrics.count("maskgrpo_actor_restarts_total", tags={"role": "learner"})
        self.last_recovery_s = time.perf_counter() - t0

    def update(self, batch: TrainBatch | TrainRefs) -> dict[str, float]:
        """One learner update. A ``TrainRefs`` (the driver's loop): each rank is sent its plan
        and the chunk references and fetches its groups itself. (A rollout actor replaced with
        no sibling left waits for it: ``RolloutFleet.learner_busy``.)"""
        with self.fleet.learner_busy:
            metrics = self.learner.update(batch, self.traffic)
            self.policy_version = self.learner.version
        return metrics

    def sync_weights(self) -> float:
        """Push the learner's weights (version = updates so far) to every rollout actor."""
        rep = self.fleet.push(self.learner.version)
        self.metrics.observe("maskgrpo_weight_sync_seconds", rep.seconds)
        what = "adapter" if self.syncs_adapter else "weights"
        if not self.last_sync_bytes:
            log.info(
                "weight sync moves the %s: %d bytes per rollout actor", what, rep.bytes_per_target
            )
        self.metrics.gauge("maskgrpo_weight_bytes", rep.bytes_per_target, tags={"what": what})
        self.metrics.gauge("maskgrpo_policy_version", self.learner.version)
        self.last_sync_bytes = rep.bytes_per_target
        return rep.seconds

    def refresh_reward(self, step: int, scored: ScoredBatch | None) -> dict[str, float]:
        """``reward.refresh`` is the local backend's only: the config refuses it on Ray."""
        return {}

    def policy_state(self) -> dict[str, torch.Tensor]:
        """Learner rank 0's trained tensors (their EMA under ``train.ema_decay``), fetched into
        the driver (at the run's end; a LoRA run's checkpoints too)."""
        ref = self.learner.ema_ref() if self.ema else self.learner.weights_ref()
        return ray.get(ref, timeout=self.timeout_s)

    def _evaluated(self) -> ray.ObjectRef | None:
        """The weights evaluation uses, when not the rollout actors' own: rank 0's EMA (each
        evaluation call swaps it in and back out, ``RolloutActor.eval_unit``: rollouts running
        meanwhile, with ``rollout.max_policy_lag`` >= 1, keep the live weights)."""
        return self.learner.ema_ref() if self.ema else None

    # ------------------------------------------------------------------ phases

    def generate_and_score(self, chunks: list[Chunk], traffic: Traffic) -> ScoredBatch:
        """Every chunk generated and scored, in chunk order. The rollout stays in the object
        store: ``scored.rollout`` is a ``data_plane.RolloutRefs`` (the driver fetched a small
        meta and the rewards of each chunk)."""
        return self.fleet.run_chunks(chunks, traffic)

    def filter(self, scored: ScoredBatch, traffic: Traffic) -> FilterResult:
        """The filter actor's decision (``backend.filter.RemoteFilter``: a dead filter actor is
        restarted from the state after its last decision and asked again)."""
        return self.filters.decide(scored.rewards, scored.rollout.group_size, traffic)

    def filter_stats(self) -> dict[str, float]:
        return self.filters.stats()

    def filter_state(self) -> dict[str, Any]:
        return self.filters.state_dict()

    def load_filter_state(self, state: dict[str, Any] | None) -> None:
        self.filters.load_state_dict(state or {})  # None (no filter state): an empty one

    def probe_rollouts(self, chunks: list[Chunk]) -> list[ScoredBatch]:
        """The step-signal probe's batches, spread over the rollout actors as an evaluation is
        (``RolloutActor.probe_chunk``: generated with the chunk's seed, scored there)."""
        return self.fleet.map_rollout(
            chunks, lambda h, c: h.probe_chunk.remote(c.prompts, c.positions, c.seed)
        )

    def step_signal(
        self, real: list[TrainBatch], shuffled: list[TrainBatch]
    ) -> tuple[StepSignal, list[int] | None]:
        """The measurement on the learner ranks (``LearnerGroup.step_signal``), and the
        ``auto`` selection it leaves in the learner group's planner."""
        with self.fleet.learner_busy:
            real_gram, shuffled_gram = self.learner.step_signal(real, shuffled)
        signal = StepSignal.of_grams(real_gram, shuffled_gram)
        return signal, self.learner.planner.observe(signal)

    def evaluate(
        self, prompts: list[str], tags: list[str | None] | None = None, *, probe: bool = False
    ) -> dict[str, float]:
        """Held-out evaluation spread over every rollout actor: fixed-seed units
        (``evaluation.generation``), so the figures do not depend on the actor count; per
        GenEval tag too when ``tags`` (one per prompt) are given. ``probe``: the image
        statistics too, and the KL to the base each rollout actor keeps
        (``EvalSettings.probe_kl``). Under ``train.ema_decay`` the units run with learner rank
        0's EMA."""
        units, weights = make_units(prompts, self.settings.eval), self._evaluated()
        per_unit = self.fleet.map_rollout(units, lambda h, u: h.eval_unit.remote(u, weights, probe))
        return summarize(per_unit, tags, PROBE_FIGURES if probe else ())

    def eval_images(self, prompts: list[str]) -> torch.Tensor:
        """The per-tag evaluation grid's images (``evaluation.generation.grid_unit``), made
        by one rollout actor."""
        unit, settings = grid_unit(prompts, self.settings.eval)
        w = self._evaluated()
        return self.fleet.map_rollout([unit], lambda h, u: h.eval_images.remote(u, settings, w))[0]

    def extra_metrics(self) -> dict[str, float]:
        out = {**self.counters, **self.fleet.figures()}
        out["filter_actor_restarts"] = float(self.filters.restarts)
        out["actor_recovery_seconds"] = self.last_recovery_s
        out["learner_world_size"] = float(self.learner.world_size)
        out["weight_sync_bytes"] = float(self.last_sync_bytes)
        out.update(self.traffic.take())  # the data plane since the last call
        return out

    # ------------------------------------------------------------------ the CLI's calls

    def check_prompts(self, prompts: list[str]) -> list[str | None]:
        """Per prompt, None or why the policy cannot read it (one rollout actor's answer)."""
        return self.fleet.check_prompts(prompts)

    def set_prompt_metadata(self, table: dict[str, Any]) -> None:
        """Prompt text -> its metadata, to every actor (``RolloutFleet.set_prompt_metadata``)."""
        self.fleet.set_prompt_metadata(table)

    # ------------------------------------------------------------------ checkpoints

    def save(self, folder: Path) -> None:
        """Learner, version, RNG streams (``backend.checkpoint``; the group source saves the
        filter's history): :meth:`snapshot`, written now."""
        self.snapshot()(folder)

    def snapshot(self) -> Callable[[Path], None]:
        """What :meth:`save` writes, taken now; the returned call writes it (on any thread)."""
        return snapshot_learner(self.learner, self.policy_version)

    def load(self, folder: Path) -> None:
        """Restore what :meth:`save` wrote, then give every rollout actor those weights."""
        load_learner(self.learner, folder)
        self.policy_version = self.learner.version
        self.sync_weights()
        self._event("learner", "restored")

    # ------------------------------------------------------------------ live control

    def on_step_end(self, step: int, row: dict[str, Any]) -> None:
        """Mirror the step's row to the Ray dashboard metrics; apply a requested scale and
        report the status (``backend.control.ControlChannel``)."""
        self.metrics.record_step(row, self.settings.rollout.group_size)
        self.live.step_end(self.fleet, step, self.policy_version, row)
        self.metrics.gauge("maskgrpo_rollout_actors", len(self.fleet.rollouts))

    def shutdown(self) -> None:
        self.live.shutdown()
        self.learner.shutdown()
        self.fleet.shutdown()
        self.filters.shutdown()
        disconnect(self.cluster)
