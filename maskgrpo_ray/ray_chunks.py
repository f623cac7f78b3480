"""Pull-based chunk scheduling over a rollout pool and a reward pool.

The prompts of a call are cut into chunks; an idle rollout actor takes the next chunk, and each
finished rollout goes straight on to the least busy reward actor (the object store carries it;
the driver holds references and fetches only a small meta and the rewards:
``maskgrpo_ray.data_plane``). A rollout actor that dies mid-chunk, or whose call outlives its
deadline (hung: it is killed), is healed: the ``heal`` callback replaces it (a fresh actor with
the current weights, within the run's restart budget) or, past the budget, it is only dropped.
Its chunk is re-issued with the same seed, so the same samples come back: no group is lost and
none counted twice (a killed actor's late result can never arrive). A lost reward actor is
healed the same way and its chunk re-scored.
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
from maskgrpo_ray.collect import Chunk
from maskgrpo_ray.data_plane import REF_BYTES, RolloutMeta, RolloutRefs, Traffic, wire_bytes
from maskgrpo_ray.ray_metrics import RayMetrics
from maskgrpo_ray.types import RewardResult, ScoredBatch

log = logging.getLogger(__name__)


Refs = tuple[Any, Any]
"""A rollout in the object store: (the rollout without images, its images)."""

Heal = Callable[[Member, str], "Member | None"]
"""``(lost member, why: "died" | "hung") -> a ready replacement, or None (dropped only)``."""


def drop_only(pool: ActorPool) -> Heal:
    """The healing of a pool without a restart budget: drop the lost member (kill a hung one)."""

    def heal(member: Member, why: str) -> Member | None:
        pool.drop(member, kill=why == "hung")
        return None

    return heal


class ChunkScheduler:
    """Runs chunks through ``rollouts`` then ``rewards``; heals lost actors; counts it all.

    Args:
        rollouts, rewards: the pools.
        metrics: the process's Ray metrics.
        timeout_s: a call's deadline where the role has none of its own.
        heal_rollout, heal_reward: replace a lost member (default: drop it).
        rollout_call_s, reward_call_s: a call running longer is hung (0: ``timeout_s``).
    """

    def __init__(
        self,
        rollouts: ActorPool,
        rewards: ActorPool,
        metrics: RayMetrics,
        timeout_s: float,
        *,
        heal_rollout: Heal | None = None,
        heal_reward: Heal | None = None,
        rollout_call_s: float = 0.0,
        reward_call_s: float = 0.0,
    ) -> None:
        self.rollouts, self.rewards, self.metrics, self.timeout_s = (
            rollouts,
            rewards,
            metrics,
            timeout_s,
        )
        self.heal_rollout = heal_rollout or drop_only(rollouts)
        self.heal_reward = heal_reward or drop_only(rewards)
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
        each result's ``rollout`` is a :class:`~maskgrpo_ray.data_plane.RolloutRefs`. The bytes
        this process sends and receives are added to ``traffic``."""
        pending = deque(chunks)
        idle: deque[Member] = deque(self.rollouts.members)
        # meta ref -> (chunk, actor, (rollout ref, images ref))
        gen: dict[Any, tuple[Chunk, Member, Refs]] = {}
        rew: dict[Any, tuple[Chunk, Refs, Member, RolloutMeta]] = {}
        deadline: dict[Any, float] = {}  # in-flight call -> monotonic deadline
        load = {m.actor_id: 0 for m in self.rewards.members}
        done: dict[int, ScoredBatch] = {}

        def send_to_reward(ch: Chunk, rollout_ref: Refs, meta: RolloutMeta) -> None:
            if not len(self.rewards):
                raise RuntimeError(
                    "every reward actor is lost and the restart budget is spent "
                    "(reward.max_restarts); raise it or find why they die"
                )
            ra = min(self.rewards.members, key=lambda m: load.get(m.actor_id, 0))
            load[ra.actor_id] = load.get(ra.actor_id, 0) + 1
            ref = ra.handle.score.remote(*rollout_ref)
            traffic.sent += 2 * REF_BYTES
            rew[ref] = (ch, rollout_ref, ra, meta)
            deadline[ref] = time.monotonic() + self.reward_call_s

        def rollout_lost(ch: Chunk, ro: Member, why: str) -> None:
            self.counters["chunks_reissued"] += 1
            self.metrics.count("maskgrpo_chunks_reissued_total")
            if any(m is ro for m in self.rollouts.members):  # one call in flight per actor
                self._lost("rollout", ro, ch, why)
                fresh = self.heal_rollout(ro, why)
                if fresh is not None:
                    idle.append(fresh)
            pending.appendleft(ch)

        def reward_lost(
            ch: Chunk, rollout_ref: Refs, ra: Member, meta: RolloutMeta, why: str
        ) -> None:
            self.counters["chunks_rescored"] += 1
            if any(m is ra for m in self.rewards.members):  # its other calls are lost too:
                load.pop(ra.actor_id, None)  # heal it once, on the first of them
                self._lost("reward", ra, ch, why)
                fresh = self.heal_reward(ra, why)
                if fresh is not None:
                    load[fresh.actor_id] = 0
            send_to_reward(ch, rollout_ref, meta)

        while pending or gen or rew:
            while pending and idle:
                ro, ch = idle.popleft(), pending.popleft()
                meta_ref, ref, images = ro.handle.generate_split.remote(
                    ch.prompts, ch.positions, ch.seed
                )
                gen[meta_ref] = (ch, ro, (ref, images))
                traffic.sent += wire_bytes((ch.prompts, ch.positions, ch.seed))
                deadline[meta_ref] = time.monotonic() + self.rollout_call_s
                self.counters["chunks_issued"] += 1
            if pending and not gen and not idle:
                raise RuntimeError(
                    "every rollout actor is lost and the restart budget is spent "
                    "(rollout.max_restarts); raise it or find why they die"
                )
            self._gauge(len(pending), len(gen), len(rew))
            wait_s = max(0.0, min(deadline[r] for r in (*gen, *rew)) - time.monotonic())
            ready, _ = ray.wait([*gen, *rew], num_returns=1, timeout=wait_s)
            if not ready:  # the earliest deadline passed: those calls are hung
                now = time.monotonic()
                for ref in [r for r in (*gen, *rew) if deadline[r] <= now]:
                    deadline.pop(ref)
                    self.counters["calls_timed_out"] += 1
                    if ref in gen:
                        ch, ro, _ = gen.pop(ref)
                        rollout_lost(ch, ro, "hung")
                    else:
                        ch, rollout_ref, ra, meta = rew.pop(ref)
                        reward_lost(ch, rollout_ref, ra, meta, "hung")
                continue
            ref = ready[0]
            deadline.pop(ref)
            if ref in gen:
                ch, ro, rollout_ref = gen.pop(ref)
                try:
                    meta = cast(RolloutMeta, ray.get(ref))
                except RayActorError:
                    rollout_lost(ch, ro, "died")
                    continue
                traffic.received += wire_bytes(meta)
                idle.append(ro)
                self.chunks_by_actor[ro.actor_id] = self.chunks_by_actor.get(ro.actor_id, 0) + 1
                send_to_reward(ch, rollout_ref, meta)
            else:
                ch, rollout_ref, ra, meta = rew.pop(ref)
                try:
                    result = cast(RewardResult, ray.get(ref))
                except RayActorError:
                    reward_lost(ch, rollout_ref, ra, meta, "died")
                    continue
                traffic.received += wire_bytes(result)
                load[ra.actor_id] = load.get(ra.actor_id, 1) - 1
                if ch.index in done:
                    raise RuntimeError(f"chunk {ch.index} finished twice")
                # the reward actor returns scores only; the rollout stays in the object store
                view = RolloutRefs.of_chunk(ch.prompts, ch.positions, *rollout_ref, meta)
                done[ch.index] = ScoredBatch.join(view, result)
        self._gauge(0, 0, 0)
        return done

    def _lost(self, role: str, member: Member, ch: Chunk, why: str) -> None:
        """Log and count a lost actor (the chunk goes elsewhere)."""
        log.warning(
            "%s actor %d %s (%s); chunk %d (prompts %s) goes to another actor",
            role,
            member.actor_id,
            "died" if why == "died" else "is hung: its call outlived its deadline; killing it",
            why,
            ch.index,
            ch.positions,
        )
        self.counters[f"{role}_actors_lost"] += 1
        self.metrics.count("maskgrpo_actors_lost_total", tags={"role": role, "why": why})


def map_over_pool(
    pool: ActorPool,
    items: list[Any],
    call: Callable[[Any, Any], Any],
    timeout_s: float,
    heal: Heal | None = None,
    on_lost: Callable[[Member, str], None] | None = None,
) -> list[Any]:
    """``call(handle, item)`` for every item, one call in flight per actor of ``pool``; the
    results in item order. An actor that dies, or whose call outlives ``timeout_s`` (it is
    killed), is healed (``heal``: default drop it) and reported to ``on_lost``; its item is
    re-issued to another actor. Items must be pure (same result on any actor): evaluation
    units are (``evaluation.generation``)."""
    heal = heal or drop_only(pool)
    pending = deque(range(len(items)))
    idle: deque[Member] = deque(pool.members)
    inflight: dict[Any, tuple[int, Member, float]] = {}
    done: dict[int, Any] = {}

    def lost(i: int, member: Member, why: str) -> None:
        pending.appendleft(i)
        if any(m is member for m in pool.members):
            if on_lost is not None:
                on_lost(member, why)
            fresh = heal(member, why)
            if fresh is not None:
                idle.append(fresh)

    while pending or inflight:
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
