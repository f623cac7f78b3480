"""What the run's actors answer besides their work.

:class:`ActorProcess`: a ping (``ready``), the process id (``pid``) and node, what a pool, the driver
and the weight sync wait on and what an operator or a fault drill signals. :class:`PoolActor`
adds what a member of a rollout or reward pool has: its id, and the prompts' metadata that the
reward components with ``uses_prompt_metadata`` read. Every actor of a run calls
:func:`outlive_sigterm` first thing in its constructor.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Any

log = logging.getLogger(__name__)


def outlive_sigterm() -> None:
    """A SIGTERM to this actor's process is logged and otherwise ignored.

    When a cluster stops a job it signals every process at once (SLURM's ``scancel``, a group
    signal, a node's shutdown); Ray's own handler would end this actor there, in the middle of
    the step, and the driver's checkpoint after the step needs the learner ranks (their
    weights and optimizer) and the actors of the step alive. So the decision is the driver's
    alone: it finishes or abandons the step, writes the checkpoint within
    ``run.preemption_grace_seconds`` and ends the actors (``ray.kill``, which needs no
    signal). Nothing outlives that for long: Ray ends a job's actors when their driver exits
    or dies, and whoever sent the SIGTERM sends SIGKILL after its grace period. (A local
    cluster the driver started has SIGTERM blocked in all its processes anyway:
    ``backend.cluster.sigterm_blocked``.) Only the main thread can set a handler; elsewhere
    this does nothing."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _on_sigterm)


def _on_sigterm(signum: int, frame: Any) -> None:
    log.warning(
        "pid %d: SIGTERM ignored; this actor keeps serving the driver, which checkpoints "
        "within run.preemption_grace_seconds and then ends the run's actors",
        os.getpid(),
    )


def on_driver_node() -> dict[str, Any]:
    """Ray options that place an actor on the driver's node: the run's singletons (the filter,
    the control actor; they ask for no CPU, so the node always has room) then die only with the
    driver, never with another node. Hard affinity: Ray 2.60 places a zero-resource actor with
    *soft* affinity on any node (measured: tests/test_node_loss.py asserts where they run)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node = ray.get_runtime_context().get_node_id()
    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id=node, soft=False)}


def user_error_of(err: BaseException) -> BaseException | None:
    """The :class:`~maskgrpo_ray.errors.UserError` an actor's call raised (``ray.get``'s
    ``RayTaskError`` keeps it as ``cause``), so that the command ends in its one line; None for
    anything else. An actor whose constructor finds a user's mistake (a config field only a
    built model can check, such as ``model.lora.target_modules``) keeps it and raises it from
    ``ready``: a constructor's own exception reaches the driver only as text."""
    from maskgrpo_ray.errors import UserError

    cause = getattr(err, "cause", None)
    return cause if isinstance(cause, UserError) else None


def wait_ready(handles: list[Any], timeout_s: float) -> None:
    """Wait until every actor is constructed; a user's mistake one found ends here as that
    ``UserError`` (one line, exit 2), anything else as Ray raised it."""
    import ray

    try:
        ray.get([h.ready.remote() for h in handles], timeout=timeout_s)
    except ray.exceptions.RayTaskError as err:
        mistake = user_error_of(err)
        if mistake is None:
            raise
        raise mistake from None


class ActorProcess:
    """A ping and the process id, for any Ray actor of a run."""

    init_error: Exception | None = None  # a user's mistake found while constructing

    def ready(self) -> bool:
        """True once the actor is constructed (what starting an actor waits on); raises the
        user's mistake its constructor found (see :func:`user_error_of`)."""
        if self.init_error is not None:
            raise self.init_error
        return True

    def pid(self) -> int:
        """The actor's process id (what an operator or a fault drill signals)."""
        return os.getpid()

    def node_id(self) -> str:
        """The Ray node the actor runs on (where a lost node's actors were)."""
        import ray

        return str(ray.get_runtime_context().get_node_id())


class PoolActor(ActorProcess):
    """A member of a rollout or reward pool.

    Args:
        actor_id: the pool's id of this replica (a metrics tag).
    """

    def __init__(self, actor_id: int) -> None:
        outlive_sigterm()
        self.actor_id = actor_id
        self.prompt_meta: dict[str, Any] | None = None

    def set_prompt_metadata(self, table: dict[str, Any]) -> int:
        """Prompt text -> its metadata (the prompt files' other fields, e.g. GenEval's ``tag``),
        for the reward components that read it (``uses_prompt_metadata``); returns the number
        of prompts."""
        self.prompt_meta = table
        return len(table)
