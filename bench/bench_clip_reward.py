"""CLIP reward throughput on the CPU: one batch vs one image at a time, and preprocessing's share.

ViT-B-32 with random weights (no download), ``B`` prompts x ``G`` images each, in one process on
the same model:

- images/s scoring the whole batch in one call vs one call per image (what a per-image loop,
  like the official code's PIL processor path, pays);
- the time of preprocessing alone (batched tensor path, and open_clip's PIL transform per image)
  as a share of one batched scoring call.

    OMP_NUM_THREADS=2 python -m bench.bench_clip_reward                  # 224 px, as generated
    OMP_NUM_THREADS=2 python -m bench.bench_clip_reward --size 512       # Show-o's 512 px output
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from maskgrpo_ray.rewards.clip import ClipReward

PROMPTS = [
    "a photo of a red bicycle leaning against a blue wall",
    "two cats sleeping on a sofa",
    "an astronaut riding a horse on the moon, digital art",
    "a bowl of fruit",
]


def interleaved(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median seconds of each ``fn``, run round-robin (one warm-up each) so that load from other
    processes on the machine falls on every variant alike."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def _pixels(reward: ClipReward, images: torch.Tensor, mode: str) -> torch.Tensor:
    reward.preprocess = mode
    try:
        return reward.pixels(images)
    finally:
        reward.preprocess = "tensor"


def _score(reward: ClipReward, images: torch.Tensor, prompts: list[str], mode: str):
    reward.preprocess = mode
    try:
        return reward(images, prompts)
    finally:
        reward.preprocess = "tensor"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="ViT-B-32")
    ap.add_argument("--size", type=int, default=224, help="generated image side, pixels")
    ap.add_argument("--prompts", type=int, default=4, help="B distinct prompts")
    ap.add_argument("--samples-per-prompt", type=int, default=6, help="G")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    reward = ClipReward(args.model, None, device="cpu")
    n = args.prompts * args.samples_per_prompt
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.prompts)]
    prompts = [p for p in prompts for _ in range(args.samples_per_prompt)]  # [N], groups of G
    gen = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (n, args.size, args.size, 3), dtype=torch.uint8, generator=gen)
    reward.batch_size = n

    with torch.inference_mode():
        t = interleaved(
            {
                "batched": lambda: _score(reward, images, prompts, "tensor"),
                "batched_pil": lambda: _score(reward, images, prompts, "pil"),
                "single": lambda: [reward(images[i : i + 1], prompts[i : i + 1]) for i in range(n)],
                "pre_tensor": lambda: _pixels(reward, images, "tensor"),
                "pre_pil": lambda: _pixels(reward, images, "pil"),
            },
            args.repeats,
        )
    batched, batched_pil, single = t["batched"], t["batched_pil"], t["single"]
    pre_tensor, pre_pil = t["pre_tensor"], t["pre_pil"]

    print(
        f"{args.model} random weights, CPU x{args.threads} threads, {n} images "
        f"({args.prompts} prompts x {args.samples_per_prompt}) at {args.size} px, "
        f"median of {args.repeats}"
    )
    print(f"{'':38s} {'seconds':>8s} {'images/s':>9s}")
    rows = [
        ("score, one batch (tensor preprocess)", batched),
        ("score, one batch (PIL preprocess)", batched_pil),
        ("score, one image per call", single),
        ("preprocess only, tensor batch", pre_tensor),
        ("preprocess only, PIL per image", pre_pil),
    ]
    for label, seconds in rows:
        print(f"{label:38s} {seconds:8.3f} {n / seconds:9.1f}")
    print(f"batched / one-at-a-time throughput:      {single / batched:5.2f}x")
    print(f"tensor preprocessing share of scoring:   {pre_tensor / batched:6.1%}")
    print(f"PIL preprocessing share of scoring:      {pre_pil / batched_pil:6.1%}")
    print(f"tensor / PIL preprocessing speed-up:     {pre_pil / pre_tensor:5.2f}x")


if __name__ == "__main__":
    main()
