"""Pull-based chunk scheduling over a rollout pool and a reward pool.

The prompts of a call are cut into chunks; an idle rollout actor takes the next chunk, and each
finished rollout goes straight on to the least busy reward actor (the object store carries it;
the driver holds references). A rollout actor that dies mid-chunk is dropped from its pool and
its chunk re-issued to another with the same seed, so the same samples come back: no group is
lost and none counted twice. A reward actor that dies has its chunk re-scored elsewhere.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import RayActorError

from maskgrpo_ray.actors.pool import ActorPool, Member
from maskgrpo_ray.ray_metrics import RayMetrics
from maskgrpo_ray.types import ScoredBatch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Chunk:
    index: int
    prompts: list[str]
    positions: list[int]
    seed: int


def chunk_seed(run_seed: int, version: int, call: int, index: int) -> int:
    """The rollout seed of a chunk: a function of (run seed, policy version = step, call within
    the step, chunk index) only, never of the actor that runs it."""
    return ((((run_seed * 1_000_003) + version) * 10_007 + call) * 1_009 + index) % (2**63 - 1)


def make_chunks(prompts: list[str], positions: list[int], size: int, seed_of: Any) -> list[Chunk]:
    """Cut ``prompts`` into chunks of ``size``; ``seed_of(index)`` gives each chunk's seed."""
    return [
        Chunk(i, prompts[s : s + size], positions[s : s + size], seed_of(i))
        for i, s in enumerate(range(0, len(prompts), size))
    ]


class ChunkScheduler:
    """Runs chunks through ``rollouts`` then ``rewards``; counts issues and losses."""

    def __init__(
        self,
        rollouts: ActorPool,
        rewards: ActorPool,
        metrics: RayMetrics,
        timeout_s: float,
    ) -> None:
        self.rollouts, self.rewards, self.metrics, self.timeout_s = (
            rollouts,
            rewards,
            metrics,
            timeout_s,
        )
        self.counters = {
            "chunks_issued": 0.0,
            "chunks_reissued": 0.0,
            "rollout_actors_lost": 0.0,
            "reward_actors_lost": 0.0,
        }
        self.chunks_by_actor: dict[int, int] = {}

    def _gauge(self, pending: int, gen: int, rew: int) -> None:
        self.metrics.gauge("maskgrpo_queue_pending_chunks", pending)
        self.metrics.gauge("maskgrpo_queue_inflight_rollouts", gen)
        self.metrics.gauge("maskgrpo_queue_inflight_rewards", rew)

    def run(self, chunks: list[Chunk]) -> dict[int, ScoredBatch]:
        """Every chunk generated and scored, by chunk index."""
        pending = deque(chunks)
        idle: deque[Member] = deque(self.rollouts.members)
        gen: dict[Any, tuple[Chunk, Member]] = {}
        rew: dict[Any, tuple[Chunk, Any, Member]] = {}
        load = {m.actor_id: 0 for m in self.rewards.members}
        done: dict[int, ScoredBatch] = {}

        def send_to_reward(ch: Chunk, rollout_ref: Any) -> None:
            if not len(self.rewards):
                raise RuntimeError("every reward actor died")
            ra = min(self.rewards.members, key=lambda m: load.get(m.actor_id, 0))
            load[ra.actor_id] = load.get(ra.actor_id, 0) + 1
            rew[ra.handle.score.remote(rollout_ref)] = (ch, rollout_ref, ra)

        while pending or gen or rew:
            while pending and idle:
                ro, ch = idle.popleft(), pending.popleft()
                gen[ro.handle.generate.remote(ch.prompts, ch.positions, ch.seed)] = (ch, ro)
                self.counters["chunks_issued"] += 1
            if pending and not gen and not idle:
                raise RuntimeError("every rollout actor died; no one left to generate")
            self._gauge(len(pending), len(gen), len(rew))
            ready, _ = ray.wait([*gen, *rew], num_returns=1, timeout=self.timeout_s)
            if not ready:
                raise TimeoutError(f"no rollout or reward finished within {self.timeout_s} s")
            ref = ready[0]
            if ref in gen:
                ch, ro = gen.pop(ref)
                if self._rollout_failed(ref, ch, ro):
                    pending.appendleft(ch)
                    continue
                idle.append(ro)
                self.chunks_by_actor[ro.actor_id] = self.chunks_by_actor.get(ro.actor_id, 0) + 1
                send_to_reward(ch, ref)
            else:
                ch, rollout_ref, ra = rew.pop(ref)
                load[ra.actor_id] -= 1
                try:
                    result = ray.get(ref)
                except RayActorError:
                    log.warning("reward actor died; re-scoring chunk %d elsewhere", ch.index)
                    self.rewards.drop(ra, kill=False)
                    self.counters["reward_actors_lost"] += 1
                    send_to_reward(ch, rollout_ref)
                    continue
                if ch.index in done:
                    raise RuntimeError(f"chunk {ch.index} finished twice")
                # the reward actor returns scores only; the rollout comes from the object store
                done[ch.index] = ScoredBatch.join(ray.get(rollout_ref), result)
        self._gauge(0, 0, 0)
        return done

    def _rollout_failed(self, ref: Any, ch: Chunk, ro: Member) -> bool:
        try:
            ray.get(ref)
        except RayActorError:
            log.warning(
                "rollout actor %d died; re-issuing chunk %d (prompts %s)",
                ro.actor_id,
                ch.index,
                ch.positions,
            )
            self.rollouts.drop(ro, kill=False)
            self.counters["rollout_actors_lost"] += 1
            self.counters["chunks_reissued"] += 1
            self.metrics.count("maskgrpo_chunks_reissued_total")
            return True
        return False
