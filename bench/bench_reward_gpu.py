"""The reward side at full size on one GPU: what one image costs each reward model.

The planner (``maskgrpo_ray.planner.cost_model``) charges the reward actors per image: CLIP ViT-H-14 at
an assumed 30% MFU (the paper's reward), and, for the GenEval reward and evaluation, the
detector (Mask2Former with a Swin-S backbone, 80 COCO classes, 100 queries, as the official
evaluator's mmdetection model) and the colour classifier (CLIP ViT-L-14 on the detected objects'
crops). This times each model's forward at full size with random weights (no weights can be
fetched on the GPU machine; the arithmetic is the same as with trained ones):

* ``clip``: open_clip ``ViT-H-14`` and ``ViT-L-14`` image towers at 224 px, batches of 6, 24
  and 96 images, under bf16 autocast and in float32;
* ``detector``: Mask2Former (the scorer's module, ``rewards.geneval_detector``) with a Swin-S backbone
  (embed 96, depths 2-2-18-2, heads 3-6-12-24, window 7) at 512 px (Show-o's images as they
  are) and 800 px (the evaluator's mmdetection test resize of a 512 px image: shorter side 800),
  batches of 1, 8 and 32, float32 (as the evaluator runs it) and bf16 autocast.

Each configuration: one warm-up call, then calls until ``--min-time-s`` (median), with
``torch.cuda.synchronize`` around each. Prints a markdown table of seconds per image and
images/s, and writes the JSON to ``--out`` (default ``$OUT/bench_reward_gpu.json``).

Run: ``python -m bench.bench_reward_gpu`` (GPU, about a minute) or ``--smoke`` (tiny models on
the CPU, seconds: the code path only).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch


def _time(fn: Any, device: torch.device, min_time_s: float) -> tuple[float, int]:
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    with torch.no_grad():
        fn()  # warm-up
        sync()
        times: list[float] = []
        while sum(times) < min_time_s or not times:
            t0 = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - t0)
    return statistics.median(times), len(times)


def _row(
    model: str, px: int, dtype: str, n: int, s: float, reps: int, **extra: Any
) -> dict[str, Any]:
    """One timed configuration's record (printed as it is made)."""
    row = {"model": model, **extra, "px": px, "dtype": dtype, "batch": n, "seconds": s}
    row |= {"s_per_image": s / n, "images_per_s": n / s, "repeats": reps}
    print(row, flush=True)
    return row


def _autocast(device: torch.device, dtype: str) -> Any:
    if dtype == "float32":
        return torch.autocast(device.type, enabled=False)
    return torch.autocast(device.type, dtype=torch.bfloat16)


def bench_clip(args: argparse.Namespace, device: torch.device) -> list[dict[str, Any]]:
    import open_clip

    rows = []
    names = ("ViT-H-14", "ViT-L-14") if not args.smoke else ("ViT-B-32",)
    batches = (6, 24, 96) if not args.smoke else (2,)
    px = 224
    for name in names:
        model = open_clip.create_model(name, pretrained=None).visual.to(device).eval()
        for dtype in ("bfloat16", "float32"):
            for n in batches:
                x = torch.randn(n, 3, px, px, device=device)

                def call(model: Any = model, x: torch.Tensor = x, dtype: str = dtype) -> Any:
                    with _autocast(device, dtype):
                        return model(x)

                s, reps = _time(call, device, args.min_time_s)
                rows.append(_row(f"open_clip {name}", px, dtype, n, s, reps))
        del model
    return rows


def swin_s_mask2former(smoke: bool) -> Any:
    """The scorer's own module (``rewards.geneval_detector``: Mask2Former's inference half,
    without the training loss that needs scipy) at Swin-S size (or tiny, ``smoke``).
    The H100 figures in docs/gpu.md were taken with transformers'
    ``Mask2FormerForUniversalSegmentation``, whose inference forward adds only the class head
    on the intermediate decoder layers."""
    from transformers import Mask2FormerConfig, SwinConfig

    from maskgrpo_ray.rewards.geneval_detector import _Mask2Former

    if smoke:
        backbone = SwinConfig(
            embed_dim=16,
            depths=[1, 1, 1, 1],
            num_heads=[1, 1, 2, 2],
            window_size=4,
            out_features=["stage1", "stage2", "stage3", "stage4"],
        )
        cfg = Mask2FormerConfig(
            backbone_config=backbone,
            num_labels=80,
            num_queries=10,
            hidden_dim=32,
            mask_feature_size=32,
            feature_size=32,
            encoder_feedforward_dim=64,
            dim_feedforward=64,
            encoder_layers=1,
            decoder_layers=2,
            num_attention_heads=2,
        )
    else:
        backbone = SwinConfig(
            embed_dim=96,
            depths=[2, 2, 18, 2],
            num_heads=[3, 6, 12, 24],
            window_size=7,
            out_features=["stage1", "stage2", "stage3", "stage4"],
        )
        cfg = Mask2FormerConfig(backbone_config=backbone, num_labels=80, num_queries=100)
    return _Mask2Former(cfg)


def bench_detector(args: argparse.Namespace, device: torch.device) -> list[dict[str, Any]]:
    model = swin_s_mask2former(args.smoke).to(device).eval()
    params = sum(p.numel() for p in model.parameters())
    rows = []
    sides = (512, 800) if not args.smoke else (64,)
    batches = (1, 8, 32) if not args.smoke else (2,)
    for px in sides:
        for dtype in ("float32", "bfloat16"):
            for n in batches:
                x = torch.randn(n, 3, px, px, device=device)

                def call(x: torch.Tensor = x, dtype: str = dtype) -> Any:
                    with _autocast(device, dtype):
                        return model(x)

                try:
                    s, reps = _time(call, device, args.min_time_s)
                except torch.OutOfMemoryError:
                    rows.append(
                        {
                            "model": "Mask2Former Swin-S",
                            "px": px,
                            "dtype": dtype,
                            "batch": n,
                            "skipped": "out of memory",
                        }
                    )
                    torch.cuda.empty_cache()
                    continue
                rows.append(_row("Mask2Former Swin-S", px, dtype, n, s, reps, params=params))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description="reward models at full size (see the docstring)")
    ap.add_argument("--smoke", action="store_true", help="tiny models on the CPU")
    ap.add_argument("--min-time-s", type=float, default=2.0)
    ap.add_argument("--sections", default="clip,detector")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.smoke:
        args.min_time_s = 0.0
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    out: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "tf32": True,
    }
    sections = args.sections.split(",")
    if "clip" in sections:
        out["clip"] = bench_clip(args, device)
    if "detector" in sections:
        out["detector"] = bench_detector(args, device)
    print("\n| model | px | dtype | batch | s / image | images/s |\n|---|---|---|---|---|---|")
    for row in out.get("clip", []) + out.get("detector", []):
        if "seconds" in row:
            print(
                f"| {row['model']} | {row['px']} | {row['dtype']} | {row['batch']} | "
                f"{row['s_per_image'] * 1e3:.2f} ms | {row['images_per_s']:.1f} |"
            )
    path = Path(args.out or Path(os.environ.get("OUT", "bench")) / "bench_reward_gpu.json")
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"written to {path}")


if __name__ == "__main__":
    main()
