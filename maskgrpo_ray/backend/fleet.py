"""RolloutFleet: the rollout and reward actors of a run, with one owner and one lock.

The fleet owns the two :class:`~maskgrpo_ray.actors.pool.ActorPool`s and every change to
them: healing (a lost actor replaced within its role's restart budget), adding and removing
rollout actors (``maskgrpo scale``), the prompt metadata every actor reads, and the weight
sync's membership (which actors a push reaches, and the version they all hold). It runs the
chunks of a call (:class:`~maskgrpo_ray.backend.chunks.ChunkScheduler`) and the evaluation units
over its rollout actors. This is how OpenRLHF's ``RayActorGroup`` and verl's worker groups own
their members; the executor keeps the learner side and the wiring.

**Threading rule.** Two threads call in: the driver's main thread (weight sync, scaling,
evaluation, a learner restart) and, with ``rollout.max_policy_lag`` >= 1, the collection
thread, whose chunk scheduler heals lost actors through :meth:`heal`. Every method that changes
the pools, the restart and loss counts, :attr:`version`, the prompt metadata or the sync's
membership holds ``self._lock`` (re-entrant) for its whole body, Ray calls included; nothing
outside this class changes them. Outside the lock, code reads snapshots only: a pool's member
list is replaced on each change, never changed in place. A snapshot may name an actor the
other thread has since replaced: :meth:`heal` of that actor returns the one that took its
place. So a heal never overlaps a push, a scale or another heal, and when the lock is free
every rollout actor holds :attr:`version` (tested under load by ``tests/test_fleet_stress.py``).
The executor holds :attr:`learner_busy` while the learner updates: a replacement with no sibling
left waits for it, so the learner's weights it takes and their version match.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from maskgrpo_ray.actors.pool import ActorPool, Member, rollout_pool
from maskgrpo_ray.actors.reward import RemoteRewardActor
from maskgrpo_ray.backend.chunks import ChunkScheduler, map_over_pool
from maskgrpo_ray.cluster.ray_metrics import RayMetrics
from maskgrpo_ray.learner.group import LearnerGroup
from maskgrpo_ray.learner.weight_sync import (
    SyncReport,
    WeightSync,
    copy_from_sibling,
    newest_rollout_weights,
)
from maskgrpo_ray.pipeline.data_plane import Traffic
from maskgrpo_ray.pipeline.messages import Chunk, ScoredBatch
from maskgrpo_ray.pipeline.settings import RunSettings

log = logging.getLogger(__name__)

Event = Callable[[str, str], None]
"""``(role, "lost" | "replaced")``: the executor's fault log."""


