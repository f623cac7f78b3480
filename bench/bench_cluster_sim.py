"""SIMULATION: cluster-scale pipeline figures on simulated accelerators, against the ideal.

    .venv/bin/python -m bench.bench_cluster_sim [--sections all|pipeline,scaling,live,splits]
        [--time-scale 0.05] [--steps 10] [--splits 1,2,...] [--out bench/results_cluster_sim]

Every row runs the real system (``RayExecutor``, the driver's loop, rollout / reward / filter
actors, DeepSpeed learner ranks, the weight sync) on ``model.kind: sim``
(``maskgrpo_ray.worlds.toy.sim``): a tiny real policy whose calls take the time a cost profile gives
Show-o on an H100 (``maskgrpo_ray.planner.cost_model``), times ``time_scale``. One local Ray cluster with
logical GPUs (``num_gpus``) hosts every row: actors ask for GPUs exactly as on a GPU cluster and
CUDA is never touched. Nothing here is a GPU measurement; figures are in *simulated* images per
second (wall images/s x time_scale) beside the ideal the profile implies:

* synchronous ``images / (R + L + W)``, asynchronous ``images / max(R, L + W)``
  (``planner.split.pipeline_ideal``), and beside every row the work-conserving limit
  ``n / (r + l)`` that no split of its ``n`` GPUs can beat;
* efficiency = measured / ideal.

Sections: ``pipeline`` (8 rollout + 8 learner GPUs, trajectory and forward profiles,
synchronous and ``max_policy_lag`` 1 and 2), ``scaling`` (rollout throughput of 1..16 rollout
actors, collection only), ``live`` (4 -> 16 rollout actors mid-run through ``maskgrpo scale``),
``splits`` (each rollout/learner split of 16 GPUs, asynchronous, against ``maskgrpo plan``).
Writes ``OUT.json`` and ``OUT.png``. Files, by what they measure: ``cluster_sim_throughput.py``
(pipeline, scaling, live), ``cluster_sim_splits.py`` (splits, recipe), on
``cluster_sim_common.py`` (the config, the cluster, the ideal, the recorder); this file runs the
sections and writes the table and the plot.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from bench.cluster_sim_common import REPO, TIME_SCALES, Row, make_cfg, say, start_cluster
from bench.cluster_sim_splits import section_recipe, section_splits
from bench.cluster_sim_throughput import section_live, section_pipeline, section_scaling


def save(rows: list[Row], args: argparse.Namespace) -> None:
    """``OUT.json``: every row so far (written after each section, so a long run keeps them)."""
    doc = {
        "simulation": True,
        "time_scale": args.time_scale or TIME_SCALES,
        "rows": [asdict(r) | {"efficiency": r.efficiency, "of_limit": r.of_limit} for r in rows],
    }
    Path(args.out).with_suffix(".json").write_text(json.dumps(doc, indent=2))


def print_table(rows: list[Row]) -> None:
    print(
        "\nSIMULATION (model.kind: sim; simulated H100s, Show-o 512 cost profiles; not GPU "
        "measurements). img/s are simulated images per second.\n"
    )
    head = ["section", "row", "R+L GPUs", "measured", "ideal", "eff", "limit n/(r+l)", "of limit"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        gpus = f"{r.rollout_gpus}+{r.learner_gpus}"
        cells = [
            r.section,
            r.name,
            gpus,
            f"{r.measured:.2f}",
            f"{r.ideal:.2f}",
            f"{r.efficiency:.3f}",
            f"{r.limit:.2f}",
            f"{r.of_limit:.3f}",
        ]
        print("| " + " | ".join(cells) + " |")


def plot(rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    split = [r for r in rows if r.section == "splits" and not r.name.startswith("plan")]
    if split:
        ax = axes[0]
        x = [r.rollout_gpus for r in split]
        ax.plot(x, [r.measured for r in split], "o-", label="measured (simulated)")
        ax.plot(x, [r.ideal for r in split], "s--", label="pipeline ideal (async)")
        ax.axhline(split[0].limit, color="gray", ls=":", label="work-conserving limit")
        ax.set_xlabel("rollout GPUs of 16 (the rest learn)")
        ax.set_ylabel("simulated images / s")
        ax.set_title("SIMULATION: split sweep, Show-o 512 on H100s")
        ax.legend()
    scal = [r for r in rows if r.section == "scaling"]
    if scal:
        ax = axes[1]
        x = [r.rollout_gpus for r in scal]
        ax.plot(x, [r.extra["vs_one_actor"] for r in scal], "o-", label="measured")
        ax.plot(x, x, "--", color="gray", label="linear")
        ax.set_xlabel("rollout actors")
        ax.set_ylabel("rollout throughput vs one actor")
        ax.set_title("SIMULATION: rollout scaling")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sections", default="pipeline,scaling,live,splits")
    ap.add_argument(
        "--time-scale",
        type=float,
        default=None,
        help="default: per profile (TIME_SCALES: real compute a small share of a step)",
    )
    ap.add_argument("--steps", type=int, default=8, help="measured steps per row")
    ap.add_argument("--warmup", type=int, default=3, help="steps before the measurement")
    ap.add_argument("--splits", default="2,3,4,5,6,8,10,12")
    ap.add_argument(
        "--estimators", default="trajectory,forward", help="the pipeline section's profiles"
    )
    ap.add_argument(
        "--scaling-prompts", type=int, default=2, help="prompts per rollout actor and collection"
    )
    ap.add_argument("--set", action="append", default=[], help="config override (repeatable)")
    ap.add_argument("--scale-gpus", default="8,16,32", help="the recipe section's cluster sizes")
    ap.add_argument("--out", default=str(REPO / "bench" / "results_cluster_sim"))
    args = ap.parse_args()
    args.splits = [int(s) for s in args.splits.split(",") if s]
    args.scale_gpus = [int(s) for s in args.scale_gpus.split(",") if s]
    sections = args.sections.split(",")
    import logging

    logging.basicConfig(level=logging.WARNING)
    start_cluster(gpus=max(32, *args.scale_gpus), cpus=16)
    rows: list[Row] = []
    from maskgrpo_ray.backend.ray_executor import RayExecutor

    estimators = args.estimators.split(",")
    if "recipe" in sections:
        say("the recipe against the full trajectory, and its scaling (trajectory profile)")
        rows += section_recipe(args)
        print_table(rows)
        save(rows, args)
    if "splits" in sections or ("pipeline" in sections and "trajectory" in estimators):
        say("starting 8 rollout + 8 learner simulated GPUs (trajectory profile)")
        ex = RayExecutor(make_cfg(args, "trajectory", 8, 8))
        try:
            if "pipeline" in sections and "trajectory" in estimators:
                rows += section_pipeline(args, "trajectory", ex)
                print_table(rows)
                save(rows, args)
            if "splits" in sections:
                rows += section_splits(args, ex)
                print_table(rows)
                save(rows, args)
        finally:
            ex.shutdown()
    if {"live", "scaling"} & set(sections) or ("pipeline" in sections and "forward" in estimators):
        say("starting 8 rollout + 8 learner simulated GPUs (forward profile)")
        ex = RayExecutor(make_cfg(args, "forward", 8, 8))
        try:
            if "pipeline" in sections and "forward" in estimators:
                rows += section_pipeline(args, "forward", ex)
                save(rows, args)
            if "live" in sections:
                rows += section_live(args, ex)
                save(rows, args)
            if "scaling" in sections:
                rows += section_scaling(args, ex)
            print_table(rows)
            save(rows, args)
        finally:
            ex.shutdown()
    save(rows, args)
    out = Path(args.out)
    plot(rows, out.with_suffix(".png"))
    print(f"\nwrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
