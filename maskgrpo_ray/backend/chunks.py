"""Pull-based chunk scheduling over a rollout pool and a reward pool.

The prompts of a call are cut into chunks; an idle rollout actor takes the next chunk, and each
finished rollout goes straight on to the least busy reward actor (the object store carries it;
the driver holds references and fetches only a small meta and the rewards:
``maskgrpo_ray.pipeline.data_plane``). A rollout actor that dies mid-chunk, or whose call outlives its
deadline (hung: it is killed), is healed: the ``heal`` callback (``RolloutFleet.heal``) counts
the loss, replaces the actor (a fresh one with its siblings' weights, within the run's restart
budget) or, past the budget, only drops it. Its chunk is re-issued with the same seed, so the
same samples come back: no group is lost and none counted twice (a killed actor's late result
can never arrive). A lost reward actor is healed the same way and its chunk re-scored.

A heal may be asked for an actor that is already gone (another of its calls was lost first,
or another thread healed it): it then answers what took its place, so the callers here ask on
every lost call and never decide themselves whether an actor is still a member.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any, cast

import ray
from ray.exceptions import RayActorError

from maskgrpo_ray.actors.pool import ActorPool, Member
from maskgrpo_ray.cluster.ray_metrics import RayMetrics
from maskgrpo_ray.pipeline.data_plane import (
    REF_BYTES,
    RolloutMeta,
    RolloutRefs,
    Traffic,
    wire_bytes,
)
from maskgrpo_ray.pipeline.messages import Chunk, RewardResult, ScoredBatch

log = logging.getLogger(__name__)


Refs = tuple[Any, Any]
"""A rollout in the object store: (the rollout without images, its images)."""

Heal = Callable[[Member, str], "Member | None"]
"""``(lost member, why: "died" | "hung") -> what took its place (ready), or None``; asked on
every lost call, so it must answer for a member it already healed."""


def drop_only(pool: ActorPool) -> Heal:
    """The healing of a pool without a restart budget: drop the lost member (kill a hung one)."""

    def heal(member: Member, why: str) -> Member | None:
        if any(m is member for m in pool.members):
            pool.drop(member, kill=why == "hung")
        return None

    return heal


class ChunkScheduler:
    """Runs chunks through ``rollouts`` then ``rewards``; heals lost actors; counts chunks.

    Args:
        rollouts, rewards: the pools (read as snapshots: their owner changes them).
        metrics: the process's Ray metrics.
        timeout_s: a call's deadline where the role has none of its own.
        heal_rollout, heal_reward: replace a lost member and count the loss (:data:`Heal`).
        rollout_call_s, reward_call_s: a call running longer is hung (0: ``timeout_s``).
    """

    def __init__(
        self,
        rollouts: ActorPool,
        rewards: ActorPool,
        metrics: RayMetrics,
        timeout_s: float,
        *,
        heal_rollout: Heal,
        heal_reward: Heal,
        rollout_call_s: float = 0.0,
        reward_call_s: float = 0.0,
    ) -> None:
        self.rollouts, self.rewards, self.metrics, self.timeout_s = (
            rollouts,
            rewards,
            metrics,
            timeout_s,
        )
        self.heal_rollout, self.heal_reward = heal_rollout, heal_reward
        self.rollout_call_s = rollout_call_s or timeout_s
        self.reward_call_s = reward_call_s or timeout_s
        self.counters = {
            "chunks_issued": 0.0,
            "chunks_reissued": 0.0,
            "chunks_rescored": 0.0,
            "rollout_actors_lost": 0.0,
            "reward_actors_lost": 0.0,
            "calls_timed_out": 0.0,
        }
        self.chunks_by_actor: dict[int, int] = {}

    def _gauge(self, pending: int, gen: int, rew: int) -> None:
        self.metrics.gauge("maskgrpo_queue_pending_chunks", pending)
        self.metrics.gauge("maskgrpo_queue_inflight_rollouts", gen)
        self.metrics.gauge("maskgrpo_queue_inflight_rewards", rew)

    def run(self, chunks: list[Chunk], traffic: Traffic) -> dict[int, ScoredBatch]:
        """Every chunk generated and scored, by chunk index. A rollout travels as three objects
        (``generate_split``): a small meta, the rollout without images and the images. The
        reward actor reads the last two; this process fetches the meta and the rewards only:
        each result's ``rollout`` is a :class:`~maskgrpo_ray.pipeline.data_plane.RolloutRefs`. The bytes
        this process sends and receives are added to ``traffic``."""
        run = _ChunkRun(self, chunks, traffic)
        while run.busy():
            run.issue()
            self._gauge(len(run.pending), len(run.gen), len(run.rew))
            wait_s = max(0.0, min(run.deadline.values()) - time.monotonic())
            ready, _ = ray.wait([*run.gen, *run.rew], num_returns=1, timeout=wait_s)
            if ready:
                run.on_ready(ready[0])
            else:  # the earliest deadline passed: those calls are hung
                run.on_deadline(time.monotonic())
        self._gauge(0, 0, 0)
        return run.done

    def lost_call(self, role: str, member: Member, ch: Chunk, why: str) -> None:
        """Log a lost call (the healer counts the actor's loss; the chunk goes elsewhere)."""
        log.warning(
            "%s actor %d %s; chunk %d (prompts %s) goes to another actor",
            role,
            member.actor_id,
            "died" if why == "died" else "is hung: its call outlived its deadline",
            ch.index,
            ch.positions,
        )


def map_over_pool(
    pool: ActorPool,
    items: list[Any],
    call: Callable[[Any, Any], Any],
    timeout_s: float,
    heal: Heal | None = None,
) -> list[Any]:
    """``call(handle, item)`` for every item, one call in flight per actor of ``pool``; the
    results in item order. An actor that dies, or whose call outlives ``timeout_s`` (it is
    killed), is healed (``heal``: default drop it); its item is re-issued to another actor.
    Items must be pure (same result on any actor): evaluation units are
    (``evaluation.generation``)."""
    heal = heal or drop_only(pool)
    pending = deque(range(len(items)))
    idle: deque[Member] = deque(pool.members)
    inflight: dict[Any, tuple[int, Member, float]] = {}
    done: dict[int, Any] = {}

    def lost(i: int, member: Member, why: str) -> None:
        pending.appendleft(i)
        fresh = heal(member, why)
        if fresh is not None and all(m is not fresh for m in idle):
            idle.append(fresh)

    while pending or inflight:
        if pending and not idle and not inflight:  # this call's actors are gone: the pool now
            idle.extend(pool.members)
        while pending and idle:
            member, i = idle.popleft(), pending.popleft()
            inflight[call(member.handle, items[i])] = (i, member, time.monotonic() + timeout_s)
        if not inflight:
            raise RuntimeError(
                f"every {pool.name} actor is lost and the restart budget is spent; "
                f"{len(pending)} items were not done"
            )
        wait_s = max(0.0, min(d for _, _, d in inflight.values()) - time.monotonic())
        ready, _ = ray.wait(list(inflight), num_returns=1, timeout=wait_s)
        if not ready:
            now = time.monotonic()
            for ref in [r for r, (_, _, d) in inflight.items() if d <= now]:
                i, member, _ = inflight.pop(ref)
                lost(i, member, "hung")
            continue
        i, member, _ = inflight.pop(ready[0])
        try:
            done[i] = ray.get(ready[0])
        except RayActorError:
            lost(i, member, "died")
            continue
        idle.append(member)
    return [done[i] for i in range(len(items))]


class _ChunkRun:
    """The state of one :meth:`ChunkScheduler.run`: chunks waiting, idle rollout actors, calls
    in flight (rollouts and rewards, each with a deadline) and the results so far."""

    def __init__(self, sched: ChunkScheduler, chunks: list[Chunk], traffic: Traffic) -> None:
        self.s, self.traffic = sched, traffic
        self.pending = deque(chunks)
        self.idle: deque[Member] = deque(sched.rollouts.members)
        self.gen: dict[Any, tuple[Chunk, Member, Refs]] = {}  # meta ref -> its chunk
        self.rew: dict[Any, tuple[Chunk, Refs, Member, RolloutMeta]] = {}  # reward ref -> ...
        self.deadline: dict[Any, float] = {}  # in-flight call -> monotonic deadline
        self.load = {m.actor_id: 0 for m in sched.rewards.members}
        self.done: dict[int, ScoredBatch] = {}

    def busy(self) -> bool:
        return bool(self.pending or self.gen or self.rew)

    def issue(self) -> None:
        """Give the waiting chunks to idle rollout actors. With none idle and none busy (this
        run's were lost, or scaled away), the pool's members now take them."""
        s = self.s
        if self.pending and not self.idle and not self.gen:
            self.idle.extend(s.rollouts.members)
        while self.pending and self.idle:
            ro, ch = self.idle.popleft(), self.pending.popleft()
            meta_ref, ref, images = ro.handle.generate_split.remote(
                ch.prompts, ch.positions, ch.seed
            )
            self.gen[meta_ref] = (ch, ro, (ref, images))
            self.traffic.sent += wire_bytes((ch.prompts, ch.positions, ch.seed))
            self.deadline[meta_ref] = time.monotonic() + s.rollout_call_s
            s.counters["chunks_issued"] += 1
        if self.pending and not self.gen and not self.idle:
            raise RuntimeError(
                "every rollout actor is lost and the restart budget is spent "
                "(rollout.max_restarts); raise it or find why they die"
            )

    def send_to_reward(self, ch: Chunk, rollout_ref: Refs, meta: RolloutMeta) -> None:
        s = self.s
        if not len(s.rewards):
            raise RuntimeError(
                "every reward actor is lost and the restart budget is spent "
                "(reward.max_restarts); raise it or find why they die"
            )
        ra = min(s.rewards.members, key=lambda m: self.load.get(m.actor_id, 0))
        self.load[ra.actor_id] = self.load.get(ra.actor_id, 0) + 1
        ref = ra.handle.score.remote(*rollout_ref)
        self.traffic.sent += 2 * REF_BYTES
        self.rew[ref] = (ch, rollout_ref, ra, meta)
        self.deadline[ref] = time.monotonic() + s.reward_call_s

    def rollout_lost(self, ch: Chunk, ro: Member, why: str) -> None:
        """Re-issue ``ch`` (same seed) after healing its actor (once per actor)."""
        s = self.s
        s.counters["chunks_reissued"] += 1
        s.metrics.count("maskgrpo_chunks_reissued_total")
        s.lost_call("rollout", ro, ch, why)
        fresh = s.heal_rollout(ro, why)  # or what already took its place
        if fresh is not None and all(m is not fresh for m in self.idle):
            self.idle.append(fresh)
        self.pending.appendleft(ch)

    def reward_lost(
        self, ch: Chunk, rollout_ref: Refs, ra: Member, meta: RolloutMeta, why: str
    ) -> None:
        """Re-score ``ch`` after healing its reward actor (its other calls are lost too)."""
        s = self.s
        s.counters["chunks_rescored"] += 1
        self.load.pop(ra.actor_id, None)
        s.lost_call("reward", ra, ch, why)
        fresh = s.heal_reward(ra, why)  # or what already took its place
        if fresh is not None:
            self.load.setdefault(fresh.actor_id, 0)
        self.send_to_reward(ch, rollout_ref, meta)

    def on_deadline(self, now: float) -> None:
        """Calls past their deadline are hung: heal their actors, redo their work."""
        for ref in [r for r in (*self.gen, *self.rew) if self.deadline[r] <= now]:
            self.deadline.pop(ref)
            self.s.counters["calls_timed_out"] += 1
            if ref in self.gen:
                ch, ro, _ = self.gen.pop(ref)
                self.rollout_lost(ch, ro, "hung")
            else:
                ch, rollout_ref, ra, meta = self.rew.pop(ref)
                self.reward_lost(ch, rollout_ref, ra, meta, "hung")

    def on_ready(self, ref: Any) -> None:
        """A finished call: a rollout goes on to a reward actor, a reward completes a chunk."""
        self.deadline.pop(ref)
        if ref in self.gen:
            ch, ro, rollout_ref = self.gen.pop(ref)
            try:
                meta = cast(RolloutMeta, ray.get(ref))
            except RayActorError:
                self.rollout_lost(ch, ro, "died")
                return
            self.traffic.received += wire_bytes(meta)
            self.idle.append(ro)
            by_actor = self.s.chunks_by_actor
            by_actor[ro.actor_id] = by_actor.get(ro.actor_id, 0) + 1
            self.send_to_reward(ch, rollout_ref, meta)
            return
        ch, rollout_ref, ra, meta = self.rew.pop(ref)
        try:
            result = cast(RewardResult, ray.get(ref))
        except RayActorError:
            self.reward_lost(ch, rollout_ref, ra, meta, "died")
            return
        self.traffic.received += wire_bytes(result)
        self.load[ra.actor_id] = self.load.get(ra.actor_id, 1) - 1
        if ch.index in self.done:
            raise RuntimeError(f"chunk {ch.index} finished twice")
        # the reward actor returns scores only; the rollout stays in the object store
        view = RolloutRefs.of_chunk(ch.prompts, ch.positions, *rollout_ref, meta)
        self.done[ch.index] = ScoredBatch.join(view, result)
