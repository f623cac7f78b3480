"""Images per second of the in-process GenEval scorer (maskgrpo_ray/rewards/geneval.py) on tiny
random models (a tiny Mask2Former and open_clip: the real code path, no download), on this
machine's CPU. Usage: python -m bench.geneval_scorer [--images 32] [--side 64] [--threads 1]

The figure is the scorer's own overhead and the procedure's cost at a small test resize, not the
full-size models' speed (the planner's reward side gives that: maskgrpo plan --config
configs/showo_512_geneval.yaml)."""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from maskgrpo_ray.prompts.geneval_schema import GENEVAL_CLASSES
from maskgrpo_ray.rewards.geneval import GenEvalScorer
from maskgrpo_ray.rewards.geneval_colour import save_tiny_clip_folder
from maskgrpo_ray.rewards.geneval_detector import save_tiny_random_mask2former


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--images", type=int, default=32)
    ap.add_argument("--side", type=int, default=64, help="image side in pixels")
    ap.add_argument("--scale", type=int, nargs=2, default=[128, 96], help="detector resize")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    d2 = {"computer mouse": "mouse", "tv remote": "remote", "computer keyboard": "keyboard"}
    with tempfile.TemporaryDirectory() as root:
        det = save_tiny_random_mask2former(f"{root}/det", [d2.get(c, c) for c in GENEVAL_CLASSES])
        clip = save_tiny_clip_folder(f"{root}/clip")
        scorer = GenEvalScorer(
            det, clip, None, device="cpu", batch_size=8, detector_scale=args.scale
        )
        g = torch.Generator().manual_seed(0)
        images = torch.randint(
            0, 256, (args.images, args.side, args.side, 3), dtype=torch.uint8, generator=g
        )
        # a colour clause on a class the tiny detector finds, so the colour path runs too
        found = scorer.detector.detect(images[:1], [set(GENEVAL_CLASSES)])[0]
        name = scorer.detector.names[int(found.labels[found.boxes[:, 4].argmax()])]
        meta = {"tag": "colors", "include": [{"class": name, "count": 1, "color": "red"}]}
        scorer.judge(images[:2], [meta] * 2)  # warm-up
        t0 = time.perf_counter()
        judged = scorer.judge(images, [meta] * args.images)
        seconds = time.perf_counter() - t0
    colour_checked = sum("red" in j.reason or j.correct for j in judged)
    print(
        f"GenEval scorer, tiny random models, CPU x{args.threads} thread(s): {args.images} images "
        f"of {args.side}x{args.side} px (detector resize {args.scale}) in {seconds:.2f} s = "
        f"{args.images / seconds:.1f} images/s; colour classified on {colour_checked}"
    )


if __name__ == "__main__":
    main()
