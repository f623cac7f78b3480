"""Weight sync: learner -> rollout actors, versioned, after every update.

``WeightSync`` is the interface the driver uses, with two implementations, chosen by
``learner.weight_sync`` (``make_weight_sync``):

* ``ObjectStoreSync``: the learner's rank 0 puts its trained tensors in the object store once
  and every rollout actor fetches that one object (Ray moves it once per node);
* ``CollectiveSync``: learner rank 0 and the rollout actors form one ``torch.distributed`` group
  (NCCL on GPUs, gloo on CPUs; ``maskgrpo_ray/cluster/weight_transfer.py``) and rank 0 broadcasts the
  parameters packed into fixed-size flat buckets, as verl's checkpoint engine and OpenRLHF's
  ``update_weight`` do. The group is re-formed when membership changes (an actor added, removed
  or lost, a new learner group) at the next push.

Either call returns when every target acknowledges the new version; the weights never pass
through the driver.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import RayActorError

from maskgrpo_ray.learner.group import LearnerGroup
from maskgrpo_ray.pipeline.learner_core import LearnerLost


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


class CollectiveSync(WeightSync):
    """Bucketed broadcast from learner rank 0 in a group with the rollout actors.

    Args:
        bucket_bytes: bytes per broadcast bucket (``learner.weight_sync_bucket_mb``).
        timeout_s: longest wait for a Ray call.
        group_timeout_s: a rendezvous or broadcast waiting longer fails (a member died).
    """

    def __init__(
        self, bucket_bytes: int, timeout_s: float = 600.0, group_timeout_s: float = 60.0
    ) -> None:
        self.bucket_bytes, self.timeout_s = bucket_bytes, timeout_s
        self.group_timeout_s = group_timeout_s
        self._group: tuple[Any, list[Any]] | None = None  # (learner, targets) it was formed for
        self._bytes = 0
        self.groups_formed = 0

    def attach(self, learner: LearnerGroup, targets: list[Any]) -> None:
        """Membership changed: the group is re-formed at the next push."""
        self._group = None

    def _live(self, targets: list[Any]) -> tuple[list[Any], list[Any]]:
        pings = {t: t.ready.remote() for t in targets}
        ready, _ = ray.wait(list(pings.values()), num_returns=len(pings), timeout=30)
        live, dead = [], []
        for t, ref in pings.items():
            try:
                if ref not in ready:
                    raise TimeoutError("no answer to a ping in 30 s")
                ray.get(ref)
                live.append(t)
            except (RayActorError, TimeoutError):
                dead.append(t)
        return live, dead

    def _form(self, learner: LearnerGroup, targets: list[Any]) -> None:
        rank0 = learner.workers[0]
        opened = learner.gather([rank0.sync_open.remote(self.group_timeout_s)], "a sync group")
        host, port, metas = opened[0]
        world, b, gt = len(targets) + 1, self.bucket_bytes, self.group_timeout_s
        joins = [
            t.sync_join.remote(host, port, i + 1, world, metas, b, gt)
            for i, t in enumerate(targets)
        ]
        learner.gather([rank0.sync_connect.remote(world, metas, b, gt)], "the weight-sync group")
        ray.get(joins, timeout=self.timeout_s)
        self._group = (learner, list(targets))
        self.groups_formed += 1

    def push(self, learner: LearnerGroup, targets: list[Any], version: int) -> SyncReport:
        t0 = time.perf_counter()
        failed: list[Any] = []
        for attempt in range(2):  # a member lost mid-broadcast: re-form without it, once more
            targets, dead = self._live(targets)  # one round trip each: a dead member would
            failed += dead  # stall the broadcast until group_timeout_s
            if self._group is None or self._group[0] is not learner or self._group[1] != targets:
                self._form(learner, targets)
            send = learner.workers[0].sync_send.remote()
            acks = {t: t.sync_receive.remote(version) for t in targets}
            try:
                self._bytes = int(learner.gather([send], "the weight sync")[0])
                got = ray.get(list(acks.values()), timeout=self.timeout_s)
                if any(v != version for v in got):
                    raise RuntimeError(f"rollout actors acknowledged {got}, not {version}")
                break
            except (RayActorError, ray.exceptions.RayTaskError) as err:
                self._group = None
                live, dead = self._live(targets)
                if not dead or attempt == 1:
                    raise RuntimeError(f"collective weight sync failed: {err}") from err
                failed += dead
                targets = live
        return SyncReport(time.perf_counter() - t0, self._bytes, version, failed)


def make_weight_sync(kind: str, bucket_bytes: int, timeout_s: float) -> WeightSync:
    """The ``learner.weight_sync`` implementation (``auto`` already resolved)."""
    if kind == "collective":
        return CollectiveSync(bucket_bytes, timeout_s)
    if kind == "object_store":
        return ObjectStoreSync(timeout_s)
    raise ValueError(f"learner.weight_sync={kind!r}: use 'object_store' or 'collective'")


def _raise_if_learner_lost(learner: LearnerGroup, cause: BaseException | None) -> None:
    dead = learner.dead_ranks()
    if dead:
        raise LearnerLost(dead[0], "died", "the weight sync", cause)


def copy_from_sibling(siblings: list[Any], fresh: Any, timeout_s: float) -> int | None:
    """Give the replacement rollout actor ``fresh`` the weights (and version) a live sibling
    holds: the version of the chunks in flight, which a reissued chunk must use too. (During a
    lag-1 update the learner may already hold the next version: a replacement given the
    learner's weights would make its reissue differ from the chunk it replaces.) Returns the
    version installed, or None when no sibling answers."""
    for sibling in siblings:
        try:
            state, version = sibling.weights.options(num_returns=2).remote()
            return int(ray.get(fresh.load_weights.remote(state, version), timeout=timeout_s))
        except RayActorError:
            continue  # that sibling is gone too (or the replacement: the caller's push says so)
    return None


def newest_rollout_weights(targets: list[Any], timeout_s: float) -> tuple[Any, int]:
    """(an object reference to the weights, their version) of the rollout actor with the
    newest version (they differ only if the learner was lost during a sync): where a learner
    group restarted without a checkpoint starts from."""
    versions = ray.get([t.weights_version.remote() for t in targets], timeout=timeout_s)
    newest = max(range(len(targets)), key=lambda i: versions[i])
    state, version = targets[newest].weights.options(num_returns=2).remote()
    return state, int(ray.get(version, timeout=timeout_s))
