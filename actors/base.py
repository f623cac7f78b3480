"""What the run's actors answer besides their work.

:class:`ActorProcess`: a ping (``ready``), the process id (``pid``) and node, what a pool, the driver
and the weight sync wait on and what an operator or a fault drill signals. :class:`PoolActor`
adds what a member of a rollout or reward pool has: its id, and the prompts' metadata that the
reward components with ``uses_prompt_metadata`` read.
"""

from __future__ import annotations

import os
from typing import Any


def on_driver_node() -> dict[str, Any]:
    """Ray options that place an actor on the driver's node: the run's singletons (the filter,
    the control actor; they ask for no CPU, so the node always has room) then die only with the
    driver, never with another node. Hard affinity: Ray 2.60 places a zero-resource actor with
    *soft* affinity on any node (measured: tests/test_node_loss.py asserts where they run)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node = ray.get_runtime_context().get_node_id()
    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id=node, soft=False)}


class ActorProcess:
    """A ping and the process id, for any Ray actor of a run."""

    def ready(self) -> bool:
        """True once the actor is constructed (what starting an actor waits on)."""
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
        self.actor_id = actor_id
        self.prompt_meta: dict[str, Any] | None = None

    def set_prompt_metadata(self, table: dict[str, Any]) -> int:
        """Prompt text -> its metadata (the prompt files' other fields, e.g. GenEval's ``tag``),
        for the reward components that read it (``uses_prompt_metadata``); returns the number
        of prompts."""
        self.prompt_meta = table
        return len(table)
