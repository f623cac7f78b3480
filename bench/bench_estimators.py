"""Trajectory vs forward-process estimator: rollout and learner seconds, bytes per sample.

    .venv/bin/python -m bench.bench_estimators [--repeats 3] [--prompts 8] [--draws 4]
        [--out bench/results_estimators.json]

For each world (the toy world, and the tiny random Show-o of ``configs/showo_tiny_random.yaml``
at its own S and at S = 16), one process builds the policy once and, for each estimator with
the config's other settings, generates one batch of ``B`` prompts x ``G`` samples, then times
``learner_core.apply_update`` (the update every learner rank runs; median of ``--repeats``,
weights restored between repeats). Bytes per sample are the likelihood record the rollout
sends besides the final tokens, condition ids and images (``unmask_step``, ``old_logp``,
``sampled``, ``likelihood_tau``, ``mask_seed``, ``mask_counts``), and the pickled size of the
rollout batch without its images. Ratios are forward / trajectory in the same process.
"""

from __future__ import annotations

import argparse
import copy
import json
import pickle
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

from maskgrpo_ray.config import load_config
from maskgrpo_ray.pipeline.build import build_policy
from maskgrpo_ray.pipeline.learner_core import (
    TorchOptimizing,
    UpdatePlanner,
    apply_update,
    build_optimizer,
)
from maskgrpo_ray.pipeline.messages import RolloutBatch, TrainBatch
from maskgrpo_ray.pipeline.phases import generate
from maskgrpo_ray.pipeline.settings import settings_from_config
from maskgrpo_ray.prompts.loading import load_prompts

ROOT = Path(__file__).resolve().parents[1]
WORLDS = {
    "toy (S=8)": ("toy.yaml", []),
    "tiny Show-o (S=4, config)": ("showo_tiny_random.yaml", []),
    "tiny Show-o (S=16)": ("showo_tiny_random.yaml", ["rollout.unmasking_steps=16"]),
}


def record_bytes(rb: RolloutBatch) -> int:
    parts = (rb.unmask_step, rb.old_logp, rb.sampled, rb.likelihood_tau, rb.mask_seed)
    return sum(x.numel() * x.element_size() for x in (*parts, rb.mask_counts) if x is not None)


def measure(world: str, estimator: str, args: argparse.Namespace) -> dict[str, float | str]:
    config, extra = WORLDS[world]
    overrides = [
        *extra,
        f"likelihood.estimator={estimator}",
        f"likelihood.forward.mask_draws={args.draws}",
        "train.warmup_updates=0",
    ]
    cfg = load_config(ROOT / "configs" / config, overrides)
    s = settings_from_config(cfg)
    torch.manual_seed(0)
    policy = build_policy(cfg.model).eval()
    prompts = load_prompts("toy", "train")[: args.prompts]
    t0 = time.perf_counter()
    rb = generate(
        policy,
        prompts,
        list(range(len(prompts))),
        policy_version=0,
        generator=torch.Generator().manual_seed(0),
        **s.rollout.kwargs(),
    )
    gen_s = time.perf_counter() - t0
    adv = torch.randn(rb.num_samples, generator=torch.Generator().manual_seed(1))
    batch = TrainBatch.from_rollout(rb, adv)
    start = copy.deepcopy(policy.state_dict())
    times = []
    for _ in range(args.repeats):
        policy.load_state_dict(start)
        opt = TorchOptimizing(policy, build_optimizer(s.update, policy), s.update.grad_clip_norm)
        plan = UpdatePlanner(s.update).plan(0)
        t0 = time.perf_counter()
        apply_update(opt, batch, plan, s.update)
        times.append(time.perf_counter() - t0)
    n = rb.num_samples
    units = rb.old_logp.shape[1]
    return {
        "world": world,
        "estimator": estimator,
        "samples": n,
        "units_per_sample": units,
        "generate_seconds": gen_s,
        "update_seconds": statistics.median(times),
        "record_bytes_per_sample": record_bytes(rb) / n,
        "pickled_bytes_per_sample": len(pickle.dumps(replace(rb, images=rb.images[:0]))) / n,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--draws", type=int, default=4, help="K of the forward estimator")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results_estimators.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    print(
        f"{'world':28s} {'estimator':10s} {'units':>5s} {'rollout s':>9s} {'learner s':>9s} "
        f"{'record B/sample':>15s} {'pickled B/sample':>16s}"
    )
    for world in WORLDS:
        pair = [measure(world, est, args) for est in ("trajectory", "forward")]
        for r in pair:
            rows.append(r)
            print(
                f"{r['world']:28s} {r['estimator']:10s} {r['units_per_sample']:5d} "
                f"{r['generate_seconds']:9.3f} {r['update_seconds']:9.3f} "
                f"{r['record_bytes_per_sample']:15.0f} {r['pickled_bytes_per_sample']:16.0f}"
            )
        t, f = pair
        print(
            f"{'':28s} forward/trajectory: rollout x{f['generate_seconds'] / t['generate_seconds']:.2f}, "
            f"learner x{f['update_seconds'] / t['update_seconds']:.2f}, record bytes "
            f"x{f['record_bytes_per_sample'] / t['record_bytes_per_sample']:.3f}, pickled "
            f"x{f['pickled_bytes_per_sample'] / t['pickled_bytes_per_sample']:.2f}"
        )
    Path(args.out).write_text(json.dumps({"draws": args.draws, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
