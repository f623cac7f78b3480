"""Weight sync: learner -> rollout actors, versioned, after every update.

``WeightSync`` is the interface the driver uses; ``ObjectStoreSync`` is the one implementation
today. The learner's rank 0 puts its trained tensors in the object store once and every rollout
actor fetches that one object (Ray moves it once per node); the call returns when every target
acknowledges the new version.

A bucketed NCCL broadcast (as verl's checkpoint engine and OpenRLHF's ``update_weight``) would
implement the same interface: ``attach`` re-forms a collective group of learner rank 0 and the
rollout actors whenever membership changes, and ``push`` streams the parameters in fixed-size
buckets (packed flat tensors, not one broadcast per tensor, the known bottleneck). It does not
exist yet; on CPUs the object store is the right transport anyway.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import RayActorError

from maskgrpo_ray.learner.group import LearnerGroup
from maskgrpo_ray.learner_core import LearnerLost


@dataclass
class SyncReport:
    seconds: float
    bytes_per_target: int
    version: int
    failed: list[Any] = field(default_factory=list)  # targets that died during the sync


class WeightSync(ABC):
    """Moves the learner's current weights to rollout actors and tags them with a version.

    Targets are rollout actor handles with ``load_weights(state, version) -> version``.
    """

    def attach(self, learner: LearnerGroup, targets: list[Any]) -> None:  # noqa: B027
        """Membership changed (actor added, removed or dead); default: nothing to set up."""

    @abstractmethod
    def push(self, learner: LearnerGroup, targets: list[Any], version: int) -> SyncReport:
        """Install ``version`` on every live target; report dead targets, never raise for them."""


class ObjectStoreSync(WeightSync):
    """One ``ray.put`` on the learner, one fetch per target node, through Ray's object store."""

    def __init__(self, timeout_s: float = 600.0) -> None:
        self.timeout_s = timeout_s
        self._bytes = 0

    def push(self, learner: LearnerGroup, targets: list[Any], version: int) -> SyncReport:
        t0 = time.perf_counter()
        ref = learner.weights_ref()
        if not self._bytes:  # counted on the learner: the weights never pass the driver
            self._bytes = learner.trained_bytes()
        acks = {t: t.load_weights.remote(ref, version) for t in targets}
        failed = []
        for t, ack in acks.items():
            try:
                got = ray.get(ack, timeout=self.timeout_s)
                if got != version:
                    raise RuntimeError(f"rollout actor acknowledged version {got}, not {version}")
            except RayActorError:
                failed.append(t)
            except Exception as err:  # the weights' own error: a learner lost mid-sync?
                _raise_if_learner_lost(learner, err)
                raise
        if failed:  # dead targets, or a dead learner whose weights never reached them
            _raise_if_learner_lost(learner, None)
        return SyncReport(time.perf_counter() - t0, self._bytes, version, failed)


def _raise_if_learner_lost(learner: LearnerGroup, cause: BaseException | None) -> None:
    dead = learner.dead_ranks()
    if dead:
        raise LearnerLost(dead[0], "died", "the weight sync", cause)
