"""The driver-free data plane of the Ray backend: rollouts stay in the object store.

A rollout actor returns each chunk as three objects (``RolloutActor.generate_split``): a small
:class:`RolloutMeta`, the rollout without its images and the images. The reward actor reads
the last two and returns a ``RewardResult``. The driver fetches only the meta and the rewards:
its view of the chunk is a :class:`RolloutRefs` (prompts, positions, group size, policy
version, and references). It filters and computes advantages from rewards alone, then sends
each learner rank a :class:`ShardPlan` (which groups of which chunk, their advantages) with the
chunk references; the rank fetches those chunks itself (:func:`fetch_shard`) and builds its
``TrainBatch`` shard, equal to ``TrainBatch.shard`` of the batch the driver used to assemble.

The driver fetches rollout tensors only to draw a sample grid (:func:`fetch_rollout`).
:class:`Traffic` counts what the driver sends and receives (``bytes/driver_*`` metrics).
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, replace
from typing import Any

import torch

from maskgrpo_ray.pipeline.messages import (
    RolloutBatch,
    RolloutView,
    TrainBatch,
    shard_bounds,
    tensor_nbytes,
)

REF_BYTES = 100
"""Bytes a pickled object reference takes on the wire (its 28-byte id and its owner's address;
counted rather than measured: pickling a reference outside Ray's own serializer pins it)."""


def wire_bytes(obj: Any) -> int:
    """Pickled size of a message that holds no object reference (what a hop moves)."""
    return len(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


@dataclass(frozen=True)
class RolloutMeta:
    """What the driver learns of a finished chunk without fetching it."""

    num_samples: int  # N of the chunk
    policy_version: int  # the weights that generated it
    tensor_bytes: int  # the rollout without its images
    image_bytes: int  # its images
    fixed_bytes: int = 0  # of tensor_bytes, the part not per sample (the tau schedule)

    @staticmethod
    def of(batch: RolloutBatch) -> RolloutMeta:
        tensors, images = rollout_nbytes(batch)
        tau = batch.likelihood_tau
        return RolloutMeta(
            batch.num_samples,
            batch.policy_version,
            tensors,
            images,
            tau.numel() * tau.element_size(),
        )


@dataclass(frozen=True)
class RolloutPiece:
    """Some groups of one chunk in the object store."""

    ref: Any  # ObjectRef of the chunk's RolloutBatch without images
    images: Any  # ObjectRef of its images uint8 [N, H, W, 3]
    groups: tuple[int, ...]  # the chunk's groups this piece holds, ascending
    meta: RolloutMeta  # of the whole chunk


@dataclass(frozen=True)
class RolloutRefs:
    """The driver's view of rollouts left in the object store: what it needs to filter,
    account and plan, never the tensors. Mirrors the parts of ``RolloutBatch`` the driver uses
    (``prompts``, ``prompt_indices``, ``group_size``, ``policy_version``, ``num_samples``,
    ``group_slice``, ``concat``)."""

    prompts: list[str]  # [B]
    prompt_indices: list[int]  # [B]
    group_size: int  # G
    pieces: tuple[RolloutPiece, ...]  # in order; their groups make up the B prompts

    def __post_init__(self) -> None:
        n = sum(len(p.groups) for p in self.pieces)
        if n != len(self.prompts) or len(self.prompt_indices) != len(self.prompts):
            raise ValueError(
                f"RolloutRefs: {len(self.prompts)} prompts, {len(self.prompt_indices)} "
                f"positions, {n} groups in its pieces"
            )

    @staticmethod
    def of_chunk(
        prompts: list[str], positions: list[int], ref: Any, images: Any, meta: RolloutMeta
    ) -> RolloutRefs:
        g, rest = divmod(meta.num_samples, max(len(prompts), 1))
        if rest or not prompts:
            raise ValueError(
                f"a chunk of {len(prompts)} prompts came back with {meta.num_samples} samples"
            )
        groups = tuple(range(len(prompts)))
        return RolloutRefs(
            list(prompts), list(positions), g, (RolloutPiece(ref, images, groups, meta),)
        )

    @property
    def num_samples(self) -> int:
        return len(self.prompts) * self.group_size

    @property
    def policy_version(self) -> int:
        """The oldest policy version among the pieces (as ``RolloutBatch.concat`` takes)."""
        return min(p.meta.policy_version for p in self.pieces)

    def nbytes(self) -> tuple[int, int]:
        """(tensor bytes without images, image bytes) of these groups, as a fetch would move."""
        t = i = 0
        for p in self.pieces:
            n, m = len(p.groups) * self.group_size, p.meta
            t += (m.tensor_bytes - m.fixed_bytes) * n // m.num_samples + m.fixed_bytes
            i += m.image_bytes * n // m.num_samples
        return t, i

    def group_slice(self, keep: torch.Tensor) -> RolloutRefs:
        """Keep the groups where ``keep`` (bool ``[B]``) is True."""
        flags = keep.tolist()
        pieces, at = [], 0
        for p in self.pieces:
            groups = tuple(g for k, g in enumerate(p.groups) if flags[at + k])
            at += len(p.groups)
            if groups:
                pieces.append(replace(p, groups=groups))
        idx = [i for i, f in enumerate(flags) if f]
        return RolloutRefs(
            [self.prompts[i] for i in idx],
            [self.prompt_indices[i] for i in idx],
            self.group_size,
            tuple(pieces),
        )

    @staticmethod
    def concat(batches: list[RolloutRefs]) -> RolloutRefs:
        if any(b.group_size != batches[0].group_size for b in batches):
            raise ValueError("cannot concatenate rollouts with different group sizes")
        return RolloutRefs(
            [x for b in batches for x in b.prompts],
            [x for b in batches for x in b.prompt_indices],
            batches[0].group_size,
            tuple(p for b in batches for p in b.pieces),
        )


def concat_rollouts(parts: list[Any]) -> Any:
    """``RolloutBatch.concat`` or ``RolloutRefs.concat``, by the parts' type."""
    if all(isinstance(p, RolloutRefs) for p in parts):
        return RolloutRefs.concat(parts)
    if all(isinstance(p, RolloutBatch) for p in parts):
        return RolloutBatch.concat(parts)
    raise TypeError("cannot concatenate in-process rollouts with object-store ones")


def _refs(rollout: RolloutView) -> RolloutRefs:
    if not isinstance(rollout, RolloutRefs):
        raise TypeError(f"a rollout is a RolloutBatch or a RolloutRefs, not {type(rollout)}")
    return rollout


def rollout_nbytes(rollout: RolloutBatch | RolloutView) -> tuple[int, int]:
    """(tensor bytes without images, image bytes) of a rollout, fetched or not."""
    if not isinstance(rollout, RolloutBatch):
        return _refs(rollout).nbytes()
    images = rollout.images.numel() * rollout.images.element_size()
    return tensor_nbytes(rollout) - images, images


def _group_mask(num_groups: int, groups: tuple[int, ...]) -> torch.Tensor:
    keep = torch.zeros(num_groups, dtype=torch.bool)
    keep[list(groups)] = True
    return keep


def assemble(
    batches: list[RolloutBatch], groups: list[tuple[int, ...]], images: list[Any] | None = None
) -> RolloutBatch:
    """The chosen groups of fetched chunks, concatenated in order (``images``: put back)."""
    parts = []
    for i, (rb, gs) in enumerate(zip(batches, groups, strict=True)):
        if images is not None:
            rb = rb.with_images(images[i])
        parts.append(rb.group_slice(_group_mask(len(rb.prompts), gs)))
    return RolloutBatch.concat(parts)


def fetch_rollout(rollout: RolloutBatch | RolloutView, images: bool = True) -> RolloutBatch:
    """The tensors of a rollout (from the object store when it is there), in its order;
    without ``images`` they are ``[N, 0, 0, 3]``. A ``RolloutBatch`` is returned as it is."""
    if isinstance(rollout, RolloutBatch):
        return rollout
    import ray

    pieces = _refs(rollout).pieces
    batches = ray.get([p.ref for p in pieces])
    imgs = ray.get([p.images for p in pieces]) if images else None
    return assemble(batches, [p.groups for p in pieces], imgs)


@dataclass(frozen=True)
class TrainRefs:
    """The kept groups (in the object store) with their advantages: what the driver hands the
    learner group instead of a ``TrainBatch``."""

    rollout: RolloutRefs
    advantages: torch.Tensor  # [N] float32

    def __post_init__(self) -> None:
        n = self.rollout.num_samples
        if self.advantages.shape != (n,):
            raise ValueError(f"advantages must be [N={n}], got {tuple(self.advantages.shape)}")
        if not bool(torch.isfinite(self.advantages).all()):
            raise ValueError("advantages must be finite")

    @property
    def num_samples(self) -> int:
        return self.rollout.num_samples

    @property
    def group_size(self) -> int:
        return self.rollout.group_size

    def shard(self, rank: int, world: int) -> tuple[ShardPlan, list[Any]]:
        """Rank ``rank``'s plan and the chunk references it fetches: the same samples, in the
        same order, as ``TrainBatch.shard(rank, world)`` of the assembled batch (a contiguous
        range; the groups it touches are fetched, then cut to the range). A rank without
        samples still gets one chunk (none of its groups) so it can build an empty batch of
        the right kind."""
        g = self.group_size
        start, stop = shard_bounds(self.num_samples, rank, world)
        order: list[tuple[int, int]] = [
            (pi, grp) for pi, p in enumerate(self.rollout.pieces) for grp in p.groups
        ]
        first = start // g
        mine = range(first, -(-stop // g)) if stop > start else range(0)
        pieces = self.rollout.pieces
        refs: list[Any] = []
        groups: list[tuple[int, ...]] = []
        chunk_bytes, last = 0, -1
        for i in mine:
            pi, grp = order[i]
            if pi != last:
                refs.append(pieces[pi].ref)
                groups.append(())
                chunk_bytes += pieces[pi].meta.tensor_bytes
                last = pi
            groups[-1] = (*groups[-1], grp)
        if not refs:
            refs, groups = [pieces[0].ref], [()]
            chunk_bytes = pieces[0].meta.tensor_bytes
        adv = self.advantages[start:stop].clone()
        plan = ShardPlan(
            tuple(groups),
            adv,
            self.rollout.policy_version,
            stop - start,
            chunk_bytes,
            start - first * g if stop > start else 0,
        )
        return plan, refs


@dataclass(frozen=True)
class ShardPlan:
    """One learner rank's part of an update: which groups of which fetched chunk (the chunk
    references travel beside it), their advantages, and the update's policy version."""

    groups: tuple[tuple[int, ...], ...]  # per chunk reference: its groups, ascending
    advantages: torch.Tensor  # [n] float32, this rank's rows
    policy_version: int  # the oldest version in the whole update (as the assembled batch had)
    num_samples: int  # n
    fetch_bytes: int = 0  # the chunks this rank fetches (tensor bytes)
    row_offset: int = 0  # the rank's first sample within the fetched groups' samples


def build_shard(plan: ShardPlan, batches: list[RolloutBatch]) -> TrainBatch:
    """A rank's ``TrainBatch`` from its plan and the chunks it fetched."""
    rb = assemble(batches, list(plan.groups))
    tb = TrainBatch.from_rollout(rb, torch.zeros(rb.num_samples))
    tb = tb.rows(plan.row_offset, plan.row_offset + plan.num_samples)
    return replace(tb, advantages=plan.advantages, policy_version=plan.policy_version).validate()


def fetch_shard(plan: ShardPlan, refs: list[Any]) -> TrainBatch:
    """On a learner rank: fetch the plan's chunks from the object store and build the shard."""
    import ray

    return build_shard(plan, ray.get(refs))


@dataclass
class Traffic:
    """Bytes the driver process sends and receives on the data plane during one step."""

    received: int = 0  # metas, rewards, and rollout tensors fetched for a sample grid
    sent: int = 0  # to the filter and the learner ranks (references counted as REF_BYTES)
    learner_fetch: int = 0  # chunk bytes the learner ranks fetch themselves (not the driver)

    def add(self, other: Traffic) -> None:
        self.received += other.received
        self.sent += other.sent
        self.learner_fetch += other.learner_fetch

    def take(self) -> dict[str, float]:
        out = {
            "bytes/driver_received": float(self.received),
            "bytes/driver_sent": float(self.sent),
            "bytes/learner_fetch": float(self.learner_fetch),
        }
        self.received = self.sent = self.learner_fetch = 0
        return out
