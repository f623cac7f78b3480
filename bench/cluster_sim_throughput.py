"""bench_cluster_sim's throughput sections: ``pipeline`` (8 rollout + 8 learner GPUs, both
estimators, synchronous and asynchronous), ``scaling`` (rollout throughput of 1..16 rollout
actors) and ``live`` (4 -> 16 rollout actors mid-run through ``maskgrpo scale``)."""

from __future__ import annotations

import argparse
import math
import statistics
import threading
import time
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
    with_lag,
)


def section_pipeline(args: argparse.Namespace, estimator: str, ex: Any) -> list[Row]:
    """8 rollout + 8 learner GPUs: synchronous, lag 1 and lag 2 on one executor."""
    cfg = make_cfg(args, estimator, 8, 8)
    ideal, ts, g = ideal_of(cfg, 8, 8), ts_of(args, estimator), cfg.rollout.samples_per_prompt
    rows = []
    for lag in (0, 1, 2):
        rec = train_steps(with_lag(cfg, lag), ex, args.warmup + args.steps + 1)
        got = rec.images_per_s(args.warmup - 1, last_measured(rec), g) * ts
        want = ideal.sync if lag == 0 else ideal.asynchronous
        name = f"8+8 {estimator} " + ("sync" if lag == 0 else f"lag {lag}")
        busy = statistics.median(
            r.get("learner_busy_fraction", math.nan) for r in rec.rows[args.warmup :]
        )
        extra = {"learner_busy": busy, "phases_s": rec.phases(args.warmup - 1, ts)}
        extra["per_step"] = rec.per_step(args.warmup - 1, ts)
        extra["ideal_R_L_W_s"] = ideal_costs(cfg, 8, 8)
        row = Row("pipeline", name, 8, 8, got, want, ideal.limit, extra)
        say(f"  {name}: {got:.2f} img/s of ideal {want:.2f} ({row.efficiency:.3f})")
        rows.append(row)
    return rows


def section_live(args: argparse.Namespace, ex: Any) -> list[Row]:
    """4 -> 16 rollout actors mid-run (``maskgrpo scale``, through the job's control actor),
    asynchronous, forward profile: rollout-bound at 4, learner-bound at 16."""
    from maskgrpo_ray.cli import app as cli

    cfg = make_cfg(args, "forward", 4, 8, "rollout.max_policy_lag=1")
    g, ts = cfg.rollout.samples_per_prompt, ts_of(args, "forward")
    ex.fleet.scale_rollout(4)
    at = args.warmup + args.steps  # the step after which the scale request is made

    def scale(step: int) -> None:
        if step == at - 1:
            threading.Thread(
                target=cli.main, args=(["scale", "--run", "simbench", "--rollout", "16"],)
            ).start()

    rec = train_steps(cfg, ex, 2 * at + 3, after=scale)
    before = rec.images_per_s(args.warmup - 1, at - 1, g) * ts
    after = rec.images_per_s(at + 2, last_measured(rec), g) * ts
    i4, i16 = ideal_of(cfg, 4, 8), ideal_of(cfg, 16, 8)
    r1 = Row("live", "4 rollout actors (before)", 4, 8, before, i4.asynchronous, i4.limit)
    r2 = Row("live", "16 rollout actors (after)", 16, 8, after, i16.asynchronous, i16.limit)
    actors = [r.get("rollout_actors") for r in rec.rows]
    r2.extra["rollout_actors_by_step"] = actors
    say(f"  live: {before:.2f} -> {after:.2f} img/s (actors by step {actors})")
    return [r1, r2]


def section_scaling(args: argparse.Namespace, ex: Any) -> list[Row]:
    """Rollout throughput (collection only: generate, score, filter, re-sample) of 16 .. 1
    rollout actors, each given the same work per collection (``--scaling-prompts`` prompts per
    actor: weak scaling, so every row's collection lasts the same simulated time and the
    learner takes no part)."""
    from maskgrpo_ray.loop.collect import GroupSource
    from maskgrpo_ray.planner.cost_model import step_costs
    from maskgrpo_ray.prompts.loading import PromptStream, load_prompts
    from maskgrpo_ray.worlds.toy.sim import sim_settings, workload_of

    rows = []
    for n in (16, 8, 4, 2, 1):  # removing actors is quick; they all hold the same weights
        b = args.scaling_prompts * n
        cfg = make_cfg(args, "forward", n, 8, f"train.prompts_per_step={b}")
        profile, work = sim_settings(cfg.model).cost_profile(), workload_of(cfg)
        ex.fleet.scale_rollout(n)
        stream = PromptStream(load_prompts("toy", "train"), 0, True)
        source = GroupSource(
            ex,
            stream,
            prompts_per_step=b,
            max_resamples=cfg.filter.max_resamples,
            chunk_prompts=args.scaling_prompts,
            run_seed=0,
            background=False,
        )
        images, seconds = 0.0, 0.0
        for k in range(args.warmup + args.steps):
            t0 = time.perf_counter()
            col = source.collect(source.submit(k))
            if k >= args.warmup:
                seconds += time.perf_counter() - t0
                images += col.stats["groups_generated"] * cfg.rollout.samples_per_prompt
        got = images / seconds * ts_of(args, "forward")
        c = step_costs(profile, work, n, 1)
        rows.append(
            Row("scaling", f"{n} rollout actors", n, 0, got, work.images / c.rollout_s, n / c.r)
        )
        say(f"  {rows[-1].name}: {got:.2f} img/s (ideal {rows[-1].ideal:.2f})")
    one = rows[-1].measured
    for row in rows:
        row.extra["vs_one_actor"] = row.measured / one
        row.extra["of_linear"] = row.measured / (one * row.rollout_gpus)
    return rows[::-1]
