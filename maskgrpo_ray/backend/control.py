"""The run's control actor seen from the driver: ``maskgrpo scale`` requests in, the status that
``maskgrpo status`` reads out (``actors.control``). A control actor lost with its node is started
again; a scale request it held is lost with it (the log says to send it again)."""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import ray
from ray.exceptions import RayActorError

from maskgrpo_ray.actors.control import start_control_actor
from maskgrpo_ray.backend.fleet import RolloutFleet

log = logging.getLogger(__name__)


class ControlChannel:
    """The control actor (:attr:`actor`) of run ``run_name``, asked at each step's end."""

    def __init__(self, run_name: str, timeout_s: float) -> None:
        self.run_name, self.timeout_s = run_name, timeout_s
        self.actor, _ = start_control_actor(run_name)

    def take_request(self) -> int | None:
        """The rollout actor count asked for since the last call (None: nothing asked)."""
        try:
            return ray.get(self.actor.take_request.remote(), timeout=self.timeout_s)
        except RayActorError as e:  # its node lost: the run goes on without it
            log.warning("control actor lost (%s); started again (re-send a pending scale)", e)
            with contextlib.suppress(Exception):
                ray.kill(self.actor)
            self.actor, _ = start_control_actor(self.run_name)
            return None

    def step_end(self, fleet: RolloutFleet, step: int, version: int, row: dict[str, Any]) -> None:
        """Apply a requested scale to ``fleet``, then report the step's status."""
        requested = self.take_request()
        n = len(fleet.rollouts)
        if requested is not None and requested != n:
            log.info(
                "scaling rollout actors %d -> %d (asked through the control actor)", n, requested
            )
            fleet.scale_rollout(requested)
        status = {
            "step": step,
            "policy_version": version,
            "rollout_actors": fleet.rollout_actor_ids(),
            "reward_actors": len(fleet.rewards),
            "samples_per_second": row.get("samples_per_second"),
            "reward_mean": row.get("reward_mean"),
        }
        self.actor.report.remote(status)

    def shutdown(self) -> None:
        ray.kill(self.actor)
