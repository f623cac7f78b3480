"""Show-o at full size on one GPU: rollout, learner, MFU, weight sync, first-update log-ratio.

The full-size architecture (Phi-1.5 transformer, 1.448e9 parameters, and the MAGVIT-v2
decoder) with random weights (``random_init_``'s recipe, which gives non-trivial logits), the
transformer in ``--dtype`` (bf16 default), MAGVIT in float32 (as ``load_showo_policy``), at
256 px (``L = 256``, ``S = 18``, as ``configs/showo_256_clip.yaml``) and 512 px (``L = 1024``,
``S = 50``); ``G = 6``, guidance 0, Show-o's sampler (``tau_0 = 1``, compounding anneal),
transition ``p1``: the sampler and the update are ``configs/showo_256_clip.yaml``'s. Sections (each prints a markdown table):

1. **rollout**: images/s of ``phases.generate`` for ``N`` in ``--batch-sizes``, with the cached
   likelihood Eq. 14 (the baseline) and the Gumbel marginal; the MAGVIT decode's share.
2. **fidelity**: the first update's ``|log pi - log pi_old|`` (the rollout's ``old_logp`` vs
   ``pair_log_probs`` in learner-sized micro-batches, same weights, same dtype) for p1 marginal,
   p1 eq14 and p2.
3. **learner**: (sample, step) pairs/s of ``learner_core.apply_update`` (``TorchOptimizing``,
   AdamW in the module's dtype: pure bf16, no fp32 master weights) on one group's ``TrainBatch``
   with ``--learner-steps`` of the ``S`` steps (evenly spread), per micro-batch size; peak
   ``torch.cuda.max_memory_allocated``.
4. **mfu**: model FLOPs = 2 x matmul parameters x tokens (x3 with backward). Parameters: the 24
   layers (every row) and the lm_head's 8192 codebook columns (the ``L`` image-token rows); the
   input embedding is a lookup. Tokens: the ``L + 2`` image rows per sample per step, plus the
   ``P = 129`` text rows once per distinct prompt (once per rollout; once per micro-batch in the
   learner, which recomputes the prefix). Attention products are not counted (their share is
   printed). Peak: the device's dense bf16 datasheet rate, or ``--peak-tflops``.
5. **weight_sync**: the trained tensors (copied to the CPU as ``trained_state`` does) through
   the object store of a local one-node Ray cluster to a second actor: ``ray.put`` and the
   actor's fetch, the two hops ``ObjectStoreSync`` makes.

Timing: ``torch.cuda.synchronize`` around each call and a host clock (a call is a whole phase,
host work included); one warm-up call per configuration (in the rollout, per resolution and
likelihood), then repeats until ``--min-time-s`` or ``--repeats``; the median. Each section has
a time budget (x ``--budget-scale``): a configuration predicted to overrun it is skipped and
recorded as skipped, so the default run takes about 8 minutes on an H100. Results go to
``--out`` (default ``$OUT/bench_gpu.json``, else ``bench/results_gpu.json``), rewritten after
every section.

Files, by what they measure: ``gpu_rollout.py`` (sections 1 and 2), ``gpu_learner.py`` (3 and
4), ``gpu_weight_sync.py`` (5), on ``gpu_common.py`` (the setting, the policies, the clock and the
tables); this file runs them and writes the summary.

Run: ``python -m bench.bench_gpu`` (GPU) or ``python -m bench.bench_gpu --smoke`` (tiny random
Show-o on the CPU, float32, one thread, seconds).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from bench.gpu_common import (
    DEFAULTS,
    GROUP_SIZE,
    LIKELIHOODS,
    Bench,
    build_policies,
    fresh_memory,
    is_cuda,
    print_table,
)
from bench.gpu_learner import bench_learner, bench_mfu
from bench.gpu_rollout import bench_fidelity, bench_rollout
from bench.gpu_weight_sync import bench_weight_sync
from maskgrpo_ray.planner.cost_model import peak_bf16


def summarize(b: Bench) -> dict[str, Any]:
    """One line per shape: each section's headline figure."""
    rows = []
    for shape in b.shapes():
        row: dict[str, Any] = {"shape": shape.name}
        for phase, key, unit in (
            ("rollout", "images_per_s", "img/s"),
            ("learner", "pairs_per_s", "pairs/s"),
        ):
            for lik in LIKELIHOODS:
                done = [
                    r[key]
                    for r in b.results[phase]["rows"]
                    if r["shape"] == shape.name and r["likelihood"] == lik and "seconds" in r
                ]
                row[f"{phase} {lik} ({unit}, best)"] = max(done, default=None)
        fid = {
            r["kind"]: r.get("max")
            for r in b.results["fidelity"]["rows"]
            if r["shape"] == shape.name
        }
        row["max abs log-ratio p1 marginal (nats)"] = fid.get("p1 marginal")
        row["sync (GB/s)"] = b.results["weight_sync"].get("gb_per_s")
        rows.append(row)
    print_table("summary", list(rows[0]), rows)
    return {"rows": rows}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="Show-o at full size on one GPU (see the docstring)")
    ap.add_argument("--smoke", action="store_true", help="tiny random Show-o, CPU, seconds")
    ap.add_argument("--device", default="auto", help="auto (cuda; smoke: cpu), cpu, cuda, cuda:1")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), help="transformer dtype")
    ap.add_argument("--resolutions", default="256,512", help="256 and/or 512")
    ap.add_argument("--batch-sizes", help="rollout N, multiples of G=6 (default 6,24,48)")
    ap.add_argument("--micro-batches", help="learner pairs per forward (default 4,8,16)")
    ap.add_argument("--learner-steps", type=int, help="unmasking steps trained per sample (8)")
    ap.add_argument("--repeats", type=int, help="timed calls per configuration at most (3)")
    ap.add_argument("--min-time-s", type=float, help="no more repeats once this is timed (3)")
    ap.add_argument("--fidelity-micro-batch", type=int, help="pairs per recomputation (8)")
    ap.add_argument("--budget-scale", type=float, default=1.0, help="x the section budgets")
    ap.add_argument("--peak-tflops", type=float, help="peak dense TFLOP/s for the MFU")
    ap.add_argument("--no-ray", action="store_true", help="skip the weight-sync section")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="results JSON (default $OUT/bench_gpu.json, else bench/)")
    args = ap.parse_args(argv)
    for name, (full, smoke) in DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, smoke if args.smoke else full)
    args.resolutions = [r.strip() for r in args.resolutions.split(",")]
    args.batch_sizes = [int(x) for x in str(args.batch_sizes).split(",")]
    args.micro_batches = [int(x) for x in str(args.micro_batches).split(",")]
    if any(n % GROUP_SIZE for n in args.batch_sizes):
        ap.error(f"--batch-sizes must be multiples of G={GROUP_SIZE} (whole groups)")
    if args.out is None:
        out = os.environ.get("OUT")
        args.out = str(Path(out) / "bench_gpu.json") if out else "bench/results_gpu.json"
    return args


