"""Toy-world ablation of the paper's choices, single-process, same seeds and eval set.

    .venv/bin/python bench/ablation_toy.py [--steps 120] [--seeds 0] [--variants default,p2,...]

Each variant is `configs/toy.yaml` plus overrides; the table prints the held-out accuracy
before and after, the gain and the wall time, so a change to sampling, the loss or the rewards
can be judged against the default in the same process.
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
from pathlib import Path

VARIANTS: dict[str, list[str]] = {
    "default (p1, tau0=0, filter)": [],
    "p2 (Eq. 15)": ["rollout.transition=p2"],
    "ar (Eq. 13)": ["rollout.transition=ar"],
    "p1, Gumbel tau0=1 (Show-o)": ["rollout.gumbel_temperature=1.0"],
    "no sample filter": ["filter.enabled=false"],
    "KL beta=0.05": ["train.kl_coef=0.05"],
    "train last half of steps": ["train.step_selection=last", "train.steps_trained=4"],
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--variants", default="", help="comma-separated names (default: all)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    from maskgrpo_ray.cli import run_train
    from maskgrpo_ray.config import load_config

    chosen = [v for v in VARIANTS if v in args.variants.split(",")] or list(VARIANTS)
    print(f"{'variant':32s} {'seed':>4s} {'base':>6s} {'tuned':>6s} {'gain':>6s} {'wall s':>7s}")
    for name in chosen:
        for seed in (int(s) for s in args.seeds.split(",")):
            overrides = [
                "run.backend=local",
                f"run.seed={seed}",
                f"train.steps={args.steps}",
                "logging.progress_bar=false",
                "logging.sample_grid_every_steps=0",
                *VARIANTS[name],
            ]
            cfg = load_config(
                Path(__file__).resolve().parents[1] / "configs" / "toy.yaml", overrides
            )
            with tempfile.TemporaryDirectory() as d:
                t0 = time.perf_counter()
                s = run_train(cfg, Path(d))
                wall = time.perf_counter() - t0
            gain = s["final_accuracy"] - s["base_accuracy"]
            print(
                f"{name:32s} {seed:4d} {s['base_accuracy']:6.3f} {s['final_accuracy']:6.3f} "
                f"{gain:+6.3f} {wall:7.1f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
