"""Trajectory shrinkage on one GPU: what ``train.trajectory_shrinkage: s`` saves the learner.

The full-size Show-o of ``bench/bench_gpu.py`` (random weights, the transformer in ``--dtype``)
at 512 px (``L = 1024``, ``S = 50``; ``--resolutions``), one group of ``G = 6`` samples at the
initial weights, each likelihood (Eq. 14, the baseline, and the Gumbel marginal, the shipped
configs'), and ``learner_core.apply_update`` training ``--steps`` consecutive unmasking steps
(starting at ``--first-step``: a block of ``s`` steps shares one input row only when its steps
are trained together) at ``s`` in ``--shrinkage`` with micro-batches of ``--micro-batch`` model
input rows (issue 57: micro-batches count rows, so a forward holds as many rows at any ``s``).
Per configuration: seconds per update (the no-grad recompute of the old log-probs included),
pairs/s, the time against ``s = 1`` at the same likelihood, the planner's prediction of that
ratio (``cost_model.Workload.learner_pairs`` with the built-in profile's
``learner_scoring_share``: what shrinks is the forward and backward over rows, what does not is
the per-pair scoring), the rows per sample and the on-policy check at the block starts
(``first_ratio_abs_dev_max`` against the rollout's cached log-probs, ``onpolicy_measured_share``).

A GPU session runs it (``bench/device_session.sh``, section ``shrinkage``):
``python -m bench.bench_gpu_shrinkage --out $OUT/bench_gpu_shrinkage.json``, about 2 minutes on
an H100 with the defaults. ``--smoke``: tiny random Show-o on the CPU, float32, seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from bench.bench_gpu import device_info
from bench.gpu_common import (
    CONFIG,
    FULL_SHAPES,
    GROUP_SIZE,
    LIKELIHOODS,
    SMOKE_SHAPES,
    Bench,
    SectionClock,
    build_policies,
    fresh_memory,
    measure,
    peak_gib,
    print_table,
)
from bench.gpu_rollout import group_rollout
from maskgrpo_ray.pipeline.learner_core import (
    TorchOptimizing,
    UpdatePlan,
    apply_update,
    build_optimizer,
)
from maskgrpo_ray.pipeline.messages import TrainBatch
from maskgrpo_ray.planner.cost_model import PROFILES, Workload

BUDGET_S = 240.0
DEFAULTS = {  # (full run, smoke run)
    "steps": (16, 4),
    "first_step": (8, 0),
    "micro_batch": (8, 4),
    "repeats": (2, 1),
    "min_time_s": (2.0, 0.0),
    "dtype": ("bfloat16", "float32"),
    "resolutions": ("512", "512"),
}
PROFILE_OF = {"256px": "showo_256_h100", "512px": "showo_512_h100"}


def predicted_ratio(shape_name: str, steps: int, s: int, likelihood: str) -> float | None:
    """The planner's learner time at ``s`` over ``s = 1`` for ``steps`` trained units: the
    built-in profile's scoring share for the marginal, none for Eq. 14 (its per-pair sums are
    counted with the rows). None for a shape without a built-in profile (the smoke's)."""
    name = PROFILE_OF.get(shape_name)
    if name is None:
        return None
    f = PROFILES[name].learner_scoring_share if likelihood == "marginal" else 0.0
    work = Workload(1, GROUP_SIZE, steps, units_per_sample=steps, shrinkage=s)
    return work.learner_pairs(f) / steps


def shrinkage_config(
    b: Bench,
    clock: SectionClock,
    opt: TorchOptimizing,
    batch: TrainBatch,
    s: int,
    initial: dict[str, torch.Tensor],
) -> dict[str, Any]:
    """Time ``apply_update`` at shrinkage ``s`` on ``batch`` (one warm-up update first), from
    the ``initial`` weights (the rollout's) and a fresh optimizer state, so that the warm-up's
    on-policy check compares the same weights."""
    a = b.args
    opt.module.load_state_dict(initial)
    opt.optimizer.state.clear()
    steps = torch.arange(a.first_step, a.first_step + a.steps)
    plan = UpdatePlan(steps, learning_rate=CONFIG.update.learning_rate)
    settings = replace(
        CONFIG.update,
        num_steps=int(batch.old_logp.shape[1]),
        micro_batch_pairs=a.micro_batch,
        shrinkage=s,
    )
    pairs = batch.num_samples * len(steps)
    metrics: list[dict[str, Any]] = []
    fresh_memory(b.device)
    try:
        timing = measure(
            lambda: metrics.append(apply_update(opt, batch, plan, settings)), b, clock, warmup=True
        )
    except torch.OutOfMemoryError:
        opt.zero_grad()
        return {"pairs": pairs, "skipped": "out of memory"}
    m = metrics[0]  # the warm-up: the first update at the rollout's weights
    sec = timing["seconds"]
    row = timing | {"pairs": pairs, "pairs_per_s": pairs / sec}
    row |= {"rows_per_sample": m["forward_passes_per_sample"]}
    row |= {k: m.get(k) for k in ("first_ratio_abs_dev_max", "onpolicy_measured_share")}
    return row | {"peak_mem_gib": peak_gib(b.device)}


def bench_shrinkage(b: Bench) -> dict[str, Any]:
    clock = SectionClock(BUDGET_S * b.args.budget_scale)
    rows: list[dict[str, Any]] = []
    gen = torch.Generator().manual_seed(b.args.seed)
    first = b.policies[b.shapes()[0].name]
    optimizer = build_optimizer(CONFIG.update, first)  # the weights are shared across shapes
    for shape in b.shapes():
        if b.args.first_step + b.args.steps > shape.num_steps:
            raise SystemExit(f"--first-step + --steps must be <= S = {shape.num_steps}")
        opt = TorchOptimizing(b.policies[shape.name], optimizer, grad_clip_norm=0.0)
        initial = {k: v.detach().clone() for k, v in opt.module.state_dict().items()}
        batches = {}  # every rollout at the initial weights, before any update
        for lik in LIKELIHOODS:
            adv = torch.randn(GROUP_SIZE, generator=gen)
            batches[lik] = TrainBatch.from_rollout(group_rollout(b, shape, lik), adv - adv.mean())
        for lik, batch in batches.items():
            per_call = None
            for s in b.args.shrinkage:
                row: dict[str, Any] = {"shape": shape.name, "likelihood": lik, "s": s}
                if per_call is not None and not clock.fits(2 * per_call):
                    rows.append(row | {"skipped": "time budget"})
                    continue
                b.say(f"shrinkage {shape.name} {lik} s={s}")
                row |= shrinkage_config(b, clock, opt, batch, s, initial)
                row["predicted_vs_s1"] = predicted_ratio(shape.name, b.args.steps, s, lik)
                per_call = row.get("seconds", per_call)
                rows.append(row)
        opt.zero_grad()
        opt.module.load_state_dict(initial)
        del initial
    base = {(r["shape"], r["likelihood"]): r.get("seconds") for r in rows if r["s"] == 1}
    for r in rows:
        one = base.get((r["shape"], r["likelihood"]))
        if "seconds" in r and one:
            r["time_vs_s1"] = r["seconds"] / one
    print_table(
        f"shrinkage: apply_update on one group of G=6, {b.args.steps} consecutive steps from "
        f"step {b.args.first_step}, micro-batches of {b.args.micro_batch} rows, p1 "
        f"({b.args.dtype}); time_vs_s1 measured, predicted_vs_s1 the planner's",
        ["shape", "likelihood", "s", "pairs", "seconds", "pairs_per_s", "time_vs_s1"]
        + ["predicted_vs_s1", "rows_per_sample", "first_ratio_abs_dev_max"]
        + ["onpolicy_measured_share", "peak_mem_gib", "repeats"],
        rows,
    )
    return {"rows": rows, "steps": b.args.steps, "first_step": b.args.first_step}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="Trajectory shrinkage on one GPU (see the docstring)")
    ap.add_argument("--smoke", action="store_true", help="tiny random Show-o, CPU, seconds")
    ap.add_argument("--device", default="auto", help="auto (cuda; smoke: cpu), cpu, cuda, cuda:1")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), help="transformer dtype")
    ap.add_argument("--resolutions", help="256 and/or 512 (default 512)")
    ap.add_argument("--shrinkage", default="1,2,4", help="values of s (1 first: the baseline)")
    ap.add_argument("--steps", type=int, help="consecutive unmasking steps trained (16)")
    ap.add_argument("--first-step", type=int, help="the first of them (8)")
    ap.add_argument("--micro-batch", type=int, help="model input rows per forward (8)")
    ap.add_argument("--repeats", type=int, help="timed updates per configuration at most (2)")
    ap.add_argument("--min-time-s", type=float, help="no more repeats once this is timed (2)")
    ap.add_argument("--budget-scale", type=float, default=1.0, help="x the time budget")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="results JSON (default $OUT/bench_gpu_shrinkage.json)")
    args = ap.parse_args(argv)
    for name, (full, smoke) in DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, smoke if args.smoke else full)
    args.resolutions = [r.strip() for r in str(args.resolutions).split(",")]
    args.shrinkage = [int(x) for x in args.shrinkage.split(",")]
    if args.shrinkage[0] != 1:
        ap.error("--shrinkage must start with 1 (the baseline the others are timed against)")
    args.peak_tflops, args.no_ray = None, True  # what bench_gpu's helpers read
    if args.out is None:
        out = os.environ.get("OUT")
        args.out = (
            str(Path(out) / "bench_gpu_shrinkage.json")
            if out
            else "bench/results_gpu_shrinkage.json"
        )
    return args


