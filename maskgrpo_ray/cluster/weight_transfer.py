"""Collective weight sync: learner rank 0 broadcasts packed buckets to the rollout actors.

One ``torch.distributed`` process group per membership, separate from the learner's own world:
rank 0 is learner rank 0, ranks ``1..n`` the rollout actors. It is built directly from a
``TCPStore`` and ``ProcessGroupGloo`` / ``ProcessGroupNCCL`` (no default group, so a rollout
actor needs none and the learner's world is untouched), as OpenRLHF and verl build their
learner-to-rollout groups. The trained tensors are packed, in a fixed order, into flat buckets of
at most ``bucket_bytes`` (one dtype per bucket; a tensor larger than a bucket gets one of its
own) and each bucket is one broadcast: a few large messages instead of one per tensor, the known
bottleneck of per-parameter broadcasts.

The same :class:`Channel` runs on both sides, so it belongs to neither: learner rank 0
(``learner/worker.py``) sends (:meth:`Channel.send`), the rollout actors (``actors/rollout.py``)
receive into their own tensors (:meth:`Channel.receive`). Nothing here imports Ray: the actors
call it, ``learner/weight_sync.py`` orchestrates.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorMeta:
    """Name, shape and dtype of one trained tensor; the same list on every member."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # str(torch.dtype), e.g. "torch.float32"

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype.removeprefix("torch."))


def tensor_metas(state: Mapping[str, torch.Tensor]) -> list[TensorMeta]:
    return [TensorMeta(k, tuple(v.shape), str(v.dtype)) for k, v in state.items()]


def plan_buckets(metas: list[TensorMeta], bucket_bytes: int) -> list[list[int]]:
    """Indices into ``metas`` per bucket: in order, one dtype per bucket, at most
    ``bucket_bytes`` each unless a single tensor is larger (then it is a bucket alone)."""
    buckets: list[list[int]] = []
    size, dtype = 0, None
    for i, m in enumerate(metas):
        nbytes = m.numel * m.torch_dtype.itemsize
        if not buckets or m.dtype != dtype or size + nbytes > bucket_bytes:
            buckets.append([])
            size, dtype = 0, m.dtype
        buckets[-1].append(i)
        size += nbytes
    return buckets


def pack(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One flat tensor of the tensors' elements, in order (all of one dtype)."""
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def unpack(flat: torch.Tensor, metas: list[TensorMeta]) -> list[torch.Tensor]:
    """Views of ``flat`` with the shapes of ``metas`` (the inverse of :func:`pack`)."""
    total = sum(m.numel for m in metas)
    if total != flat.numel():
        raise ValueError(f"bucket has {flat.numel()} elements, the metas {total}")
    out, at = [], 0
    for m in metas:
        out.append(flat[at : at + m.numel].view(m.shape))
        at += m.numel
    return out


def is_loopback(host: str) -> bool:
    return host.startswith("127.") or host in ("::1", "localhost")


def open_store(host: str, timeout_s: float) -> dist.TCPStore:
    """Rank 0's store on a free port of ``host`` (its ``.port``); members connect later."""
    if is_loopback(host):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    return dist.TCPStore(
        host, 0, None, True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
    )


class Channel:
    """One member of a sync group.

    Args:
        host, port: rank 0's store (``open_store``); rank 0 passes its store as ``store``.
        rank, world: this member's rank (0: the learner) and the group size.
        device: where received tensors live; ``cuda`` selects NCCL, else gloo.
        metas: the trained tensors, in sending order.
        bucket_bytes: bucket size (the same on every member).
        timeout_s: a broadcast that waits longer fails (a member died).
    """

    def __init__(
        self,
        host: str,
        port: int,
        rank: int,
        world: int,
        device: torch.device,
        metas: list[TensorMeta],
        bucket_bytes: int,
        timeout_s: float,
        store: dist.TCPStore | None = None,
    ) -> None:
        timeout = timedelta(seconds=timeout_s)
        if is_loopback(host):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        if store is None:
            store = dist.TCPStore(host, port, None, False, timeout=timeout)
        self.store, self.rank, self.world, self.device = store, rank, world, device
        self.metas, self.buckets = metas, plan_buckets(metas, bucket_bytes)
        if device.type == "cuda":
            torch.cuda.set_device(device)
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self.pg: Any = dist.ProcessGroupNCCL(store, rank, world, opts)
        else:
            self.pg = dist.ProcessGroupGloo(store, rank, world, timeout)

    def _broadcast(self, flat: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.pg.broadcast([flat], opts).wait()

    def send(self, state: Mapping[str, torch.Tensor]) -> int:
        """Rank 0: broadcast ``state`` (names and order of ``metas``); returns bytes sent."""
        sent = 0
        for idx in self.buckets:
            flat = pack([state[self.metas[i].name] for i in idx]).to(self.device)
            self._broadcast(flat)
            sent += flat.numel() * flat.element_size()
        self._finish()
        return sent

    def receive(self, into: Mapping[str, torch.Tensor]) -> int:
        """Ranks > 0: receive every bucket and copy it into ``into`` (this member's tensors,
        by name); returns bytes received."""
        got = 0
        for idx in self.buckets:
            metas = [self.metas[i] for i in idx]
            n = sum(m.numel for m in metas)
            flat = torch.empty(n, dtype=metas[0].torch_dtype, device=self.device)
            self._broadcast(flat)
            with torch.no_grad():
                for m, view in zip(metas, unpack(flat, metas), strict=True):
                    into[m.name].copy_(view)
            got += flat.numel() * flat.element_size()
        self._finish()
        return got

    def _finish(self) -> None:
        """On CUDA, wait until the broadcasts and copies have run: NCCL's ``wait()`` only
        orders the current stream after them, so without this a send or receive would return
        (and be timed, and acknowledged) before the bytes moved. Gloo's ``wait()`` blocks."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def close(self) -> None:
        """Leave the group: abort its communicators (an NCCL group holds GPU buffers until
        then) and forget it. The channel is unusable afterwards."""
        if self.pg is not None:
            self.pg.abort()
        self.pg = None