class RolloutFleet:
    """The rollout and reward actors (see the module docstring for the threading rule).

    Args:
        s: the run's settings (actor settings, resources, restart budgets, call timeouts).
        timeout_s: longest wait for any single actor call.
        metrics: the process's Ray metrics.
        sync: the weight transport whose membership the fleet keeps.
        on_event: the executor's fault log.
    """

    def __init__(
        self,
        s: RunSettings,
        timeout_s: float,
        metrics: RayMetrics,
        sync: WeightSync,
        on_event: Event,
    ) -> None:
        self.settings, self.timeout_s, self.metrics = s, timeout_s, metrics
        self.sync, self.on_event = sync, on_event
        self._lock = threading.RLock()
        self.learner_busy = threading.Lock()  # held by the executor during an update
        self.learner: LearnerGroup | None = None
        self.version = 0  # the weights version every rollout actor holds (lock free)
        self.restarts = {"rollout": 0, "reward": 0}
        self.last_recovery_s = 0.0
        self.prompt_meta: Any = None  # an object-store ref to prompt text -> metadata
        self._replaced: dict[tuple[str, int], Member | None] = {}  # healed -> its successor
        self.rewards = ActorPool(
            "reward",
            lambda i, opts: RemoteRewardActor.options(**opts).remote(
                s.reward, s.reward_resources.num_gpus, i
            ),
            s.reward_resources,
            timeout_s,
        )
        self.rollouts = rollout_pool(
            s, timeout_s, on_size=lambda n: metrics.gauge("maskgrpo_rollout_actors", n)
        )
        self.scheduler = ChunkScheduler(
            self.rollouts,
            self.rewards,
            metrics,
            timeout_s,
            heal_rollout=lambda m, why: self.heal("rollout", m, why),
            heal_reward=lambda m, why: self.heal("reward", m, why),
            rollout_call_s=s.rollout_healing.call_timeout_s,
            reward_call_s=s.reward_healing.call_timeout_s,
        )
        self.counters = self.scheduler.counters  # chunks and losses, shared with the executor

    # ------------------------------------------------------------------ start and wiring

    def spawn(self, rollout_actors: int, reward_actors: int) -> None:
        """Start the actors without waiting (the learner starts meanwhile): :meth:`wait_ready`."""
        with self._lock:
            for _ in range(reward_actors):
                self.rewards.spawn()
            for _ in range(rollout_actors):
                self.rollouts.spawn()

    def wait_ready(self) -> None:
        self.rollouts.wait_ready(self.rollouts.members)
        self.rewards.wait_ready(self.rewards.members)

    def attach(self, learner: LearnerGroup) -> None:
        """The learner group a push reads from (a new one after a learner restart)."""
        with self._lock:
            self.learner = learner
            self.sync.attach(learner, self.rollouts.handles())

    def _learner(self) -> LearnerGroup:
        if self.learner is None:
            raise RuntimeError("RolloutFleet.attach(learner) was not called")
        return self.learner

    # ------------------------------------------------------------------ weights

    def push(self, version: int) -> SyncReport:
        """The learner's weights, as ``version``, to every rollout actor; one lost during the
        push is healed (its replacement copies a sibling, which now holds ``version``)."""
        with self._lock:
            rep = self.sync.push(self._learner(), self.rollouts.handles(), version)
            self.version = version
            for handle in rep.failed:
                lost = next((m for m in self.rollouts.members if m.handle is handle), None)
                if lost is not None:
                    self.heal("rollout", lost, "died", during="the weight sync")
            if not len(self.rollouts):
                raise RuntimeError(
                    "every rollout actor is lost and the restart budget is spent "
                    "(rollout.max_restarts); raise it or find why they die"
                )
            return rep

    def _new_member(self, role: str) -> tuple[Member, int | None]:
        """A fresh actor, set up before it joins its pool (ready; a rollout actor with its
        siblings' weights; the prompt metadata), so no snapshot of the pool ever holds one half
        set up (a chunk sent to it would run on the base weights). Returns it and, for a
        rollout actor, the weights version it holds."""
        pool = self.rollouts if role == "rollout" else self.rewards
        fresh = pool.create()
        try:
            pool.wait_ready([fresh])
            version = self._give_weights(fresh) if role == "rollout" else None
            self._send_prompt_metadata([fresh])
        except BaseException:
            pool.drop(fresh, kill=True)
            raise
        pool.add(fresh)
        if role == "rollout":
            self.sync.attach(self._learner(), self.rollouts.handles())
        return fresh, version

    def _give_weights(self, fresh: Member) -> int:
        """A new rollout actor (not yet in the pool) gets the weights its siblings hold (the
        version of the chunks in flight, which a reissued chunk must use too); with none left,
        the learner's, once no update runs, with the learner's version. Returns the version."""
        version = copy_from_sibling(self.rollouts.handles(), fresh.handle, self.timeout_s)
        if version is not None:
            return version
        learner = self._learner()
        with self.learner_busy:
            rep = self.sync.push(learner, [fresh.handle], learner.version)
        if rep.failed:
            raise RuntimeError("the replacement died while receiving weights")
        self.version = learner.version
        return learner.version

    def versions(self) -> dict[int, int]:
        """Rollout actor id -> the weights version it holds (asked under the lock)."""
        with self._lock:
            members = list(self.rollouts.members)
            refs = [m.handle.weights_version.remote() for m in members]
            got = ray.get(refs, timeout=self.timeout_s)
            return {m.actor_id: int(v) for m, v in zip(members, got, strict=True)}

    def newest_weights(self) -> tuple[Any, int]:
        """(weights ref, version) of the rollout actor with the newest weights."""
        with self._lock:
            return newest_rollout_weights(self.rollouts.handles(), self.timeout_s)

    # ------------------------------------------------------------------ healing

    def heal(self, role: str, member: Member, why: str, during: str = "") -> Member | None:
        """Replace a lost rollout or reward actor within the run's restart budget.

        The first call for a member still in its pool counts the loss, drops it (killed when
        hung, so a late result can never arrive) and starts a fresh one (a rollout actor given
        its siblings' weights before it takes work). Past ``max_restarts`` it is only dropped.
        A later call for the same member (another of its calls, or the other thread) returns
        what took its place. Returns the replacement, or None.
        """
        with self._lock:
            pool = self.rollouts if role == "rollout" else self.rewards
            if not any(m is member for m in pool.members):
                return self._replaced.get((role, member.actor_id))
            self.on_event(role, "lost")
            self.counters[f"{role}_actors_lost"] += 1
            self.metrics.count("maskgrpo_actors_lost_total", tags={"role": role, "why": why})
            log.warning("%s actor %d %s%s", role, member.actor_id, why, during and f" ({during})")
            pool.drop(member, kill=why == "hung")
            fresh = self._replace(role, pool, member, why)
            self._replaced[(role, member.actor_id)] = fresh
            if role == "rollout":
                self.sync.attach(self._learner(), self.rollouts.handles())
            return fresh

    def _replace(self, role: str, pool: ActorPool, member: Member, why: str) -> Member | None:
        budget = (
            self.settings.rollout_healing if role == "rollout" else self.settings.reward_healing
        ).max_restarts
        if self.restarts[role] >= budget:
            log.warning(
                "%s actor %d not replaced: the restart budget (%s.max_restarts=%d) is spent; "
                "going on with %d",
                role, member.actor_id, role, budget, len(pool),
            )  # fmt: skip
            return None
        self.restarts[role] += 1
        t0 = time.perf_counter()
        try:
            fresh, version = self._new_member(role)
        except (RayActorError, RuntimeError, TimeoutError, GetTimeoutError) as err:
            log.warning("%s actor %d could not be replaced: %s", role, member.actor_id, err)
            return None
        self.last_recovery_s = time.perf_counter() - t0
        self.on_event(role, "replaced")
        self.metrics.count("maskgrpo_actor_restarts_total", tags={"role": role})
        self.metrics.gauge("maskgrpo_actor_recovery_seconds", self.last_recovery_s)
        self.metrics.gauge(f"maskgrpo_{role}_actors", len(pool))
        log.warning(
            "%s actor %d (%s) replaced by actor %d%s in %.1f s (restart %d of %d)",
            role, member.actor_id, why, fresh.actor_id,
            f" with weights version {version}" if version is not None else "",
            self.last_recovery_s, self.restarts[role], budget,
        )  # fmt: skip
        return fresh

    # ------------------------------------------------------------------ scaling, metadata

    def add_rollout_actor(self) -> int:
        """Start one more rollout actor with the weights the others hold; its id."""
        with self._lock:
            return self._new_member("rollout")[0].actor_id

    def remove_rollout_actor(self, actor_id: int | None = None) -> int:
        """Stop a rollout actor (the newest by default); its id. A chunk it was running goes to
        another actor with the same seed."""
        with self._lock:
            removed = self.rollouts.shrink(actor_id)
            self._replaced[("rollout", removed)] = None
            self.sync.attach(self._learner(), self.rollouts.handles())
            return removed

    def scale_rollout(self, n: int) -> None:
        """Add or remove rollout actors until there are ``n``."""
        if n < 1:
            raise ValueError(f"scale_rollout({n}): at least one rollout actor is needed")
        with self._lock:
            while len(self.rollouts) < n:
                self.add_rollout_actor()
            while len(self.rollouts) > n:
                self.remove_rollout_actor()

    def set_prompt_metadata(self, table: dict[str, Any]) -> None:
        """Prompt text -> its metadata, to every reward and rollout actor (and to every
        replacement later), for rewards that read it (``uses_prompt_metadata``)."""
        with self._lock:
            self.prompt_meta = ray.put(table)
            self._send_prompt_metadata([*self.rewards.members, *self.rollouts.members])

    def _send_prompt_metadata(self, members: list[Member]) -> None:
        if self.prompt_meta is not None and members:
            refs = [m.handle.set_prompt_metadata.remote(self.prompt_meta) for m in members]
            ray.get(refs, timeout=self.timeout_s)

    # ------------------------------------------------------------------ work

    def run_chunks(self, chunks: list[Chunk], traffic: Traffic) -> ScoredBatch:
        """Every chunk generated and scored, in chunk order (``ChunkScheduler.run``, outside
        the lock: it heals through :meth:`heal`)."""
        done = self.scheduler.run(chunks, traffic)
        return ScoredBatch.concat([done[i] for i in sorted(done)])

    def map_rollout(self, items: list[Any], call: Callable[[Any, Any], Any]) -> list[Any]:
        """``call(handle, item)`` over the rollout actors, healing lost ones (results in order)."""
        return map_over_pool(
            self.rollouts,
            items,
            call,
            self.settings.rollout_healing.call_timeout_s or self.timeout_s,
            heal=lambda m, why: self.heal("rollout", m, why, during="an evaluation"),
        )

    def check_prompts(self, prompts: list[str]) -> list[str | None]:
        """Per prompt, None or why the policy cannot read it: one call to one rollout actor."""
        ref = self.rollouts.members[0].handle.check_prompts.remote(prompts)
        return ray.get(ref, timeout=self.timeout_s)

    # ------------------------------------------------------------------ reading

    def rollout_actor_ids(self) -> list[int]:
        return self.rollouts.ids()

    def rollout_handle(self, actor_id: int) -> Any:
        return self.rollouts.member(actor_id).handle

    def figures(self) -> dict[str, float]:
        """The fleet's part of a step's row (read under the lock: no heal half done)."""
        with self._lock:
            return {
                "rollout_actors": float(len(self.rollouts)),
                "reward_actors": float(len(self.rewards)),
                "rollout_actor_restarts": float(self.restarts["rollout"]),
                "reward_actor_restarts": float(self.restarts["reward"]),
            }

    def shutdown(self) -> None:
        with self._lock:
            self.rollouts.shutdown()
            self.rewards.shutdown()
