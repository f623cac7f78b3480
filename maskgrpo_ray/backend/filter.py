"""The filter actor seen from the driver: its calls, and its restart from the state after its
last decision.

The std history lives in the filter actor (``actors/filter.py``). The driver keeps a
:class:`~maskgrpo_ray.actors.filter.FilterActor` of its own as the restart copy: the same
class, fed the same decisions (checked equal to the actor's on every call), so a filter actor
that dies is restarted from the state after its last decision and asked again, and the run's
decisions are those of a run without the crash.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import ray
import torch
from ray.exceptions import RayActorError

from maskgrpo_ray.actors.base import on_driver_node
from maskgrpo_ray.actors.filter import FilterActor, RemoteFilterActor
from maskgrpo_ray.cluster.ray_metrics import RayMetrics
from maskgrpo_ray.pipeline.data_plane import Traffic, wire_bytes
from maskgrpo_ray.pipeline.phases import FilterResult
from maskgrpo_ray.pipeline.settings import FilterSettings

log = logging.getLogger(__name__)
FILTER_ATTEMPTS = 3  # a filter call is tried on this many filter actors before the run fails


class RemoteFilter:
    """The filter actor and its restart copy.

    Args:
        settings: the filter's settings.
        timeout_s: longest wait for a filter call.
        metrics: the process's Ray metrics (losses and restarts are counted there).
        on_event: ``(role, "lost" | "replaced")``, for the executor's counters and fault log.
    """

    def __init__(
        self,
        settings: FilterSettings,
        timeout_s: float,
        metrics: RayMetrics,
        on_event: Callable[[str, str], None],
    ) -> None:
        self.settings, self.timeout_s = settings, timeout_s
        self.metrics, self.on_event = metrics, on_event
        self.actor = RemoteFilterActor.options(num_cpus=0, **on_driver_node()).remote(settings)
        self.copy = FilterActor(settings)
        self.last_recovery_s = 0.0
        self.restarts = (
            0  # filter actors replaced in this process (the row's filter_actor_restarts)
        )

    def wait_ready(self) -> None:
        ray.get(self.actor.ready.remote(), timeout=self.timeout_s)

    def decide(self, rewards: torch.Tensor, group_size: int, traffic: Traffic) -> FilterResult:
        """The filter actor's decision on ``rewards [N]``; a dead actor is restarted and asked
        again (the same decision a run without the crash takes)."""
        args = (rewards, group_size)
        for _ in range(FILTER_ATTEMPTS):
            try:
                res = ray.get(self.actor.filter.remote(*args), timeout=self.timeout_s)
            except RayActorError:
                self._restart()
                continue
            mine = self.copy.filter(*args)
            if not (torch.equal(mine.keep, res.keep) and torch.equal(mine.invalid, res.invalid)):
                raise RuntimeError("the filter actor and its restart copy decided differently")
            traffic.sent += wire_bytes(args)
            traffic.received += wire_bytes(res)
            return res
        raise RuntimeError(f"the filter actor died {FILTER_ATTEMPTS} times on one call")

    def _restart(self) -> None:
        self.on_event("filter", "lost")
        t0 = time.perf_counter()
        log.warning("the filter actor died; restarting it from its last decision's state")
        self.metrics.count("maskgrpo_actors_lost_total", tags={"role": "filter", "why": "died"})
        self.actor = RemoteFilterActor.options(num_cpus=0, **on_driver_node()).remote(self.settings)
        ray.get(self.actor.load_state_dict.remote(self.copy.state_dict()), timeout=self.timeout_s)
        self.last_recovery_s = time.perf_counter() - t0
        self.restarts += 1
        self.on_event("filter", "replaced")
        self.metrics.count("maskgrpo_actor_restarts_total", tags={"role": "filter"})

    def stats(self) -> dict[str, float]:
        return self.copy.stats()

    def state_dict(self) -> dict[str, Any]:
        return self.copy.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Both the actor and the copy take ``state`` (a checkpoint's, a rewind's); a dead
        actor is restarted from it."""
        self.copy.load_state_dict(state)
        try:
            ray.get(self.actor.load_state_dict.remote(state), timeout=self.timeout_s)
        except RayActorError:
            self._restart()  # a fresh actor from the copy, which now holds ``state``

    def shutdown(self) -> None:
        ray.kill(self.actor)
