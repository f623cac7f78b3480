"""RayExecutor: the Executor protocol of ``driver.py`` on a Ray cluster.

Rollout actors (policy replicas), reward actors, one filter actor and a DeepSpeed learner group.
``generate_and_score`` is pull-based: the prompts are cut into chunks, an idle rollout actor
takes the next chunk, and each finished rollout goes straight on to the least busy reward actor
(the object store carries it; the driver only merges the scored chunks). A rollout actor that
dies mid-chunk is dropped and its chunk re-issued to another (same seed, so the same samples):
no group is lost and none counted twice. Actors may be added or removed between steps.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
import torch
from ray.exceptions import RayActorError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.control import NAMESPACE as CONTROL_NAMESPACE
from actors.control import start_control_actor
from actors.filter import RemoteFilterActor
from actors.reward import RemoteRewardActor
from actors.rollout import RemoteRolloutActor
from learner.group import LearnerGroup
from learner.weight_sync import ObjectStoreSync, WeightSync
from maskgrpo_ray.config import Config
from maskgrpo_ray.driver import _merge
from maskgrpo_ray.phases import FilterResult
from maskgrpo_ray.ray_cluster import ClusterHandle, connect, disconnect
from maskgrpo_ray.ray_metrics import process_metrics
from maskgrpo_ray.types import ScoredBatch, TrainBatch

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


@dataclass
class _Rollout:
    handle: Any
    actor_id: int
    pg: Any = None


class RayExecutor:
    """Generate, score, filter and update with Ray actors (see the module docstring).

    Args:
        cfg: the validated config (resources from ``rollout.*``, ``reward.*``, ``learner.*``).
        chunk_prompts: prompts per rollout request (the unit of pull-based work); default
            ``rollout.prompts_per_chunk``, where 0 means ``ceil(B / rollout.num_actors)``.
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
        if chunk_prompts is None:
            chunk_prompts = cfg.rollout.prompts_per_chunk or -(
                -cfg.train.prompts_per_step // cfg.rollout.num_actors
            )
        self.cfg, self.chunk_prompts, self.timeout_s = cfg, max(1, chunk_prompts), timeout_s
        self.cluster: ClusterHandle = connect(
            cfg.run.ray_address, cfg.run.num_cpus, include_dashboard
        )
        self.metrics = process_metrics()
        self._warm_model_cache()
        self.policy_version = 0
        self._calls_this_version = 0
        self._next_actor_id = 0
        self.counters = {
            "chunks_issued": 0.0,
            "chunks_reissued": 0.0,
            "rollout_actors_lost": 0.0,
            "reward_actors_lost": 0.0,
        }
        self.last_sync_bytes = 0
        self.chunks_by_actor: dict[int, int] = {}
        self.control, self.control_name = start_control_actor(cfg.run.name)
        log.info(
            "control actor %r (namespace %r): `maskgrpo scale --run %s --rollout N` "
            "changes the rollout actor count at the next step",
            self.control_name,
            CONTROL_NAMESPACE,
            self.control_name.split(":", 1)[1],
        )
        rc = cfg.reward
        self.filter_actor = RemoteFilterActor.options(num_cpus=0).remote(cfg)
        self.reward_actors = [
            RemoteRewardActor.options(
                num_cpus=rc.num_cpus_per_actor, num_gpus=rc.num_gpus_per_actor
            ).remote(cfg, i)
            for i in range(rc.num_actors)
        ]
        self.rollouts: list[_Rollout] = [
            self._spawn_rollout() for _ in range(cfg.rollout.num_actors)
        ]
        self.learner = LearnerGroup(cfg, timeout_s)
        ray.get(
            [r.handle.ready.remote() for r in self.rollouts]
            + [a.ready.remote() for a in self.reward_actors]
            + [self.filter_actor.ready.remote()],
            timeout=timeout_s,
        )
        self.sync = weight_sync or ObjectStoreSync(timeout_s)
        self.sync.attach(self.learner, self._handles())
        self.sync_weights()  # version 0: every replica starts from the learner's weights

    # ------------------------------------------------------------------ actors

    def _warm_model_cache(self) -> None:
        """Build the toy base model once here so actors load it instead of each pre-training."""
        if self.cfg.model.kind == "toy":
            from maskgrpo_ray.build import build_policy

            build_policy(self.cfg)

    def _spawn_rollout(self) -> _Rollout:
        r = self.cfg.rollout
        opts: dict[str, Any] = {"num_cpus": r.num_cpus_per_actor, "num_gpus": r.num_gpus_per_actor}
        pg = None
        if r.num_gpus_per_actor > 0:  # one GPU per actor, in its own placement group
            bundle = {"GPU": r.num_gpus_per_actor}
            if r.num_cpus_per_actor > 0:
                bundle["CPU"] = r.num_cpus_per_actor
            pg = placement_group([bundle])
            ray.get(pg.ready(), timeout=self.timeout_s)
            opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(pg, 0)
        actor_id = self._next_actor_id
        self._next_actor_id += 1
        handle = RemoteRolloutActor.options(**opts).remote(self.cfg, actor_id)
        return _Rollout(handle, actor_id, pg)

    def _handles(self) -> list[Any]:
        return [r.handle for r in self.rollouts]

    def _drop_rollout(self, ro: _Rollout, kill: bool) -> None:
        self.rollouts = [r for r in self.rollouts if r is not ro]
        if kill:
            ray.kill(ro.handle)
        if ro.pg is not None:
            remove_placement_group(ro.pg)
        self.metrics.gauge("maskgrpo_rollout_actors", len(self.rollouts))

    def add_rollout_actor(self) -> int:
        """Start one more rollout actor (between steps) with the current weights; its id."""
        ro = self._spawn_rollout()
        ray.get(ro.handle.ready.remote(), timeout=self.timeout_s)
        self.rollouts.append(ro)
        self.sync.attach(self.learner, self._handles())
        rep = self.sync.push(self.learner, [ro.handle], self.policy_version)
        if rep.failed:
            raise RuntimeError("the new rollout actor died while receiving weights")
        self.metrics.gauge("maskgrpo_rollout_actors", len(self.rollouts))
        return ro.actor_id

    def remove_rollout_actor(self, actor_id: int | None = None) -> int:
        """Stop a rollout actor (the newest by default) between steps; its id."""
        if len(self.rollouts) <= 1:
            raise ValueError("cannot remove the last rollout actor")
        ro = (
            self.rollouts[-1]
            if actor_id is None
            else next(r for r in self.rollouts if r.actor_id == actor_id)
        )
        self._drop_rollout(ro, kill=True)
        self.sync.attach(self.learner, self._handles())
        return ro.actor_id

    def scale_rollout(self, n: int) -> None:
        """Add or remove rollout actors until there are ``n`` (between steps)."""
        if n < 1:
            raise ValueError(f"scale_rollout({n}): at least one rollout actor is needed")
        while len(self.rollouts) < n:
            self.add_rollout_actor()
        while len(self.rollouts) > n:
            self.remove_rollout_actor()

    def rollout_actor_ids(self) -> list[int]:
        return [r.actor_id for r in self.rollouts]

    def rollout_handle(self, actor_id: int) -> Any:
        return next(r.handle for r in self.rollouts if r.actor_id == actor_id)

    def check_prompt(self, prompt: str) -> None:
        """Raise ValueError if the policy cannot read ``prompt`` (asked of a rollout actor)."""
        reason = ray.get(
            self.rollouts[0].handle.check_prompt.remote(prompt), timeout=self.timeout_s
        )
        if reason is not None:
            raise ValueError(reason)

    # ------------------------------------------------------------------ phases

    def _chunks(self, prompts: list[str], positions: list[int]) -> list[Chunk]:
        c = self.chunk_prompts
        call = self._calls_this_version
        self._calls_this_version += 1
        return [
            Chunk(
                i,
                prompts[s : s + c],
                positions[s : s + c],
                chunk_seed(self.cfg.run.seed, self.policy_version, call, i),
            )
            for i, s in enumerate(range(0, len(prompts), c))
        ]

    def generate_and_score(self, prompts: list[str], positions: list[int]) -> ScoredBatch:
        """All prompts' groups, generated and scored; order follows ``prompts``."""
        done = self._run_chunks(self._chunks(prompts, positions))
        return _merge([done[i] for i in sorted(done)])

    def _gauge_queues(self, pending: int, gen: int, rew: int) -> None:
        self.metrics.gauge("maskgrpo_queue_pending_chunks", pending)
        self.metrics.gauge("maskgrpo_queue_inflight_rollouts", gen)
        self.metrics.gauge("maskgrpo_queue_inflight_rewards", rew)

    def _run_chunks(self, chunks: list[Chunk]) -> dict[int, ScoredBatch]:
        pending = deque(chunks)
        idle = deque(self.rollouts)
        gen: dict[Any, tuple[Chunk, _Rollout]] = {}
        rew: dict[Any, tuple[Chunk, Any, Any]] = {}
        load = {id(a): 0 for a in self.reward_actors}
        done: dict[int, ScoredBatch] = {}

        def send_to_reward(ch: Chunk, rollout_ref: Any) -> None:
            if not self.reward_actors:
                raise RuntimeError("every reward actor died")
            ra = min(self.reward_actors, key=lambda a: load[id(a)])
            load[id(ra)] += 1
            rew[ra.score.remote(rollout_ref)] = (ch, rollout_ref, ra)

        while pending or gen or rew:
            while pending and idle:
                ro, ch = idle.popleft(), pending.popleft()
                gen[ro.handle.generate.remote(ch.prompts, ch.positions, ch.seed)] = (ch, ro)
                self.counters["chunks_issued"] += 1
            if pending and not gen and not idle:
                raise RuntimeError("every rollout actor died; no one left to generate")
            self._gauge_queues(len(pending), len(gen), len(rew))
            ready, _ = ray.wait([*gen, *rew], num_returns=1, timeout=self.timeout_s)
            if not ready:
                raise TimeoutError(f"no rollout or reward finished within {self.timeout_s} s")
            ref = ready[0]
            if ref in gen:
                ch, ro = gen.pop(ref)
                try:
                    ray.get(ref)
                except RayActorError:
                    log.warning(
                        "rollout actor %d died; re-issuing chunk %d (prompts %s)",
                        ro.actor_id,
                        ch.index,
                        ch.positions,
                    )
                    self._drop_rollout(ro, kill=False)
                    self.counters["rollout_actors_lost"] += 1
                    self.counters["chunks_reissued"] += 1
                    self.metrics.count("maskgrpo_chunks_reissued_total")
                    pending.appendleft(ch)
                    continue
                idle.append(ro)
                self.chunks_by_actor[ro.actor_id] = self.chunks_by_actor.get(ro.actor_id, 0) + 1
                send_to_reward(ch, ref)
            else:
                ch, rollout_ref, ra = rew.pop(ref)
                load[id(ra)] -= 1
                try:
                    scored = ray.get(ref)
                except RayActorError:
                    log.warning("reward actor died; re-scoring chunk %d elsewhere", ch.index)
                    self.reward_actors = [a for a in self.reward_actors if a is not ra]
                    self.counters["reward_actors_lost"] += 1
                    send_to_reward(ch, rollout_ref)
                    continue
                if ch.index in done:
                    raise RuntimeError(f"chunk {ch.index} finished twice")
                done[ch.index] = scored
        self._gauge_queues(0, 0, 0)
        return done

    def filter(self, scored: ScoredBatch) -> FilterResult:
        ref = self.filter_actor.filter.remote(scored.rewards, scored.rollout.group_size)
        return ray.get(ref, timeout=self.timeout_s)

    def filter_stats(self) -> dict[str, float]:
        return ray.get(self.filter_actor.stats.remote(), timeout=self.timeout_s)

    def filter_state(self) -> dict[str, Any]:
        return ray.get(self.filter_actor.state_dict.remote(), timeout=self.timeout_s)

    def load_filter_state(self, state: dict[str, Any]) -> None:
        ray.get(self.filter_actor.load_state_dict.remote(state), timeout=self.timeout_s)

    def update(self, batch: TrainBatch) -> dict[str, float]:
        metrics = self.learner.update(batch)
        self.policy_version = self.learner.version
        self._calls_this_version = 0
        return metrics

    def sync_weights(self) -> float:
        """Push the learner's weights (version = updates so far) to every rollout actor."""
        rep = self.sync.push(self.learner, self._handles(), self.learner.version)
        for handle in rep.failed:
            ro = next(r for r in self.rollouts if r.handle is handle)
            log.warning("rollout actor %d died during the weight sync; dropped", ro.actor_id)
            self._drop_rollout(ro, kill=False)
            self.counters["rollout_actors_lost"] += 1
        if rep.failed:
            self.sync.attach(self.learner, self._handles())
        if not self.rollouts:
            raise RuntimeError("every rollout actor died")
        self.last_sync_bytes = rep.bytes_per_target
        self.metrics.observe("maskgrpo_weight_sync_seconds", rep.seconds)
        self.metrics.gauge("maskgrpo_weight_bytes", rep.bytes_per_target)
        self.metrics.gauge("maskgrpo_policy_version", self.learner.version)
        return rep.seconds

    def evaluate(self, prompts: list[str]) -> dict[str, float]:
        """Held-out evaluation on one rollout actor (fixed seeds, as the local trainer)."""
        for ro in list(self.rollouts):
            try:
                return ray.get(ro.handle.evaluate.remote(prompts), timeout=self.timeout_s)
            except RayActorError:
                self._drop_rollout(ro, kill=False)
                self.counters["rollout_actors_lost"] += 1
        raise RuntimeError("every rollout actor died")

    def extra_metrics(self) -> dict[str, float]:
        out = dict(self.counters)
        out["rollout_actors"] = float(len(self.rollouts))
        out["reward_actors"] = float(len(self.reward_actors))
        out["learner_world_size"] = float(self.learner.world_size)
        out["weight_sync_bytes"] = float(self.last_sync_bytes)
        # reward failures come with each ScoredBatch; the driver keeps the cumulative counts
        return out

    def save(self, folder: Path) -> None:
        """Learner (DeepSpeed checkpoint, all ranks), filter state, version, RNG streams."""
        self.learner.save(str((folder / "learner").resolve()))
        torch.save(
            {
                "policy_version": self.policy_version,
                "step_generator": self.learner.step_generator.get_state(),
                "filter": self.filter_state(),
            },
            folder / "executor.pt",
        )

    def load(self, folder: Path) -> None:
        """Restore what :meth:`save` wrote, then give every rollout actor those weights."""
        state = torch.load(folder / "executor.pt", weights_only=True)
        self.learner.load(
            str((folder / "learner").resolve()),
            int(state["policy_version"]),
            state["step_generator"],
        )
        self.policy_version = self.learner.version
        self._calls_this_version = 0
        self.load_filter_state(state["filter"])
        self.sync_weights()

    def on_step_end(self, step: int, row: dict[str, Any]) -> None:
        """Mirror the step's row to the Ray dashboard metrics; apply a requested scale."""
        self.metrics.record_step(row, self.cfg.rollout.samples_per_prompt)
        requested = ray.get(self.control.take_request.remote(), timeout=self.timeout_s)
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
            "reward_actors": len(self.reward_actors),
            "samples_per_second": row.get("samples_per_second"),
            "reward_mean": row.get("reward_mean"),
        }
        self.control.report.remote(status)

    def shutdown(self) -> None:
        ray.kill(self.control)
        self.learner.shutdown()
        for ro in list(self.rollouts):
            self._drop_rollout(ro, kill=True)
        for a in [*self.reward_actors, self.filter_actor]:
            ray.kill(a)
        disconnect(self.cluster)
