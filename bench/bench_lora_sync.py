"""Weight sync per update at Show-o 512's size: the full trained weights vs a LoRA adapter.

    .venv/bin/python -m bench.bench_lora_sync [--rank 16] [--targets q_proj,k_proj,v_proj,dense]
        [--dtype bfloat16] [--repeats 2] [--no-full] [--out bench/results_lora_sync.json]

The tensors are the real ones' shapes: the full-size Show-o 512 checkpoint's parameter list
(``tests/fixtures/showo_reference/showo_512_state_keys.json``, made from the official
showlab/Show-o classes), filled with random values. A LoRA adapter of rank ``r`` on a linear
weight ``[out, in]`` is ``A [r, in]`` and ``B [out, r]``: the adapter tensors peft creates for the
``--targets`` layers (name suffixes, as ``model.lora.target_modules``), float32 as peft keeps
them. Both are pushed from one sender actor (learner rank 0) to one receiver actor (a rollout
actor) on a local Ray cluster, by the two syncs a run uses (``learner.weight_sync``):
``object_store`` (the sender's tensors in the object store, the receiver copies them in) and
``collective`` (``weight_transfer.Channel``'s bucketed broadcast over gloo here, NCCL on GPUs).
Printed: tensors, bytes and seconds per sync (median of ``--repeats``) and the full / LoRA ratios.
On this CPU machine both syncs move host memory; a GPU cluster's NCCL numbers differ (bench_gpu).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import ray
import torch

from bench.bench_weight_sync import time_transports

ROOT = Path(__file__).resolve().parents[1]
KEYS = ROOT / "tests" / "fixtures" / "showo_reference" / "showo_512_state_keys.json"


def shapes(path: Path = KEYS) -> dict[str, tuple[int, ...]]:
    """Show-o 512's parameters (name -> shape), buffers left out."""
    table = json.loads(path.read_text())
    return {k: tuple(v["shape"]) for k, v in table.items() if v.get("kind") == "parameter"}


def lora_shapes(full: dict[str, tuple[int, ...]], rank: int, targets: list[str]) -> dict:
    """The adapter tensors peft makes for ``targets`` (linear weights whose module name ends
    with one of them): ``A [r, in]``, ``B [out, r]``."""
    out: dict[str, tuple[int, ...]] = {}
    for name, shape in full.items():
        module, _, leaf = name.rpartition(".")
        if leaf != "weight" or len(shape) != 2 or module.rsplit(".", 1)[-1] not in targets:
            continue
        rows, cols = shape
        out[f"{module}.lora_A.default.weight"] = (rank, cols)
        out[f"{module}.lora_B.default.weight"] = (rows, rank)
    return out


def bench(table: dict, dtype: str, repeats: int, bucket_mb: int = 256) -> dict[str, float]:
    """One learner rank to one rollout actor (bench/bench_weight_sync.py's harness)."""
    return time_transports(table, dtype, 1, bucket_mb, repeats, num_cpus=0.5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--targets", default="q_proj,k_proj,v_proj,dense")
    ap.add_argument("--dtype", default="bfloat16", help="the full weights' dtype (Show-o's bf16)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--no-full", action="store_true", help="count the full weights, not sync")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results_lora_sync.json"))
    args = ap.parse_args()
    from maskgrpo_ray.cluster.attach import connect

    full = shapes()
    adapter = lora_shapes(full, args.rank, args.targets.split(","))
    connect(None, num_cpus=2, include_dashboard=False)
    rows = {"lora": {"rank": args.rank, "targets": args.targets, "dtype": "float32"}}
    rows["lora"].update(bench(adapter, "float32", args.repeats))
    rows["full"] = {"dtype": args.dtype}
    if args.no_full:
        n = sum(math.prod(s) for s in full.values())
        item = torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
        rows["full"].update({"tensors": len(full), "parameters": n, "bytes": n * item})
    else:
        rows["full"].update(bench(full, args.dtype, args.repeats))
    ray.shutdown()
    f, lo = rows["full"], rows["lora"]
    print(
        "| trained tensors | tensors | parameters | bytes per sync | object store s | collective s |"
    )
    print("|---|---|---|---|---|---|")
    for name, r in (("full weights (" + f["dtype"] + ")", f), (f"LoRA r={args.rank}", lo)):
        s = [f"{r[k]:.3f}" if k in r else "-" for k in ("object_store_s", "collective_s")]
        print(
            f"| {name} | {r['tensors']} | {r['parameters'] / 1e6:.2f} M | "
            f"{r['bytes'] / 1e6:.1f} MB | {s[0]} | {s[1]} |"
        )
    print(f"bytes full / LoRA: {f['bytes'] / lo['bytes']:.0f}x")
    if "object_store_s" in f:
        print(
            f"seconds full / LoRA: object store {f['object_store_s'] / lo['object_store_s']:.0f}x, "
            f"collective {f['collective_s'] / lo['collective_s']:.0f}x"
        )
    Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
