"""bench_cluster_sim's split sections: ``splits`` (each rollout/learner split of 16 GPUs against
``maskgrpo plan``) and ``recipe`` (the toy-evidence cheaper learner against the full trajectory
at the planner's split, then its strong and weak scaling)."""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import Any

from bench.cluster_sim_common import (
    Row,
    ideal_costs,
    ideal_of,
    last_measured,
    make_cfg,
    say,
    train_steps,
    ts_of,
)


def resize_learner(ex: Any, num_workers: int) -> None:
    """The bench's split sweep: a new learner group of ``num_workers`` ranks on a running
    executor (base weights: throughput only), the rollout actors synced to it."""
    from dataclasses import replace

    from maskgrpo_ray.learner.group import LearnerGroup

    ex.learner.shutdown(graceful=False)
    learner = replace(ex.settings.learner, num_workers=num_workers)
    ex.settings = replace(ex.settings, learner=learner)
    ex.learner = LearnerGroup(ex.settings, ex.timeout_s)
    ex.fleet.attach(ex.learner)
    ex.policy_version = ex.learner.version
    ex.sync_weights()


def section_splits(args: argparse.Namespace, ex: Any) -> list[Row]:
    """Each rollout/learner split of 16 GPUs, asynchronous (lag 1), trajectory profile, on one
    executor (its rollout actors scaled, its learner group re-formed per split)."""
    from maskgrpo_ray.planner.split import plan_split
    from maskgrpo_ray.worlds.toy.sim import sim_settings, workload_of

    n, rows = 16, []
    for nr in args.splits:
        cfg = make_cfg(args, "trajectory", nr, n - nr, "rollout.max_policy_lag=1")
        ideal = ideal_of(cfg, nr, n - nr)
        say(f"split {nr}+{n - nr}")
        ex.fleet.scale_rollout(nr)
        resize_learner(ex, n - nr)
        rec = train_steps(cfg, ex, args.warmup + args.steps + 1)
        got = rec.images_per_s(args.warmup - 1, last_measured(rec), cfg.rollout.samples_per_prompt)
        got *= ts_of(args, "trajectory")
        row = Row(
            "splits", f"{nr}+{n - nr} lag 1", nr, n - nr, got, ideal.asynchronous, ideal.limit
        )
        row.extra = {"phases_s": rec.phases(args.warmup - 1, ts_of(args, "trajectory"))}
        row.extra["per_step"] = rec.per_step(args.warmup - 1, ts_of(args, "trajectory"))
        row.extra["ideal_R_L_W_s"] = ideal_costs(cfg, nr, n - nr)
        say(
            f"  {row.name}: {got:.2f} img/s of ideal {ideal.asynchronous:.2f}, limit {ideal.limit:.2f}"
        )
        rows.append(row)
    cfg = make_cfg(args, "trajectory", 4, 12)
    plan = plan_split(sim_settings(cfg.model).cost_profile(), workload_of(cfg), n)
    best = max(rows, key=lambda r: r.measured)
    picked = [r for r in rows if r.rollout_gpus == plan.rollout_gpus]
    if picked:
        rows.append(
            Row(
                "splits",
                f"plan: {plan.rollout_gpus}+{plan.learner_gpus}",
                plan.rollout_gpus,
                plan.learner_gpus,
                picked[0].measured,
                plan.images_per_s,
                plan.limit,
                {"best_measured": best.name, "of_best": picked[0].measured / best.measured},
            )
        )
    return rows


# A cheaper learner as a pipeline workload (docs/algorithm.md, bench/learner_cost.py): train the
# last 6 of Show-o's 50 unmasking steps (12%, the toy's last 2 of 16), 32 prompts a step (whole
# groups per rollout GPU: at 16 prompts no split of 16 GPUs keeps the cheaper learner's GPUs
# busy). The Show-o configs' default until issue 39; its only quality evidence is the toy's
# (proxy (toy), not Show-o), so no shipped config trains it: this section measures what the
# pipeline does with such a learner, not a recipe to use.
RECIPE = [
    "train.unmasking_step_selection=last",
    "train.unmasking_steps_trained=6",
    "train.prompts_per_step=32",
]


