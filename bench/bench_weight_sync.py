"""Weight-sync transports on a local Ray cluster: object store vs bucketed collective broadcast.

    .venv/bin/python -m bench.bench_weight_sync [--sizes-mb 16,64,256] [--receivers 2]
        [--bucket-mb 256] [--repeats 3] [--out bench/results_weight_sync.json]

One sender actor (the learner's rank 0) holds a state dict of float32 tensors of 4 MiB each
adding up to the size; ``--receivers`` actors (rollout actors) hold tensors of the same names and
shapes. Per size, in the same process and cluster:

* ``object_store``: what ``ObjectStoreSync`` does: the sender returns its tensors (one object in
  the store), every receiver fetches that object and copies it into its tensors;
* ``collective``: what ``CollectiveSync`` does: the sender and the receivers in one gloo group
  (``maskgrpo_ray/cluster/weight_transfer.py``, the same ``Channel``), the tensors packed into
  ``--bucket-mb`` buckets and broadcast; the group is formed once, outside the timing, as in a
  run.

Reported: seconds per sync (median of ``--repeats``, every receiver holding the new values),
GB/s = bytes per receiver / seconds, and collective / object-store speed. On a GPU cluster the
collective runs on NCCL (the ``gpu`` path of ``bench/bench_gpu.py``); here both move host memory.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import ray
import torch

from maskgrpo_ray.cluster.weight_transfer import Channel, TensorMeta, open_store, tensor_metas

ROOT = Path(__file__).resolve().parents[1]
TENSOR_MB = 4


def size_table(size_mb: int) -> dict[str, tuple[int, ...]]:
    """``size_mb`` of float32 tensors of 4 MiB each (name -> shape)."""
    n = TENSOR_MB * (1 << 20) // 4
    return {f"layer{i}.weight": (n,) for i in range(size_mb // TENSOR_MB)}


@ray.remote(num_cpus=0.25)
class Member:
    """A learner rank (the sender, ``fill`` None: seeded random values) or a rollout actor
    (``fill`` 0: zeros) holding tensors of ``table``'s names and shapes in ``dtype``."""

    def __init__(self, table: dict[str, tuple[int, ...]], dtype: str, fill: float | None) -> None:
        torch.set_num_threads(1)
        dt = getattr(torch, dtype)
        g = torch.Generator().manual_seed(0)
        self.state = {
            k: torch.randn(s, generator=g).to(dt) if fill is None else torch.full(s, fill, dtype=dt)
            for k, s in table.items()
        }
        self.ch: Channel | None = None

    def weights(self) -> dict[str, torch.Tensor]:
        return self.state

    def load(self, state: dict[str, torch.Tensor]) -> float:
        with torch.no_grad():
            for k, v in state.items():
                self.state[k].copy_(v)
        return self.checksum()

    def checksum(self) -> float:
        return float(next(iter(self.state.values())).float().sum())

    def reset(self) -> None:
        for v in self.state.values():
            v.zero_()

    def open(self) -> tuple[str, int]:
        ip = ray.util.get_node_ip_address()
        self.store = open_store(ip, 300)
        return ip, int(self.store.port)

    def join(
        self, host: str, port: int, rank: int, world: int, metas: list[TensorMeta], bucket: int
    ) -> None:
        store = self.store if rank == 0 else None
        cpu = torch.device("cpu")
        self.ch = Channel(host, port, rank, world, cpu, metas, bucket, 300, store=store)

    def send(self) -> int:
        assert self.ch is not None
        return self.ch.send(self.state)

    def receive(self) -> float:
        assert self.ch is not None
        self.ch.receive(self.state)
        return self.checksum()


def time_transports(
    table: dict[str, tuple[int, ...]],
    dtype: str,
    receivers: int,
    bucket_mb: int,
    repeats: int,
    num_cpus: float = 0.25,
) -> dict[str, float]:
    """Seconds per sync of ``table``'s tensors from one sender to ``receivers`` actors, by the
    object store and by the bucketed collective (medians of ``repeats``; every receiver checked
    to hold the sender's values), with the tensors', parameters' and bytes' counts."""
    member = Member.options(num_cpus=num_cpus)
    sender = member.remote(table, dtype, None)
    targets = [member.remote(table, dtype, 0.0) for _ in range(receivers)]
    want = ray.get(sender.checksum.remote(), timeout=1200)
    dt = getattr(torch, dtype)
    metas = tensor_metas({k: torch.empty(s, dtype=dt) for k, s in table.items()})
    world, bucket = receivers + 1, bucket_mb << 20
    host, port = ray.get(sender.open.remote(), timeout=300)
    joins = [t.join.remote(host, port, i + 1, world, metas, bucket) for i, t in enumerate(targets)]
    ray.get([sender.join.remote(host, port, 0, world, metas, bucket), *joins], timeout=600)
    store_s, coll_s = [], []
    for r in range(repeats):
        t0 = time.perf_counter()
        ref = sender.weights.remote()
        got = ray.get([t.load.remote(ref) for t in targets], timeout=1200)
        store_s.append(time.perf_counter() - t0)
        assert got == [want] * receivers, (r, got, want)
        ray.get([t.reset.remote() for t in targets])  # the broadcast must bring the values
        t0 = time.perf_counter()
        send = sender.send.remote()
        got = ray.get([t.receive.remote() for t in targets], timeout=1200)
        ray.get(send, timeout=1200)
        coll_s.append(time.perf_counter() - t0)
        assert got == [want] * receivers, (r, got, want)
    for a in [sender, *targets]:
        ray.kill(a)
    n = sum(math.prod(s) for s in table.values())
    return {
        "tensors": len(table),
        "parameters": n,
        "bytes": n * torch.empty((), dtype=dt).element_size(),
        "object_store_s": statistics.median(store_s),
        "collective_s": statistics.median(coll_s),
    }


def bench_size(size_mb: int, receivers: int, bucket_mb: int, repeats: int) -> dict[str, float]:
    t = time_transports(size_table(size_mb), "float32", receivers, bucket_mb, repeats)
    nbytes = size_mb << 20
    s, c = t["object_store_s"], t["collective_s"]
    return {
        "size_mb": size_mb,
        "receivers": receivers,
        "object_store_s": s,
        "collective_s": c,
        "object_store_gb_s": nbytes / s / 1e9,
        "collective_gb_s": nbytes / c / 1e9,
        "speedup": s / c,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes-mb", default="16,64,256")
    ap.add_argument("--receivers", type=int, default=2)
    ap.add_argument("--bucket-mb", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results_weight_sync.json"))
    args = ap.parse_args()
    from maskgrpo_ray.cluster.attach import connect

    connect(None, num_cpus=4, include_dashboard=False)
    rows = [
        bench_size(int(mb), args.receivers, args.bucket_mb, args.repeats)
        for mb in args.sizes_mb.split(",")
    ]
    ray.shutdown()
    print("| size | object store s (GB/s) | collective s (GB/s) | collective / object store |")
    print("|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['size_mb']} MB | {r['object_store_s']:.3f} ({r['object_store_gb_s']:.2f}) "
            f"| {r['collective_s']:.3f} ({r['collective_gb_s']:.2f}) | {r['speedup']:.2f}x |"
        )
    Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
