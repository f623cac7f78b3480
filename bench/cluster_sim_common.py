"""bench_cluster_sim's shared parts: the simulated Show-o config and profiles, the local cluster with
logical GPUs, a row's config and its ideal (``planner.split.pipeline_ideal``), and the recorder
that times a run's steps."""

from __future__ import annotations

import argparse
import math
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field
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
