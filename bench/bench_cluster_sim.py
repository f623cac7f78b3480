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
Writes ``OUT.json`` and ``OUT.png``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

SIM_CONFIG = REPO / "configs" / "sim_showo512.yaml"
PROFILES = {"trajectory": "showo_512_h100", "forward": "showo_512_h100_forward"}
FORWARD = [  # the forward estimator as configs/showo_512_clip_forward.yaml runs it
    "likelihood.estimator=forward",
    "likelihood.forward.mask_draws=4",
    "likelihood.forward.mask_ratio_min=0.7",
    "likelihood.forward.mask_ratio_max=1.0",
    "train.updates_per_batch=4",
]


@dataclass
class Row:
    section: str
    name: str
    rollout_gpus: int
    learner_gpus: int
    measured: float  # simulated images/s (wall images/s x time_scale)
    ideal: float  # the split's pipeline ideal (sync or async)
    limit: float  # work-conserving n / (r + l)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def efficiency(self) -> float:
        return self.measured / self.ideal if self.ideal else math.nan

    @property
    def of_limit(self) -> float:
        return self.measured / self.limit if self.limit else math.nan


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def start_cluster(gpus: int, cpus: int) -> None:
    """One local loopback Ray cluster with ``gpus`` logical GPUs for every row."""
    import ray

    from maskgrpo_ray.cluster.attach import apply_env_defaults, force_loopback

    apply_env_defaults()
    force_loopback()
    # two cores host every simulated GPU: one thread per process (actors inherit it), so no
    # process spins on a core another one needs; and no idle Ray workers started up front
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("RAY_enable_worker_prestart", "0")
    import torch

    torch.set_num_threads(1)
    ray.init(
        num_cpus=cpus,
        num_gpus=gpus,
        include_dashboard=False,
        log_to_driver=False,
        dashboard_host="127.0.0.1",
    )


TIME_SCALES = {
    "trajectory": 0.35,
    "forward": 1.0,
}  # real compute a small share (docs/simulation.md)


def ts_of(args: argparse.Namespace, estimator: str) -> float:
    return args.time_scale or TIME_SCALES[estimator]


def make_cfg(args: argparse.Namespace, estimator: str, nr: int, nl: int, *extra: str) -> Any:
    from maskgrpo_ray.config import load_config

    sets = [
        f"model.args.profile={PROFILES[estimator]}",
        f"model.args.time_scale={ts_of(args, estimator)}",
        f"rollout.num_actors={nr}",
        f"learner.num_workers={nl}",
        "logging.progress_bar=false",
        "run.export_final_policy=false",
        "run.name=simbench",
        *(FORWARD if estimator == "forward" else []),
        *args.set,
        *extra,
    ]
    return load_config(SIM_CONFIG, sets)


def ideal_costs(cfg: Any, nr: int, nl: int) -> list[float]:
    """The profile's R, L, W (simulated seconds) of a step on the split."""
    from maskgrpo_ray.planner.cost_model import step_costs
    from maskgrpo_ray.worlds.toy.sim import sim_settings, workload_of

    c = step_costs(sim_settings(cfg.model).cost_profile(), workload_of(cfg), nr, nl)
    return [c.rollout_s, c.learner_s, c.sync_s]


def ideal_of(cfg: Any, nr: int, nl: int) -> Any:
    from maskgrpo_ray.planner.cost_model import step_costs
    from maskgrpo_ray.planner.split import pipeline_ideal
    from maskgrpo_ray.worlds.toy.sim import sim_settings, workload_of

    profile = sim_settings(cfg.model).cost_profile()
    return pipeline_ideal(step_costs(profile, workload_of(cfg), nr, nl))


class Recorder:
    """The step ends the driver reports (``on_step_end``), for steady-state throughput."""

    def __init__(self, ex: Any, after: Any = None) -> None:
        self.ex, self.after = ex, after
        self.t: list[float] = []
        self.rows: list[dict[str, Any]] = []

    def __call__(self, step: int, row: dict[str, Any]) -> None:
        self.ex.on_step_end(step, row)  # what a Ray run does there (metrics, scale requests)
        self.t.append(time.perf_counter())
        self.rows.append(row)
        if self.after is not None:
            self.after(step)

    def per_step(self, first: int, time_scale: float) -> dict[str, list[float]]:
        """Each measured step's wall interval (simulated s), own duration and trained groups."""
        ends = self.t[first:]
        return {
            "interval_s": [(b - a) / time_scale for a, b in zip(ends, ends[1:], strict=False)],
            "step_s": [r["step_seconds"] / time_scale for r in self.rows[first + 1 :]],
            "groups_trained": [r["groups_trained"] for r in self.rows[first + 1 :]],
            "groups_generated": [r["groups_generated"] for r in self.rows[first + 1 :]],
        }

    def phases(self, first: int, time_scale: float) -> dict[str, float]:
        """Median simulated seconds per step of each phase (``time/*``) and of the step, over
        the steps after ``first`` (where the time goes)."""
        rows = self.rows[first + 1 :]
        keys = sorted({k for r in rows for k in r if k.startswith("time/")} | {"step_seconds"})
        return {
            k.removeprefix("time/"): statistics.median(r.get(k, 0.0) for r in rows) / time_scale
            for k in keys
        }

    def images_per_s(self, first: int, last: int, group_size: int) -> float:
        """Trained images per wall second over steps ``first+1 .. last``."""
        trained = sum(r["groups_trained"] for r in self.rows[first + 1 : last + 1]) * group_size
        return trained / (self.t[last] - self.t[first])


def last_measured(rec: Recorder) -> int:
    """The last step a throughput window may end on: not the run's final step, which submits no
    rollout ahead (there is no next step) and so runs shorter than a steady-state step wherever
    rollouts are the bottleneck (a window ending on it read 1.04 of the ideal at 2 + 14)."""
    return len(rec.t) - 2


def train_steps(cfg: Any, ex: Any, steps: int, after: Any = None) -> Recorder:
    """``driver.train`` for ``steps`` steps on ``ex`` (the real loop), recording step ends."""
    from maskgrpo_ray.loop import driver
    from maskgrpo_ray.pipeline.settings import settings_from_config
    from maskgrpo_ray.prompts.loading import PromptStream, load_prompts

    cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"steps": steps})})
    if settings_from_config(cfg).update != ex.settings.update:  # the learner took its own
        raise SystemExit("bench: a row's learner settings differ from its executor's")
    ex.prompts_per_step = cfg.train.prompts_per_step  # the chunking follows the row's batch
    rec = Recorder(ex, after)
    stream = PromptStream(load_prompts("toy", "train"), cfg.run.seed, True)
    with tempfile.TemporaryDirectory() as d:
        driver.train(cfg, ex, Path(d), stream, load_prompts("toy", "eval")[:1], on_step_end=rec)
    return rec


def with_lag(cfg: Any, lag: int) -> Any:
    return cfg.model_copy(
        update={"rollout": cfg.rollout.model_copy(update={"max_policy_lag": lag})}
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
