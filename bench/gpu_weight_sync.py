"""bench_gpu's section 5, **weight_sync**: the trained tensors at full size through the object store
of a local one-node Ray cluster to a second actor (``ray.put`` and the actor's fetch)."""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

import torch

from bench.gpu_common import BUDGET_S, Bench, SectionClock, print_table, timed_call


class SyncTarget:
    """Stands in for a rollout actor's ``load_weights``: receives the state, reports bytes."""

    def load_weights(self, state: dict[str, torch.Tensor], version: int) -> tuple[int, int]:
        return version, sum(v.numel() * v.element_size() for v in state.values())


def bench_weight_sync(b: Bench) -> dict[str, Any]:
    """Trained tensors to the CPU (as ``trained_state``), ``ray.put``, a second actor's fetch."""
    if b.args.no_ray:
        return {"skipped": "--no-ray"}
    import ray

    from maskgrpo_ray.cluster.attach import connect, disconnect

    if __name__ != "__main__":  # imported (tests): ship SyncTarget by value
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    params = [(n, p) for n, p in b.policies[b.shapes()[0].name].named_parameters()]
    d2h_s, state = timed_call(
        lambda: {n: p.detach().cpu().clone() for n, p in params if p.requires_grad}, b.device
    )
    nbytes = sum(v.numel() * v.element_size() for v in state.values())
    b.say(f"weight sync: {nbytes / 1e9:.4g} GB in {len(state)} tensors; starting Ray")
    clock = SectionClock(BUDGET_S["weight_sync"] * b.args.budget_scale)
    handle = connect(None, num_cpus=4, include_dashboard=False)
    rows: list[dict[str, Any]] = []
    try:
        target = ray.remote(num_cpus=1)(SyncTarget).remote()
        for version in range(1, (2 if b.args.smoke else 4) + 1):
            if rows and not clock.fits(rows[-1]["put_s"] + rows[-1]["fetch_s"]):
                break
            t0 = time.perf_counter()
            ref = ray.put(state)
            t1 = time.perf_counter()
            got = ray.get(target.load_weights.remote(ref, version), timeout=600)
            t2 = time.perf_counter()
            assert got == (version, nbytes), (got, version, nbytes)
            del ref
            rows.append({"version": version, "put_s": t1 - t0, "fetch_s": t2 - t1})
            rows[-1]["gb_per_s"] = nbytes / 1e9 / (t2 - t0)
    finally:
        disconnect(handle)
    steady = rows[1:] or rows  # the first push includes the actor's start
    out = {"bytes": nbytes, "tensors": len(state), "d2h_s": d2h_s, "pushes": rows}
    out |= {k: statistics.median(r[k] for r in steady) for k in ("put_s", "fetch_s", "gb_per_s")}
    print_table(
        f"weight sync: {nbytes / 1e9:.4g} GB of trained tensors ({b.args.dtype}) through the Ray "
        f"object store, one node (GPU->CPU copy before it: {d2h_s:.3f} s)",
        ["version", "put_s", "fetch_s", "gb_per_s"],
        rows,
    )
    return out
