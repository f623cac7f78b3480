"""A cheaper learner, measured: learning against the learner's work, paired by seed.

    .venv/bin/python -m bench.learner_cost [--world toy|shapes] [--seeds 0-7]
        [--holdout 100-107] [--steps 120] [--variants "full;last 4;..."] [--jobs 2] [--fresh]
        [--out bench/results_learner_cost.json] [--markdown docs/learner_cost_table.md]

``--world shapes`` runs the same variants on the GenEval-shaped world (``configs/shapes.yaml``,
already 16 unmasking steps over 64 tokens; its score is GenEval's overall on the held-out prompts,
``eval_accuracy/tag_mean``; 60 steps by default), where objects span many tokens and the layout is
decided early: the toy's recipe tested where composition exists.

The instrument. Every variant is the toy world (``configs/toy.yaml``) on the single-process
backend, reshaped towards Show-o's: ``S = 16`` unmasking steps over the 16 image tokens (Show-o
256 px runs 18 steps over 256 tokens, 512 px 50 over 1024), so that "k of S" means something.
A run is trained for ``--steps`` steps; its figure of merit is the **area under the held-out
learning curve** (held-out accuracy evaluated every 20 steps, base and final included, averaged
over the run: :func:`toy_lab.auc`), which averages six evaluations of the same run and so
carries less noise than one final accuracy; the final gain and the training reward over the
last 20 steps are reported beside it. Variants are compared **paired by seed** against the full
trajectory (every one of the S steps trained): the mean paired difference and its 95%
t-interval. The bench's resolving power is the half-width of that interval: a difference larger
than it is resolved.

Cost, per variant: the learner's (sample, unit) pairs per image (units trained per sample x
inner updates), and the cost model's images per GPU per second at Show-o 512 px on 16 H100s
(``maskgrpo_ray.planner.cost_model``: the planner's best split and the work-conserving limit, over all
GPUs), with the variant's share of the steps carried over to Show-o's 50.

Runs are cached per (variant, seed) in ``bench/cache`` (``toy_lab``): a rerun with more seeds
runs only the new ones. Seeds ``--seeds`` are the tuning seeds; ``--holdout`` runs the chosen
recipe (``--recipe``) and the full trajectory on seeds no choice was made on.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

from bench import toy_lab as lab

# the instrument's shape; every unmasking step trained unless a variant says otherwise (the toy
# default trains the last 2 of its 8)
SHAPE = [
    "rollout.unmasking_steps=16",
    "eval.every_steps=20",
    "train.unmasking_step_selection=all",
    "train.unmasking_steps_trained=0",
]
S_TOY, S_SHOWO = 16, 50
WORLDS = {  # world -> (its config, the shape overrides, default steps)
    "toy": ("configs/toy.yaml", SHAPE, 120),
    "shapes": (
        "configs/shapes.yaml",
        [
            "eval.every_steps=20",
            "train.unmasking_step_selection=all",
            "train.unmasking_steps_trained=0",
            "logging.sample_grid_every_steps=0",
        ],
        60,
    ),
}
WORLD = ["toy"]  # the world of this invocation (main sets it)


def _sel(kind: str, k: int) -> list[str]:
    return [f"train.unmasking_step_selection={kind}", f"train.unmasking_steps_trained={k}"]


# name -> overrides (on top of SHAPE)
VARIANTS: dict[str, list[str]] = {
    "full (16 of 16)": [],
    "last 8": _sel("last", 8),
    "last 4": _sel("last", 4),
    "last 2": _sel("last", 2),
    "first 4": _sel("first", 4),
    "random 4 (batch)": _sel("random", 4),
    "group random 4 (iso-temporal)": _sel("group_random", 4),
    "group random 2 (iso-temporal)": _sel("group_random", 2),
    "window 4 (sliding)": [*_sel("window", 4), "train.unmasking_window_shift_updates=4"],
    # the steps the step-signal probe measures above the shuffled floor, at most 4, re-measured
    # every 30 steps (K = 6 probe batches of B prompts); its pairs include the probe's
    "auto 4 (probe every 30 steps)": [*_sel("auto", 4), "train.step_signal_every_steps=30"],
    "last 2, B = 32 (half the steps: the same images)": [
        *_sel("last", 2),
        "train.prompts_per_step=32",
        "train.steps=60",
        "eval.every_steps=10",
    ],
    "forward K=4": ["likelihood.estimator=forward", "likelihood.forward.mask_draws=4"],
    "forward K=4, complementary": [
        "likelihood.estimator=forward",
        "likelihood.forward.mask_draws=4",
        "likelihood.forward.coupling=complementary",
        "likelihood.forward.mask_ratio_max=0.9",
    ],
    "forward K=2, complementary": [
        "likelihood.estimator=forward",
        "likelihood.forward.mask_draws=2",
        "likelihood.forward.coupling=complementary",
        "likelihood.forward.mask_ratio_max=0.9",
    ],
}
REFERENCE = "full (16 of 16)"
# the Show-o config before its recipe (the full trajectory, the paper's 16 prompts): each
# variant's Show-o column is this plus the variant's overrides
SHOWO_FULL = ["train.unmasking_step_selection=all", "train.prompts_per_step=16"]


def figures(r: dict) -> dict[str, float]:
    tr = [x for x in r["train_reward"][-20:] if x is not None]
    return {
        "auc": lab.auc(r["curve"], lab.score_key(r)),
        "gain": lab.score(r) - lab.score(r, "base"),
        "final": lab.score(r),
        "last20_reward": statistics.fmean(tr) if tr else math.nan,
        "distinct": r["final"]["eval_diversity/distinct"],
    }


def showo_cost(overrides: list[str]) -> dict[str, float]:
    """Learner pairs per image on the toy, and at Show-o 512 on 16 H100s (the variant's share
    of the S steps carried over to Show-o's 50, its estimator, mask draws and inner updates):
    the planner's images/GPU/s and the work-conserving limit per GPU. A variant with the
    step-signal probe adds its pairs, spread over the trained images
    (``cost_model.probe_overhead``); the planner's split does not (the probe runs between
    steps)."""
    from maskgrpo_ray.config import load_config
    from maskgrpo_ray.planner.cost_model import PROFILES, probe_overhead, workload_of
    from maskgrpo_ray.planner.split import plan_split

    config, shape, _ = WORLDS[WORLD[0]]
    toy_cfg = load_config(lab.ROOT / config, [*shape, *overrides])
    toy = workload_of(toy_cfg)
    toy_pairs = toy.pairs_per_sample + probe_overhead(toy_cfg)[0]
    sel = {o.split("=")[0]: o.split("=")[1] for o in overrides}
    show = [o for o in overrides if not o.startswith("train.unmasking_steps_trained")]
    if "train.unmasking_steps_trained" in sel:
        k = max(1, round(int(sel["train.unmasking_steps_trained"]) * S_SHOWO / S_TOY))
        show.append(f"train.unmasking_steps_trained={k}")
    cfg = load_config(lab.ROOT / "configs" / "showo_512_clip.yaml", [*SHOWO_FULL, *show])
    work = workload_of(cfg)
    showo_pairs = work.pairs_per_sample + probe_overhead(cfg)[0]
    profile = PROFILES[
        "showo_512_h100_forward" if work.estimator == "forward" else "showo_512_h100"
    ]
    plan = plan_split(profile, work, 16)
    return {
        "toy_pairs_per_image": round(toy_pairs, 2),
        "toy_share": toy_pairs / S_TOY,
        "showo_pairs_per_image": round(showo_pairs, 2),
        "showo_images_per_gpu_s": plan.images_per_s / 16,
        "showo_limit_per_gpu_s": plan.limit / 16,
        "showo_split": f"{plan.rollout_gpus}+{plan.learner_gpus}",
    }


def table(runs: list[dict], names: list[str], seeds: list[int]) -> tuple[list[dict], str]:
    rows, ref = [], REFERENCE
    for n in names:
        rs = [r for r in lab.of(runs, n) if r["seed"] in seeds]
        if not rs:
            continue
        f = [figures(r) for r in rs]
        row = {"variant": n, "seeds": len(rs), **showo_cost(VARIANTS[n])}
        for key in ("auc", "gain", "final", "last20_reward", "distinct"):
            row[key] = lab.interval([x[key] for x in f])
        if n != ref:
            sub = [r for r in runs if r["seed"] in seeds]
            row["d_auc"] = lab.interval(lab.paired(sub, n, ref, lambda r: figures(r)["auc"]))
            row["d_gain"] = lab.interval(lab.paired(sub, n, ref, lambda r: figures(r)["gain"]))
        row["update_seconds"] = statistics.fmean(r["update_seconds"] for r in rs)
        row["step_seconds"] = statistics.fmean(r["step_seconds"] for r in rs)
        rows.append(row)
    return rows, markdown(rows)


def _ci(v: tuple[float, float], signed: bool = True) -> str:
    """``mean [lo, hi]``, signed by default (a gain or a difference)."""
    return lab.fmt_interval(v, signed)


def markdown(rows: list[dict]) -> str:
    head = (
        "| variant | learner pairs / image (this world; Show-o 512) | held-out AUC | vs full, paired "
        "| final gain | vs full, paired | learner s/step | Show-o 512, 16 H100: img/GPU/s "
        "(split; limit) |\n|---|---|---|---|---|---|---|---|\n"
    )
    out = []
    for r in rows:
        d = (_ci(r["d_auc"]), _ci(r["d_gain"])) if "d_auc" in r else ("-", "-")
        out.append(
            f"| {r['variant']} | {r['toy_pairs_per_image']:g} ({r['toy_share']:.0%}); "
            f"{r['showo_pairs_per_image']:g} | {_ci(r['auc'], signed=False)} | {d[0]} | "
            f"{_ci(r['gain'])} | {d[1]} | {r['update_seconds']:.3f} | "
            f"{r['showo_images_per_gpu_s']:.2f} ({r['showo_split']}; "
            f"{r['showo_limit_per_gpu_s']:.2f}) |"
        )
    return head + "\n".join(out) + "\n"


def resolving_power(rows: list[dict]) -> float:
    """The median half-width of the paired AUC intervals: differences larger are resolved."""
    hs = [r["d_auc"][1] for r in rows if "d_auc" in r]
    return statistics.median(hs) if hs else math.nan


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--seeds", default="0-7", help="tuning seeds (paired)")
    ap.add_argument("--holdout", default="", help="seeds for the recipe check, e.g. 100-107")
    ap.add_argument("--recipe", default="", help="the variant checked on the holdout seeds")
    ap.add_argument("--world", choices=sorted(WORLDS), default="toy")
    ap.add_argument("--steps", type=int, default=0, help="default: 120 (toy), 60 (shapes)")
    ap.add_argument("--variants", default="", help="names separated by ';' (default: all)")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--fresh", action="store_true", help="ignore cached runs")
    ap.add_argument("--commit", action="store_true", help="commit each record as it lands")
    ap.add_argument("--recorded-only", action="store_true", help="run nothing: what is recorded")
    ap.add_argument("--out", default=str(lab.ROOT / "bench" / "results_learner_cost.json"))
    ap.add_argument("--markdown", default="")
    a = ap.parse_args()
    WORLD[0] = a.world
    config, shape, steps = WORLDS[a.world]
    a.steps = a.steps or steps
    if a.world != "toy" and a.out == ap.get_default("out"):
        a.out = str(lab.ROOT / "bench" / f"results_learner_cost_{a.world}.json")
    names = lab.variants_of(a.variants, list(VARIANTS), REFERENCE)
    seeds, hold = lab.seeds_of(a.seeds), lab.seeds_of(a.holdout) if a.holdout else []

    def job(n: str, s: int) -> lab.Job:
        return lab.Job(n, tuple(VARIANTS[n]), s, a.steps, config=config, extra=tuple(shape))

    jobs = [job(n, s) for s in seeds for n in names]
    if hold:
        for n in dict.fromkeys([REFERENCE, a.recipe]):
            jobs += [job(n, s) for s in hold]

    def describe(r: dict) -> str:
        f = figures(r)
        return f"AUC {f['auc']:.3f}, final {f['final']:.3f}, distinct {f['distinct']:.3f}"

    runs = lab.run_from_args(jobs, a, lab.progress(34, describe))
    rows, md = table(runs, names, seeds)
    power = resolving_power(rows)
    print(md)
    print(f"resolving power (median half-width of the paired AUC intervals): {power:.3f}")
    out = {
        "world": a.world,
        "steps": a.steps,
        "seeds": seeds,
        "rows": rows,
        "resolving_power": power,
    }
    if hold:
        hrows, hmd = table(runs, [REFERENCE, a.recipe], hold)
        print(f"\nholdout seeds {hold}:\n{hmd}")
        out["holdout"] = {"seeds": hold, "recipe": a.recipe, "rows": hrows}
        md += f"\nHoldout seeds {hold[0]}-{hold[-1]} (the recipe against the full trajectory):\n\n{hmd}"
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    if a.markdown:
        Path(a.markdown).write_text(md)


if __name__ == "__main__":
    main()