def device_info(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """Device, versions, precision flags and the peak rate the MFU divides by."""
    info: dict[str, Any] = {"torch": torch.__version__, "device": str(device), "args": vars(args)}
    info |= {"threads": torch.get_num_threads(), "peak_flops": None}
    if args.peak_tflops:
        info["peak_flops"] = args.peak_tflops * 1e12
    if is_cuda(device):
        name = torch.cuda.get_device_name(device)
        info |= {"device_name": name, "tf32_matmul": torch.backends.cuda.matmul.allow_tf32}
        info |= {"tf32_cudnn": torch.backends.cudnn.allow_tf32}
        if info["peak_flops"] is None:
            info["peak_flops"] = peak_bf16(name)
    return info


def run(args: argparse.Namespace) -> dict[str, Any] | None:
    """The whole benchmark; None (after a message) when a GPU run finds no CUDA."""
    want = args.device if args.device != "auto" else ("cpu" if args.smoke else "cuda")
    if want.startswith("cuda") and not torch.cuda.is_available():
        print("bench_gpu: no CUDA device, nothing measured (--smoke checks the script on the CPU)")
        return None
    if want == "cuda":
        want = f"cuda:{torch.cuda.current_device()}"
    device = torch.device(want)
    if is_cuda(device):
        torch.cuda.set_device(device)
    elif args.smoke:
        torch.set_num_threads(1)  # shared CI/dev cores: one thread is faster and steadier
    t0 = time.perf_counter()
    info = device_info(args, device)
    b = Bench(args, device, build_policies(args, device), info["peak_flops"], t0)
    b.results["meta"] = info | {"build_s": time.perf_counter() - t0}
    b.say(f"built on {info.get('device_name', device)} ({args.dtype})")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for name, section in (
        ("rollout", bench_rollout),
        ("fidelity", bench_fidelity),
        ("learner", bench_learner),
        ("mfu", bench_mfu),
        ("weight_sync", bench_weight_sync),
        ("summary", summarize),
    ):
        b.results[name] = section(b)
        b.results["meta"]["elapsed_s"] = time.perf_counter() - t0
        out.write_text(json.dumps(b.results, indent=1, default=str))
        fresh_memory(device)
    b.say(f"results written to {out}")
    return b.results


def main(argv: list[str] | None = None) -> None:
    run(parse_args(argv))


if __name__ == "__main__":
    main()
