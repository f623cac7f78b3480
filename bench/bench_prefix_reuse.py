"""Text-prefix reuse vs full recomputation, per unmasking step, at Show-o's 256 px layout.

Show-o's t2i sequence at 256 px is 129 text positions + 258 image positions (soi, 256 tokens,
eoi). Text rows never attend to image rows, so the policy computes the text's keys and values
once per binding (per prompt, shared by the ``G`` samples and by the unconditional rows) and
runs only the 258 image rows per step. This script times one unmasking step both ways in the
same process, on the same weights and states, and checks that the logits agree.

    OMP_NUM_THREADS=2 python -m bench.bench_prefix_reuse            # small-but-not-tiny model
    python -m bench.bench_prefix_reuse --hidden 1024 --layers 12    # bigger
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from maskgrpo_ray.models.showo import ShowoPolicy, build_tiny_random_policy

PROMPTS = [
    "a photo of a red bicycle leaning against a blue wall",
    "two cats sleeping on a sofa",
    "an astronaut riding a horse on the moon, digital art",
    "a bowl of fruit",
]


def time_steps(policy: ShowoPolicy, cond: torch.Tensor, guidance: float, steps: int, reuse: bool):
    """(bind + first call seconds, per-step seconds, (last state, bound fn)) for one binding."""
    policy.reuse_text_prefix = reuse
    gen = torch.Generator().manual_seed(0)
    shape = (len(cond), policy.num_image_tokens)
    with torch.no_grad():
        t0 = time.perf_counter()
        fn = policy.conditioned(cond, guidance)
        state = torch.full(shape, policy.mask_index)
        fn(state)  # the first call pays for the text prefix when reusing
        first = time.perf_counter() - t0
        times = []
        for step in range(steps):
            keep = torch.rand(shape, generator=gen) < (step + 1) / (steps + 1)
            state = torch.where(keep, torch.randint(0, policy.codebook_size, shape), state)
            t0 = time.perf_counter()
            fn(state)
            times.append(time.perf_counter() - t0)
    return first, times, (state, fn)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=2, help="B distinct prompts")
    ap.add_argument("--samples-per-prompt", type=int, default=2, help="G")
    ap.add_argument("--guidance", type=float, default=1.75)
    ap.add_argument("--steps", type=int, default=6, help="timed unmasking steps per mode")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    policy = build_tiny_random_policy(
        seed=0,
        num_image_tokens=256,
        codebook_size=8192,
        llm_vocab_size=50295,
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_heads=args.heads,
        max_text_len=128,
        magvit_levels=1,
    ).eval()
    cond = policy.tokenize(PROMPTS[: args.prompts]).repeat_interleave(args.samples_per_prompt, 0)
    rows = len(cond) * (2 if args.guidance else 1)
    n_params = sum(p.numel() for p in policy.transformer.parameters())
    print(
        f"model: hidden {args.hidden}, {args.layers} layers, {args.heads} heads, "
        f"{n_params / 1e6:.0f}M params; layout {cond.shape[1]} text + "
        f"{policy.num_image_tokens + 2} image positions; {rows} rows per step "
        f"(B={args.prompts}, G={args.samples_per_prompt}, guidance {args.guidance}); "
        f"{torch.get_num_threads()} threads"
    )
    time_steps(policy, cond, args.guidance, 1, reuse=True)  # warm-up
    results = {}
    for reuse in (False, True, False, True):  # interleaved against drift
        first, times, last = time_steps(policy, cond, args.guidance, args.steps, reuse)
        results.setdefault(reuse, ([], []))
        results[reuse][0].append(first)
        results[reuse][1].extend(times)
        results[(reuse, "last")] = last
    full = statistics.median(results[False][1])
    reuse = statistics.median(results[True][1])
    bind = statistics.median(results[True][0]) - reuse
    print(f"full recomputation : {full * 1e3:8.1f} ms / step")
    print(
        f"text-prefix reuse  : {reuse * 1e3:8.1f} ms / step  (+{bind * 1e3:.1f} ms once per binding)"
    )
    print(f"ratio              : {full / reuse:8.2f}x per step")
    for s in (18, 50):
        print(f"ratio incl. prefix : {s * full / (s * reuse + bind):8.2f}x over {s} steps")

    state, fn_reuse = results[(True, "last")]
    policy.reuse_text_prefix = False
    with torch.no_grad():
        diff = (fn_reuse(state) - policy.conditioned(cond, args.guidance)(state)).abs().max()
    print(f"max |logits(reuse) - logits(full)| = {diff:.2e}")


if __name__ == "__main__":
    main()
