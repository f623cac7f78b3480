"""ControlActor: a named actor through which ``maskgrpo scale`` / ``maskgrpo status`` reach a
running job. The driver applies a requested rollout-actor count at the next step boundary and
reports its status after every step; the actor itself only stores the two.
"""

from __future__ import annotations

import logging
from typing import Any

import ray

from maskgrpo_ray.actors.base import ActorProcess, on_driver_node, outlive_sigterm

NAMESPACE = "maskgrpo"
log = logging.getLogger(__name__)


def control_name(run_name: str) -> str:
    return f"maskgrpo-control:{run_name}"


class ControlActor(ActorProcess):
    def __init__(self) -> None:
        outlive_sigterm()
        self.requested_rollout_actors: int | None = None
        self.status: dict[str, Any] = {}

    def request_rollout_actors(self, n: int) -> dict[str, Any]:
        """Ask for ``n`` rollout actors from the next step on; returns the current status."""
        if int(n) < 1:
            raise ValueError(f"--rollout {n}: at least one rollout actor is needed")
        self.requested_rollout_actors = int(n)
        return self.status

    def take_request(self) -> int | None:
        n, self.requested_rollout_actors = self.requested_rollout_actors, None
        return n

    def report(self, status: dict[str, Any]) -> None:
        self.status = status

    def get_status(self) -> dict[str, Any]:
        return {**self.status, "pending_rollout_request": self.requested_rollout_actors}


RemoteControlActor = ray.remote(num_cpus=0)(ControlActor)


def start_control_actor(run_name: str) -> tuple[Any, str]:
    """Start the run's control actor under a unique name in the ``maskgrpo`` namespace."""
    base = control_name(run_name)
    for i in range(100):
        name = base if i == 0 else f"{base}-{i}"
        try:
            handle = RemoteControlActor.options(
                name=name, namespace=NAMESPACE, **on_driver_node()
            ).remote()
            log.info(
                "control actor %r (namespace %r): `maskgrpo scale --run %s --rollout N` "
                "changes the rollout actor count at the next step",
                name,
                NAMESPACE,
                name.split(":", 1)[1],
            )
            return handle, name
        except ValueError:  # the name is taken by another live run
            continue
    raise RuntimeError(f"could not name a control actor for run {run_name!r}")
