"""Learner-side log-prob recomputation: batched (sample, step) micro-batches vs the official
release's per-step loop (one forward per prompt group per unmasking step).

Both compute the same clipped-GRPO gradient on the same recorded rollout; the script checks the
gradients agree, then prints the time of each and the ratio. Run: ``python
bench/bench_logprob_recompute.py [--prompts 8] [--steps 8] [--micro-batch 256] [--repeats 3]``.
"""

from __future__ import annotations

import argparse
import time

import torch

from maskgrpo_ray.algo.grpo import grpo_loss
from maskgrpo_ray.config import load_config
from maskgrpo_ray.pipeline.learner_loss import accumulate_gradients, pair_log_probs
from maskgrpo_ray.pipeline.messages import TrainBatch
from maskgrpo_ray.pipeline.phases import generate
from maskgrpo_ray.prompts.loading import load_prompts
from maskgrpo_ray.worlds.toy.model import ToyModelSpec, ToyPolicy


def naive_per_step(policy: ToyPolicy, batch: TrainBatch, num_steps: int) -> None:
    """The official loop: for each prompt's group, for each step, one forward + backward."""
    g = batch.group_size
    total = batch.num_samples * num_steps
    for start in range(0, batch.num_samples, g):
        samples = torch.arange(start, start + g)
        for t in range(num_steps):
            steps = torch.full((g,), t)
            logp = pair_log_probs(policy, batch, samples, steps)
            loss, _ = grpo_loss(
                logp,
                batch.old_logp[samples, steps],
                batch.advantages[samples],
                clip_low=0.2,
                clip_high=0.28,
                normalizer=total,
            )
            loss.backward()


def grads(policy: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in policy.parameters() if p.grad is not None])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--micro-batch", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--grid", type=int, default=8)
    args = ap.parse_args()
    torch.manual_seed(0)
    cfg = load_config("configs/toy.yaml")
    spec = ToyModelSpec(
        grid=args.grid, cell_px=4, d_model=args.d_model, layers=args.layers, heads=4
    )
    policy = ToyPolicy(spec)  # random weights: the timing does not depend on training
    prompts = load_prompts("toy")[: args.prompts]
    rb = generate(
        policy,
        prompts,
        list(range(len(prompts))),
        group_size=6,
        num_steps=args.steps,
        temperature=1.0,
        gumbel_temperature=1.0,
        guidance_scale=0.0,
        transition=cfg.rollout.transition,
        policy_version=0,
        generator=torch.Generator().manual_seed(0),
    )
    batch = TrainBatch.from_rollout(rb, torch.randn(rb.num_samples))
    steps = torch.arange(args.steps)

    def batched() -> None:
        accumulate_gradients(
            policy,
            batch,
            train_steps=steps,
            micro_batch=args.micro_batch,
            clip_low=0.2,
            clip_high=0.28,
        )

    def naive() -> None:
        naive_per_step(policy, batch, args.steps)

    results = {}
    for name, fn in (("naive per-step loop", naive), ("batched micro-batches", batched)):
        policy.zero_grad(set_to_none=True)
        fn()  # warm-up, and the gradient to compare
        results[name + " grad"] = grads(policy).clone()
        times = []
        for _ in range(args.repeats):
            policy.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        results[name] = min(times)
    diff = (results["naive per-step loop grad"] - results["batched micro-batches grad"]).abs().max()
    pairs = batch.num_samples * args.steps
    print(
        f"toy policy d={args.d_model} layers={args.layers} L={args.grid**2}; "
        f"{args.prompts} prompts x G=6 x S={args.steps} = {pairs} (sample, step) pairs; "
        f"threads={torch.get_num_threads()}"
    )
    print(f"max |grad difference| = {float(diff):.2e}")
    for name in ("naive per-step loop", "batched micro-batches"):
        print(f"{name:24s} {results[name] * 1e3:9.1f} ms  ({pairs / results[name]:8.1f} pairs/s)")
    print(
        f"ratio (naive / batched) = {results['naive per-step loop'] / results['batched micro-batches']:.2f}x"
    )


if __name__ == "__main__":
    main()