def run_split(
    args: argparse.Namespace, ex: Any, extra: list[str], nr: int, nl: int, section: str, name: str
) -> Row:
    """One measured row: the trajectory profile with ``extra`` on ``nr`` rollout and ``nl``
    learner GPUs, asynchronous (lag 1), on ``ex`` (its pools resized to the split)."""
    cfg = make_cfg(args, "trajectory", nr, nl, "rollout.max_policy_lag=1", *extra)
    ideal, ts = ideal_of(cfg, nr, nl), ts_of(args, "trajectory")
    if ex.settings.learner.num_workers > nl:  # free GPUs before the rollout side takes them
        resize_learner(ex, nl)
    ex.fleet.scale_rollout(nr)
    if ex.settings.learner.num_workers != nl:
        resize_learner(ex, nl)
    rec = train_steps(cfg, ex, args.warmup + args.steps + 1)
    got = rec.images_per_s(args.warmup - 1, last_measured(rec), cfg.rollout.samples_per_prompt)
    row = Row(section, name, nr, nl, got * ts, ideal.asynchronous, ideal.limit)
    row.extra = {
        "per_gpu": row.measured / (nr + nl),
        "limit_per_gpu": ideal.limit / (nr + nl),
        "prompts_per_step": cfg.train.prompts_per_step,
        "phases_s": rec.phases(args.warmup - 1, ts),
        "ideal_R_L_W_s": ideal_costs(cfg, nr, nl),
    }
    say(
        f"  {name} ({nr}+{nl}): {row.measured:.2f} img/s = {row.extra['per_gpu']:.3f} /GPU, "
        f"ideal {ideal.asynchronous:.2f} ({row.efficiency:.3f}), limit {ideal.limit:.2f} "
        f"({row.of_limit:.3f})"
    )
    return row


def planned(args: argparse.Namespace, extra: list[str], gpus: int) -> tuple[int, int]:
    """The planner's split of ``gpus`` for the trajectory profile with ``extra``."""
    from maskgrpo_ray.planner.cost_model import workload_of
    from maskgrpo_ray.planner.split import plan_split
    from maskgrpo_ray.worlds.toy.sim import sim_settings

    cfg = make_cfg(args, "trajectory", 1, 1, *extra)
    plan = plan_split(sim_settings(cfg.model).cost_profile(), workload_of(cfg), gpus)
    return plan.rollout_gpus, plan.learner_gpus


def section_recipe(args: argparse.Namespace) -> list[Row]:
    """The toy-evidence cheaper learner (``RECIPE``) against the full trajectory on 16 GPUs (each at the planner's
    split, the full trajectory at both batch sizes), then the recipe's strong scaling (32
    prompts a step on 8, 16, 32 GPUs) and weak scaling (the prompts a step growing with the
    GPUs: 16, 32, 64) at the planner's split, images/GPU/s over all GPUs beside the limit.
    One executor for the full trajectory's rows, then one started from the recipe's config
    (the learner trains the steps its own settings select)."""
    from maskgrpo_ray.backend.ray_executor import RayExecutor

    rows = []
    ex = RayExecutor(make_cfg(args, "trajectory", 8, 8))
    try:
        for name, extra in (
            ("full trajectory, 16 prompts", []),
            ("full trajectory, 32 prompts", ["train.prompts_per_step=32"]),
        ):
            nr, nl = planned(args, extra, 16)
            rows.append(run_split(args, ex, extra, nr, nl, "recipe", f"16 GPUs, {name}"))
    finally:
        ex.shutdown()
    ex = RayExecutor(make_cfg(args, "trajectory", 8, 8, *RECIPE))
    try:
        return rows + recipe_rows(args, ex)
    finally:
        ex.shutdown()


def recipe_rows(args: argparse.Namespace, ex: Any) -> list[Row]:
    """The recipe on 16 GPUs, then its strong and weak scaling, on ``ex`` (the recipe's)."""
    nr, nl = planned(args, RECIPE, 16)
    rows = [
        run_split(args, ex, RECIPE, nr, nl, "recipe", "16 GPUs, recipe: last 6 of 50, 32 prompts")
    ]
    recipe16 = rows[-1]
    for n in args.scale_gpus:
        for kind, b in (("strong", 32), ("weak", 2 * n)):
            name = f"{kind}: {n} GPUs, {b} prompts"
            if n == 16 and b == 32:  # the 16-GPU recipe row above is this row
                rows.append(replace(recipe16, section=f"scaling_{kind}", name=name))
                continue
            extra = [*RECIPE, f"train.prompts_per_step={b}"]
            nr, nl = planned(args, extra, n)
            rows.append(run_split(args, ex, extra, nr, nl, f"scaling_{kind}", name))
    return rows
