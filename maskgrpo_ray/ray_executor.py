"""RayExecutor: the Executor protocol of ``driver.py`` on a Ray cluster.

Rollout actors (policy replicas) and reward actors live in :class:`actors.pool.ActorPool`s; a
:class:`maskgrpo_ray.ray_chunks.ChunkScheduler` runs each call's prompts through them
(pull-based, a dead rollout actor's chunk re-issued with the same seed); one filter actor keeps
the std history; a :class:`learner.group.LearnerGroup` of DeepSpeed ranks updates; a
:class:`learner.weight_sync.WeightSync` sends the learner's weights to the rollout actors.
Every actor gets the typed settings of its role (``maskgrpo_ray.settings``), never the config.
Actors may be added or removed between steps.
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path
from typing import Any

import ray
import torch
from ray.exceptions import RayActorError

from maskgrpo_ray.actors.control import start_control_actor
from maskgrpo_ray.actors.pool import ActorPool, Member, rollout_pool
from maskgrpo_ray.actors.reward import RemoteRewardActor
from maskgrpo_ray.collect import Chunk, chunk_prompts_of
from maskgrpo_ray.config import Config
from maskgrpo_ray.data_plane import Traffic, TrainRefs
from maskgrpo_ray.evaluation.generation import make_units, summarize
from maskgrpo_ray.learner.group import LearnerGroup
from maskgrpo_ray.learner.weight_sync import (
    WeightSync,
    copy_from_sibling,
    make_weight_sync,
    newest_rollout_weights,
)
from maskgrpo_ray.phases import FilterResult
from maskgrpo_ray.ray_chunks import ChunkScheduler, map_over_pool
from maskgrpo_ray.ray_cluster import ClusterHandle, connect, disconnect
from maskgrpo_ray.ray_filter import RemoteFilter
from maskgrpo_ray.ray_metrics import process_metrics
from maskgrpo_ray.safe_files import load_torch_file
from maskgrpo_ray.settings import settings_from_config
from maskgrpo_ray.types import ScoredBatch, TrainBatch

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
        self._warm_model_cache(cfg)
        self.policy_version = 0
        self.runs_ahead = True
        self.prompt_meta: Any = None  # an object-store ref to prompt text -> metadata
        self.last_sync_bytes = 0
        self.syncs_adapter = cfg.model.lora is not None  # LoRA: the sync moves the adapter only
        self.traffic = Traffic()  # the driver's data-plane bytes (data_plane.Traffic)
        self.control, self.control_name = start_control_actor(cfg.run.name)
        self.restarts = {"rollout": 0, "reward": 0}
        self.last_recovery_s = 0.0
        # (time.monotonic(), role, "lost" | "replaced" | "restored"): when faults were seen
        # and healed, for operators' logs and the fault drill (bench/fault_drill.py)
        self.events: list[tuple[float, str, str]] = []
        self._start_actors(cfg.rollout.num_actors, cfg.reward.num_actors)
        self.scheduler = ChunkScheduler(
            self.rollouts,
            self.rewards,
            self.metrics,
            timeout_s,
            heal_rollout=lambda m, why: self._heal("rollout", m, why),
            heal_reward=lambda m, why: self._heal("reward", m, why),
            rollout_call_s=s.rollout_healing.call_timeout_s,
            reward_call_s=s.reward_healing.call_timeout_s,
        )
        self.sync = weight_sync or make_weight_sync(
            s.learner.weight_sync, s.learner.weight_sync_bucket_bytes, timeout_s
        )
        self.sync.attach(self.learner, self.rollouts.handles())
        self.sync_weights()  # version 0: every replica starts from the learner's weights

    # ------------------------------------------------------------------ actors

    def _start_actors(self, rollout_actors: int, reward_actors: int) -> None:
        """The filter, reward and rollout actors and the learner group, started together and
        waited for (the actors build their models in parallel)."""
        s, timeout_s = self.settings, self.timeout_s
        self.filters = RemoteFilter(s.filter, timeout_s, self.metrics, self._filter_event)
        self.rewards = ActorPool(
            "reward",
            lambda i, opts: RemoteRewardActor.options(**opts).remote(
                s.reward, s.reward_resources.num_gpus, i
            ),
            s.reward_resources,
            timeout_s,
        )
        self.rollouts = rollout_pool(
            s, timeout_s, on_size=lambda n: self.metrics.gauge("maskgrpo_rollout_actors", n)
        )
        for _ in range(reward_actors):
            self.rewards.spawn()
        for _ in range(rollout_actors):
            self.rollouts.spawn()
        self.learner = LearnerGroup(s, timeout_s)
        self.rollouts.wait_ready(self.rollouts.members)
        self.rewards.wait_ready(self.rewards.members)
        self.filters.wait_ready()

    def _warm_model_cache(self, cfg: Config) -> None:
        """The model kind's one-off preparation (toy: pre-train and cache it once, here)."""
        from maskgrpo_ray.models.registry import prepare_model

        prepare_model(cfg.model)

    @property
    def chunk_prompts(self) -> int:
        """``rollout.prompts_per_chunk``, or ``ceil(B / rollout actors now)`` (0, the default):
        a pool scaled up or down between steps keeps every actor busy. With the configured
        actor count this is the local backend's chunking, so both seed a step alike."""
        return chunk_prompts_of(self.fixed_chunk_prompts, self.prompts_per_step, len(self.rollouts))

    @property
    def counters(self) -> dict[str, float]:
        return self.scheduler.counters

    @property
    def chunks_by_actor(self) -> dict[int, int]:
        return self.scheduler.chunks_by_actor

    def _heal(self, role: str, member: Member, why: str) -> Member | None:
        """Replace a lost rollout or reward actor within the run's restart budget.

        The lost one is dropped (killed when hung, so a late result can never arrive); a fresh
        one is started and, for a rollout actor, given the weights its siblings hold before it
        takes work (``weight_sync.copy_from_sibling``; the learner's with no sibling left). Past ``max_restarts`` the actor is only dropped and
        the run goes on with fewer (the scheduler fails the call when none is left). Returns
        the replacement.
        """
        self.events.append((time.monotonic(), role, "lost"))
        pool = self.rollouts if role == "rollout" else self.rewards
        healing = (
            self.settings.rollout_healing if role == "rollout" else self.settings.reward_healing
        )
        pool.drop(member, kill=why == "hung")
        if role == "rollout":
            self.sync.attach(self.learner, self.rollouts.handles())
        if self.restarts[role] >= healing.max_restarts:
            log.warning(
                "%s actor %d not replaced: the restart budget (%s.max_restarts=%d) is spent; "
                "going on with %d",
                role,
                member.actor_id,
                role,
                healing.max_restarts,
                len(pool),
            )
            return None
        self.restarts[role] += 1
        t0 = time.perf_counter()
        version = None
        try:
            fresh = pool.grow()
            if role == "rollout":
                self.sync.attach(self.learner, self.rollouts.handles())
                others = [h for h in self.rollouts.handles() if h is not fresh.handle]
                version = copy_from_sibling(others, fresh.handle, self.timeout_s)
                if version is None:  # no sibling left: the learner's current weights
                    rep = self.sync.push(self.learner, [fresh.handle], self.policy_version)
                    if rep.failed:
                        raise RuntimeError("the replacement died while receiving weights")
                    version = self.policy_version
            self._send_prompt_metadata([fresh])
        except (RayActorError, RuntimeError, TimeoutError, ray.exceptions.GetTimeoutError) as err:
            log.warning("%s actor %d could not be replaced: %s", role, member.actor_id, err)
            return None
        self.last_recovery_s = time.perf_counter() - t0
        self.events.append((time.monotonic(), role, "replaced"))
        self.metrics.count("maskgrpo_actor_restarts_total", tags={"role": role})
        self.metrics.gauge("maskgrpo_actor_recovery_seconds", self.last_recovery_s)
        self.metrics.gauge(f"maskgrpo_{role}_actors", len(pool))
        log.warning(
            "%s actor %d (%s) replaced by actor %d%s in %.1f s (restart %d of %d)",
            role,
            member.actor_id,
            why,
            fresh.actor_id,
            f" with weights version {version}" if role == "rollout" else "",
            self.last_recovery_s,
            self.restarts[role],
            healing.max_restarts,
        )
        return fresh

    def restart_learner(self, lost: Exception, *, from_rollouts: bool = False) -> None:
        """Replace the whole learner group after ``lost`` (its state is gone): the old ranks
        are killed (survivors may be stuck in a collective with the lost one) and a new group
        is started with the base weights. The caller restores it from a checkpoint
        (:meth:`load`), which also re-syncs the rollout actors. ``from_rollouts`` (no
        checkpoint): the new group starts from the newest weights a rollout actor holds, at
        that version, with fresh optimizer state, and every rollout actor is synced to it."""
        self.events.append((time.monotonic(), "learner", "lost"))
        t0 = time.perf_counter()
        log.warning("%s: killing the learner group and starting a new one", lost)
        self.learner.shutdown(graceful=False)
        planner = self.learner.planner.state()
        initial, version = (None, 0)
        if from_rollouts:
            initial, version = newest_rollout_weights(self.rollouts.handles(), self.timeout_s)
        self.learner = LearnerGroup(self.settings, self.timeout_s, initial)
        self.sync.attach(self.learner, self.rollouts.handles())
        self.counters["learner_restarts"] = self.counters.get("learner_restarts", 0.0) + 1
        if from_rollouts:
            self.learner.planner.load_state(planner)
            self.learner.version = self.policy_version = version
            self.sync_weights()
            self.counters["learner_fallbacks"] = self.counters.get("learner_fallbacks", 0.0) + 1
            self.metrics.count("maskgrpo_learner_fallbacks_total")
            self.events.append((time.monotonic(), "learner", "restored"))
        self.metrics.count(
            "maskgrpo_actors_lost_total",
            tags={"role": "learner", "why": getattr(lost, "why", "died")},
        )
        self.metrics.count("maskgrpo_actor_restarts_total", tags={"role": "learner"})
        self.last_recovery_s = time.perf_counter() - t0

    def learner_pids(self) -> list[int]:
        return self.learner.pids()

    def add_rollout_actor(self) -> int:
        """Start one more rollout actor (between steps) with the current weights; its id."""
        member = self.rollouts.grow()
        self.sync.attach(self.learner, self.rollouts.handles())
        rep = self.sync.push(self.learner, [member.handle], self.policy_version)
        if rep.failed:
            raise RuntimeError("the new rollout actor died while receiving weights")
        self._send_prompt_metadata([member])
        return member.actor_id

    def set_prompt_metadata(self, table: dict[str, Any]) -> None:
        """Prompt text -> its metadata, to every reward and rollout actor (and to every
        replacement later), for rewards that read it (``uses_prompt_metadata``)."""
        self.prompt_meta = ray.put(table)
        self._send_prompt_metadata([*self.rewards.members, *self.rollouts.members])

    def _send_prompt_metadata(self, members: list[Member]) -> None:
        if self.prompt_meta is not None and members:
            refs = [m.handle.set_prompt_metadata.remote(self.prompt_meta) for m in members]
            ray.get(refs, timeout=self.timeout_s)

    def remove_rollout_actor(self, actor_id: int | None = None) -> int:
        """Stop a rollout actor (the newest by default) between steps; its id."""
        removed = self.rollouts.shrink(actor_id)
        self.sync.attach(self.learner, self.rollouts.handles())
        return removed

    def scale_rollout(self, n: int) -> None:
        """Add or remove rollout actors until there are ``n`` (between steps)."""
        if n < 1:
            raise ValueError(f"scale_rollout({n}): at least one rollout actor is needed")
        while len(self.rollouts) < n:
            self.add_rollout_actor()
        while len(self.rollouts) > n:
            self.remove_rollout_actor()

    def rollout_actor_ids(self) -> list[int]:
        return self.rollouts.ids()

    def rollout_handle(self, actor_id: int) -> Any:
        return self.rollouts.member(actor_id).handle

    def check_prompts(self, prompts: list[str]) -> list[str | None]:
        """Per prompt, None or why the policy cannot read it: one call to one rollout actor."""
        ref = self.rollouts.members[0].handle.check_prompts.remote(prompts)
        return ray.get(ref, timeout=self.timeout_s)

    # ------------------------------------------------------------------ phases

    def generate_and_score(self, chunks: list[Chunk], traffic: Traffic) -> ScoredBatch:
        """Every chunk generated and scored, in chunk order. The rollout stays in the object
        store: ``scored.rollout`` is a ``data_plane.RolloutRefs`` (the driver fetched a small
        meta and the rewards of each chunk)."""
        done = self.scheduler.run(chunks, traffic)
        return ScoredBatch.concat([done[i] for i in sorted(done)])

    def filter(self, scored: ScoredBatch, traffic: Traffic) -> FilterResult:
        """The filter actor's decision (``ray_filter.RemoteFilter``: a dead filter actor is
        restarted from the state after its last decision and asked again)."""
        res = self.filters.decide(scored.rewards, scored.rollout.group_size, traffic)
        self.last_recovery_s = self.filters.last_recovery_s or self.last_recovery_s
        return res

    def _filter_event(self, role: str, what: str) -> None:
        self.events.append((time.monotonic(), role, what))
        if what == "lost":
            self.counters["filter_actors_lost"] = self.counters.get("filter_actors_lost", 0.0) + 1

    @property
    def filter_actor(self) -> Any:
        return self.filters.actor

    def filter_stats(self) -> dict[str, float]:
        return self.filters.stats()

    def filter_state(self) -> dict[str, Any]:
        return self.filters.state_dict()

    def load_filter_state(self, state: dict[str, Any]) -> None:
        self.filters.load_state_dict(state)

    def update(self, batch: TrainBatch | TrainRefs) -> dict[str, float]:
        """One learner update. A ``TrainRefs`` (the driver's loop): each rank is sent its plan
        and the chunk references and fetches its groups itself."""
        metrics = self.learner.update(batch, self.traffic)
        self.policy_version = self.learner.version
        return metrics

    def sync_weights(self) -> float:
        """Push the learner's weights (version = updates so far) to every rollout actor."""
        rep = self.sync.push(self.learner, self.rollouts.handles(), self.learner.version)
        for handle in rep.failed:
            member = self.rollouts.by_handle(handle)
            log.warning("rollout actor %d died during the weight sync", member.actor_id)
            self.counters["rollout_actors_lost"] += 1
            self.metrics.count(
                "maskgrpo_actors_lost_total", tags={"role": "rollout", "why": "died"}
            )
            self._heal("rollout", member, "died")  # a replacement gets this version's weights
        if not len(self.rollouts):
            raise RuntimeError(
                "every rollout actor is lost and the restart budget is spent "
                "(rollout.max_restarts); raise it or find why they die"
            )
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

    def evaluate(
        self, prompts: list[str], tags: list[str | None] | None = None
    ) -> dict[str, float]:
        """Held-out evaluation spread over every rollout actor: fixed-seed units
        (``evaluation.generation``), so the figures do not depend on the actor count; per
        GenEval tag too when ``tags`` (one per prompt) are given."""
        units = make_units(prompts, self.settings.eval)
        per_unit = self.map_rollout(units, lambda h, u: h.eval_unit.remote(u))
        return summarize(per_unit, tags)

    def map_rollout(self, items: list[Any], call: Any) -> list[Any]:
        """``call(handle, item)`` over the rollout actors, healing lost ones (results in order)."""

        def on_lost(member: Member, why: str) -> None:
            log.warning("rollout actor %d %s during an evaluation", member.actor_id, why)
            self.counters["rollout_actors_lost"] += 1

        return map_over_pool(
            self.rollouts,
            items,
            call,
            self.settings.rollout_healing.call_timeout_s or self.timeout_s,
            heal=lambda m, why: self._heal("rollout", m, why),
            on_lost=on_lost,
        )

    def policy_state(self) -> dict[str, torch.Tensor]:
        """Learner rank 0's trained tensors, fetched into the driver (once, at the run's end)."""
        return ray.get(self.learner.weights_ref(), timeout=self.timeout_s)

    def extra_metrics(self) -> dict[str, float]:
        out = dict(self.counters)
        out["rollout_actors"] = float(len(self.rollouts))
        out["reward_actors"] = float(len(self.rewards))
        out["rollout_actor_restarts"] = float(self.restarts["rollout"])
        out["reward_actor_restarts"] = float(self.restarts["reward"])
        out["filter_actor_restarts"] = float(self.filters.restarts)
        out["actor_recovery_seconds"] = self.last_recovery_s
        out["learner_world_size"] = float(self.learner.world_size)
        out["weight_sync_bytes"] = float(self.last_sync_bytes)
        out.update(self.traffic.take())  # the data plane since the last call
        return out

    # ------------------------------------------------------------------ checkpoints

    def save(self, folder: Path) -> None:
        """Learner (DeepSpeed checkpoint of all ranks, brought to ``folder`` on the driver's
        machine through the object store), version, RNG streams (the group source saves the
        filter's history)."""
        self.learner.save(str((folder / "learner").resolve()))
        planner = self.learner.planner.state()
        state = {"policy_version": self.policy_version, "step_generator": planner}
        torch.save(state, folder / "executor.pt")

    def load(self, folder: Path) -> None:
        """Restore what :meth:`save` wrote, then give every rollout actor those weights."""
        state = load_torch_file(folder / "executor.pt", "a checkpoint's executor state")
        self.learner.load(
            str((folder / "learner").resolve()),
            int(state["policy_version"]),
            state["step_generator"],
        )
        self.policy_version = self.learner.version
        self.sync_weights()
        self.events.append((time.monotonic(), "learner", "restored"))

    # ------------------------------------------------------------------ live control

    def on_step_end(self, step: int, row: dict[str, Any]) -> None:
        """Mirror the step's row to the Ray dashboard metrics; apply a requested scale."""
        self.metrics.record_step(row, self.settings.rollout.group_size)
        try:
            requested = ray.get(self.control.take_request.remote(), timeout=self.timeout_s)
        except RayActorError as e:  # its node lost: the run goes on without it
            log.warning("control actor lost (%s); started again (re-send a pending scale)", e)
            with contextlib.suppress(Exception):
                ray.kill(self.control)
            self.control, self.control_name = start_control_actor(self.run_name)
            requested = None
        if requested is not None and requested != len(self.rollouts):
            log.info(
                "scaling rollout actors %d -> %d (requested through the control actor)",
                len(self.rollouts),
                requested,
            )
            self.scale_rollout(requested)
        self.metrics.gauge("maskgrpo_rollout_actors", len(self.rollouts))
        status = {
            "step": step,
            "policy_version": self.policy_version,
            "rollout_actors": self.rollout_actor_ids(),
            "reward_actors": len(self.rewards),
            "samples_per_second": row.get("samples_per_second"),
            "reward_mean": row.get("reward_mean"),
        }
        self.control.report.remote(status)

    def shutdown(self) -> None:
        ray.kill(self.control)
        self.learner.shutdown()
        self.rollouts.shutdown()
        self.rewards.shutdown()
        self.filters.shutdown()
        disconnect(self.cluster)
