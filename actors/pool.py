"""ActorPool: a set of interchangeable Ray actors of one kind (rollout or reward replicas).

Spawns members with their resources (a GPU member gets a placement group of its own, so its
GPU and CPUs are reserved together), hands out their handles, drops a dead member, replaces one
with a fresh actor, and scales to a requested size. The pool knows nothing of what its actors
do: its owner passes a ``make(actor_id, options)`` that starts one. ``members`` is replaced on
every change, never changed in place, so a reference to it is a snapshot: what a thread that
does not own the pool may read (``maskgrpo_ray.backend.fleet``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from maskgrpo_ray.actors.base import wait_ready
from maskgrpo_ray.pipeline.settings import ActorResources, RunSettings

log = logging.getLogger(__name__)
PLACEMENT_NOTICE_S = 10.0  # a placement group not ready this long is announced once


def wait_placement(pg: Any, what: str, bundles: list[dict[str, float]], timeout_s: float) -> None:
    """Wait until ``pg`` is placed. Past :data:`PLACEMENT_NOTICE_S` say once, in one line, what
    it waits for (a node lost, or a cluster too small: capacity may come back, e.g. from the
    autoscaler), then wait up to ``timeout_s`` in all; past it, a :class:`GetTimeoutError`."""
    ready, _ = ray.wait([pg.ready()], timeout=min(PLACEMENT_NOTICE_S, timeout_s))
    if ready:
        return
    log.warning(
        "%s waits for a node with %s free (none has it now: a node lost, or the cluster is "
        "too small); waiting up to %.0f s for capacity to come back",
        what,
        " + ".join(str(b) for b in bundles),
        timeout_s,
    )
    ray.get(pg.ready(), timeout=max(timeout_s - PLACEMENT_NOTICE_S, 1.0))
    log.warning("%s placed", what)


@dataclass
class Member:
    handle: Any
    actor_id: int
    pg: Any = None


class ActorPool:
    """``make(actor_id, ray_options) -> handle`` actors with ``resources`` each.

    Args:
        name: for logs and the ``on_size`` callback ("rollout", "reward").
        make: starts one actor with the given ``.options`` (resources, scheduling).
        resources: CPUs and GPUs per member.
        timeout_s: longest wait for a placement group or a member's ``ready()``.
        on_size: called with the pool's size whenever it changes (e.g. a metrics gauge).
    """

    def __init__(
        self,
        name: str,
        make: Callable[[int, dict[str, Any]], Any],
        resources: ActorResources,
        timeout_s: float,
        on_size: Callable[[int], None] | None = None,
    ) -> None:
        self.name, self.make, self.resources, self.timeout_s = name, make, resources, timeout_s
        self.on_size = on_size or (lambda n: None)
        self.members: list[Member] = []
        self._next_id = 0

    def __len__(self) -> int:
        return len(self.members)

    def handles(self) -> list[Any]:
        return [m.handle for m in self.members]

    def ids(self) -> list[int]:
        return [m.actor_id for m in self.members]

    def member(self, actor_id: int) -> Member:
        return next(m for m in self.members if m.actor_id == actor_id)

    def by_handle(self, handle: Any) -> Member:
        return next(m for m in self.members if m.handle is handle)

    def spawn(self) -> Member:
        """Start one member (not yet waited for) and add it to the pool."""
        member = self.create()
        self.add(member)
        return member

    def create(self) -> Member:
        """Start one member (not yet waited for) without adding it: its owner sets it up
        (weights, metadata) and then :meth:`add`s it, so no reader of ``members`` sees it
        half set up."""
        res = self.resources
        opts: dict[str, Any] = {"num_cpus": res.num_cpus, "num_gpus": res.num_gpus}
        if res.custom:
            opts["resources"] = dict(res.custom)
        pg = None
        if res.num_gpus > 0:  # GPU and CPUs reserved together, in a group of their own
            bundle = {"GPU": res.num_gpus, **res.custom}
            if res.num_cpus > 0:
                bundle["CPU"] = res.num_cpus
            pg = placement_group([bundle])
            wait_placement(pg, f"{self.name} actor {self._next_id}", [bundle], self.timeout_s)
            opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(pg, 0)
        member = Member(self.make(self._next_id, opts), self._next_id, pg)
        self._next_id += 1
        return member

    def add(self, member: Member) -> None:
        self.members = [*self.members, member]  # replaced, never changed in place: a snapshot
        self.on_size(len(self.members))

    def start(self, n: int) -> None:
        """Spawn ``n`` members and wait until every member is ready."""
        for _ in range(n):
            self.spawn()
        self.wait_ready(self.members)

    def wait_ready(self, members: list[Member]) -> None:
        wait_ready([m.handle for m in members], self.timeout_s)

    def drop(self, member: Member, kill: bool) -> None:
        """Remove ``member`` (dead, or ``kill`` it) and release its placement group."""
        self.members = [m for m in self.members if m is not member]
        if kill:
            ray.kill(member.handle)
        if member.pg is not None:
            remove_placement_group(member.pg)
        self.on_size(len(self.members))

    def grow(self) -> Member:
        """One more member, ready when returned."""
        fresh = self.spawn()
        self.wait_ready([fresh])
        return fresh

    def shrink(self, actor_id: int | None = None) -> int:
        """Stop one member (the newest by default); its id. The last member is never removed."""
        if len(self.members) <= 1:
            raise ValueError(f"cannot remove the last {self.name} actor")
        member = self.members[-1] if actor_id is None else self.member(actor_id)
        self.drop(member, kill=True)
        return member.actor_id

    def shutdown(self) -> None:
        for m in list(self.members):
            self.drop(m, kill=True)


def rollout_pool(
    s: RunSettings, timeout_s: float, on_size: Callable[[int], None] | None = None
) -> ActorPool:
    """A pool of rollout actors of the settings' model (spawned by the caller): the training
    run's and ``maskgrpo eval``'s."""
    from maskgrpo_ray.actors.rollout import RemoteRolloutActor

    return ActorPool(
        "rollout",
        lambda i, opts: RemoteRolloutActor.options(**opts).remote(
            s.model, s.rollout, s.eval, s.reward, s.rollout_resources.num_gpus, i
        ),
        s.rollout_resources,
        timeout_s,
        on_size=on_size,
    )
