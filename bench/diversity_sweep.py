"""Reward against diversity on the toy world: the knobs that guard diversity, swept.

    .venv/bin/python bench/diversity_sweep.py [--steps 300] [--seeds 0] [--jobs 2]
        [--out bench/results_diversity_sweep.json] [--markdown docs/diversity_table.md]

RL on image models trades diversity for reward. Each variant is ``configs/toy.yaml``
(single-process backend) plus overrides, trained for ``--steps`` steps; the base and the tuned
model are evaluated on the held-out prompts with 4 samples a prompt (the same evaluation sampler
for every variant: temperature 1, Gumbel tau 0, fixed seeds), and the table gives, before ->
after, the held-out reward and accuracy and the two diversity figures of
``maskgrpo_ray.diversity``: the fraction of distinct images among a prompt's 4 samples and their
mean pairwise distance in the reward's embedding space (the toy rules reward's palette cells:
the share of cells that differ).
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import statistics
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

VARIANTS: dict[str, list[str]] = {
    "toy default (no KL, tau0=0, filter on)": [],
    "KL 0.01": ["train.kl_coef=0.01"],
    "KL 0.05": ["train.kl_coef=0.05"],
    "KL 0.2": ["train.kl_coef=0.2"],
    "KL 1.0": ["train.kl_coef=1.0"],
    "Gumbel tau0=1 (marginal)": ["rollout.gumbel_temperature=1.0"],
    "no filter": ["filter.enabled=false"],
}
KEYS = ("eval_reward", "eval_accuracy", "eval_diversity/distinct", "eval_diversity/pairwise")


def run_one(job: tuple[str, int, int]) -> dict:
    import torch

    from maskgrpo_ray.cli import run_train
    from maskgrpo_ray.config import load_config

    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)
    name, seed, steps = job
    overrides = [
        "run.backend=local",
        f"run.seed={seed}",
        f"train.steps={steps}",
        "logging.progress_bar=false",
        "logging.sample_grid_every_steps=0",
        "eval.samples_per_prompt=4",
        "eval.gumbel_temperature=0.0",
        "eval.sampler=showo",
        "eval.every_steps=0",
        *VARIANTS[name],
    ]
    cfg = load_config(ROOT / "configs" / "toy.yaml", overrides)
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        s = run_train(cfg, Path(d))
        wall = time.perf_counter() - t0
        rows = [json.loads(x) for x in (Path(d) / "metrics.jsonl").read_text().splitlines()]
    last = rows[-10:]  # the training groups' own diversity, last 10 steps
    train_div = statistics.fmean(r["diversity/distinct"] for r in last)
    return {
        "variant": name,
        "seed": seed,
        "base": {k: s["base_eval"].get(k) for k in KEYS},
        "tuned": {k: s["final_eval"].get(k) for k in KEYS},
        "train_distinct_last10": train_div,
        "wall_seconds": wall,
    }


def markdown(runs: list[dict], steps: int) -> str:
    head = (
        f"| variant ({steps} steps) | reward | accuracy | distinct images of 4 "
        "| pairwise distance | training groups' distinct (last 10 steps) |\n"
        "|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in runs:
        b, t = r["base"], r["tuned"]
        cells = [f"{b[k]:.3f} -> {t[k]:.3f}" for k in KEYS]
        seed = f", seed {r['seed']}" if len({x["seed"] for x in runs}) > 1 else ""
        lines.append(
            f"| {r['variant']}{seed} | "
            + " | ".join(cells)
            + f" | {r['train_distinct_last10']:.3f} |"
        )
    return head + "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--variants", default="", help="names separated by ';' (default: all)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results_diversity_sweep.json"))
    ap.add_argument("--markdown", default="")
    args = ap.parse_args()
    names = [n for n in args.variants.split(";") if n] or list(VARIANTS)
    jobs = [(n, int(s), args.steps) for s in args.seeds.split(",") for n in names]
    t0 = time.perf_counter()
    with mp.get_context("spawn").Pool(args.jobs) as pool:
        runs = []
        for r in pool.imap(run_one, jobs):
            runs.append(r)
            print(
                f"{r['variant']:<42} seed {r['seed']}: distinct {r['base'][KEYS[2]]:.3f} -> "
                f"{r['tuned'][KEYS[2]]:.3f}, accuracy {r['base'][KEYS[1]]:.3f} -> "
                f"{r['tuned'][KEYS[1]]:.3f} ({r['wall_seconds']:.0f} s) "
                f"[{len(runs)}/{len(jobs)}, {time.perf_counter() - t0:.0f} s]",
                flush=True,
            )
    table = markdown(runs, args.steps)
    print(table)
    Path(args.out).write_text(json.dumps({"steps": args.steps, "runs": runs}, indent=1) + "\n")
    if args.markdown:
        Path(args.markdown).write_text(table)


if __name__ == "__main__":
    main()