def run(args: argparse.Namespace) -> dict[str, Any] | None:
    """The measurement; None (after a message) when a GPU run finds no CUDA."""
    want = args.device if args.device != "auto" else ("cpu" if args.smoke else "cuda")
    if want.startswith("cuda") and not torch.cuda.is_available():
        print("bench_gpu_shrinkage: no CUDA device, nothing measured (--smoke: the CPU check)")
        return None
    if want == "cuda":
        want = f"cuda:{torch.cuda.current_device()}"
    device = torch.device(want)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    elif args.smoke:
        torch.set_num_threads(1)
    t0 = time.perf_counter()
    info = device_info(args, device)
    b = Bench(args, device, build_policies(args, device), info["peak_flops"], t0)
    shapes = SMOKE_SHAPES if args.smoke else FULL_SHAPES
    assert all(r in shapes for r in args.resolutions), args.resolutions
    b.results["meta"] = info | {"build_s": time.perf_counter() - t0}
    b.say(f"built on {info.get('device_name', device)} ({args.dtype})")
    b.results["shrinkage"] = bench_shrinkage(b)
    b.results["meta"]["elapsed_s"] = time.perf_counter() - t0
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(b.results, indent=1, default=str))
    b.say(f"results written to {out}")
    return b.results


def main(argv: list[str] | None = None) -> None:
    run(parse_args(argv))


if __name__ == "__main__":
    main()
