"""Distributed (Ray, synchronous and asynchronous) vs single-process samples/s on the same work,
same machine, same run; and the weight-sync time against the model's size in bytes.

    .venv/bin/python -m bench.bench_distributed [--config configs/toy.yaml] [--steps 10]
        [--set key=value ...] [--no-sync-sizes] [--out bench/results_distributed.json]

Three runs of ``driver.train``, each in a fresh process: the local backend, Ray with the synchronous loop
(``rollout.max_policy_lag=0``) and Ray with asynchronous rollouts (``max_policy_lag=1``: the
next step's rollouts are generated while the learner trains). Besides samples/s it reports the
fraction of step wall time the learner is busy (``learner_busy_fraction``, median over steps).

Both backends run ``driver.train`` on the same config (the toy world, the same prompts and
seeds); the figure is ``summary.json``'s ``samples_per_second`` (images generated per second of
step wall time: generate, score, filter, update, sync), which excludes cluster start-up and
evaluation. Overhead = 1 - ray / local. The weight-sync part pushes state dicts of growing size
from a learner stand-in to the rollout actors through the object store.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_backend(
    backend: str, steps: int, extra: list[str], config: str = "configs/toy.yaml"
) -> dict:
    from maskgrpo_ray.cli.app import run_train
    from maskgrpo_ray.config import load_config

    cfg = load_config(
        REPO / config,
        [
            f"run.backend={backend}",
            f"train.steps={steps}",
            "logging.progress_bar=false",
            "logging.sample_grid_every_steps=0",
            "eval.samples_per_prompt=1",
            *extra,
        ],
    )
    with tempfile.TemporaryDirectory() as d:
        summary = run_train(cfg, Path(d))
        rows = [json.loads(x) for x in (Path(d) / "metrics.jsonl").read_text().splitlines()]
    # the first step warms caches (DeepSpeed, the object store): report the steady state too
    steady = [r["samples_per_second"] for r in rows[1:]] or [summary["samples_per_second"]]
    return {
        "samples_per_second": summary["samples_per_second"],
        "steady_median_samples_per_second": statistics.median(steady),
        "train_seconds": summary["train_seconds"],
        "learner_busy_fraction_median": statistics.median(
            [r.get("learner_busy_fraction", 0.0) for r in rows[1:]] or [0.0]
        ),
        # the data plane (docs/ray_system.md, "Bytes per hop"), steps without a sample grid
        **_bytes_medians(rows),
        "weight_sync_seconds_median": statistics.median(
            [r.get("weight_sync_seconds") or 0.0 for r in rows]
        ),
        "time_per_phase_median": {
            k: statistics.median(r[k] for r in rows if k in r)
            for k in rows[0]
            if k.startswith("time/")
        },
    }


def run_fresh(backend: str, steps: int, extra: list[str], config: str) -> dict:
    """:func:`run_backend` in a fresh Python process (one process's runs slow each other
    down: after a few Ray clusters started and stopped in one process the figures drift)."""
    import subprocess

    spec = json.dumps({"backend": backend, "steps": steps, "extra": extra, "config": config})
    out = subprocess.run(
        [sys.executable, __file__, "--one", spec], check=True, capture_output=True, text=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _bytes_medians(rows: list[dict]) -> dict:
    plain = [r for r in rows[1:] if "bytes/driver_grid" not in r] or rows
    out = {}
    for key in (
        "bytes/rollouts",
        "bytes/driver_received",
        "bytes/driver_sent",
        "bytes/learner_fetch",
        "driver_bytes_fraction",
    ):
        vals = [r[key] for r in plain if key in r]
        if vals:
            out[key + "_median"] = statistics.median(vals)
    return out


def bench_weight_sync(sizes_mb: list[float], repeats: int, num_targets: int) -> list[dict]:
    """Object-store sync of a ``size`` MB fp32 state dict to ``num_targets`` actors."""
    import ray
    import torch

    @ray.remote(num_cpus=0.1)
    class Target:
        def load_weights(self, state: dict, version: int) -> int:
            return version

    @ray.remote(num_cpus=0.1)
    class Source:
        def __init__(self, numel: int) -> None:
            self.state = {f"w{i}": torch.randn(numel // 8) for i in range(8)}

        def trained_state(self) -> dict:
            return {k: v.clone() for k, v in self.state.items()}

    targets = [Target.remote() for _ in range(num_targets)]
    out = []
    for mb in sizes_mb:
        numel = int(mb * 2**20 / 4)
        src = Source.remote(numel)
        times = []
        for v in range(repeats):
            t0 = time.perf_counter()
            ref = src.trained_state.remote()
            ray.get([t.load_weights.remote(ref, v) for t in targets], timeout=600)
            times.append(time.perf_counter() - t0)
        out.append(
            {
                "bytes": numel // 8 * 8 * 4,
                "seconds_median": statistics.median(times[1:]),
                "seconds_first": times[0],
                "targets": num_targets,
            }
        )
        ray.kill(src)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--config", default="configs/toy.yaml")
    ap.add_argument("--no-sync-sizes", action="store_true", help="skip the weight-sync sizes")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--set", dest="extra", action="append", default=[])
    ap.add_argument(
        "--async-set",
        dest="async_extra",
        action="append",
        default=[],
        help="overrides for the asynchronous run only, e.g. rollout.num_actors=1",
    )
    ap.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run the three modes this many times, interleaved; ratios are taken per repeat "
        "(the same-machine noise between runs is large on a small machine)",
    )
    ap.add_argument("--sync-sizes-mb", default="0.27,4,16,64")
    ap.add_argument("--out", default=str(REPO / "bench" / "results_distributed.json"))
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: one run, JSON on stdout
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.one:
        spec = json.loads(args.one)
        print(
            json.dumps(run_backend(spec["backend"], spec["steps"], spec["extra"], spec["config"]))
        )
        return
    reps = []
    for _ in range(args.repeats):  # each run in a fresh process, with its own cluster
        local = run_fresh("local", args.steps, args.extra, args.config)
        ray_run = run_fresh(
            "ray", args.steps, [*args.extra, "rollout.max_policy_lag=0"], args.config
        )
        ray_async = run_fresh(
            "ray",
            args.steps,
            [*args.extra, "rollout.max_policy_lag=1", *args.async_extra],
            args.config,
        )
        reps.append((local, ray_run, ray_async))
        print(
            f"repeat {len(reps)}: local {local['steady_median_samples_per_second']:.1f}, "
            f"Ray sync {ray_run['steady_median_samples_per_second']:.1f}, "
            f"Ray async {ray_async['steady_median_samples_per_second']:.1f} samples/s",
            flush=True,
        )

    # the repeat with the median async ratio is reported in full; every ratio is listed
    def ratio(rep: tuple, i: int) -> float:
        return (
            rep[i]["steady_median_samples_per_second"] / rep[0]["steady_median_samples_per_second"]
        )

    ordered = sorted(reps, key=lambda rep: ratio(rep, 2))
    local, ray_run, ray_async = ordered[len(ordered) // 2]
    sync = []
    if not args.no_sync_sizes:
        import ray

        from maskgrpo_ray.cluster.attach import connect

        connect(None, num_cpus=2, include_dashboard=False)
        sync = bench_weight_sync(
            [float(x) for x in args.sync_sizes_mb.split(",")], repeats=5, num_targets=2
        )
        ray.shutdown()
    lsps = local["steady_median_samples_per_second"]
    result = {
        "machine": f"{os.cpu_count()} CPUs",
        "config": args.config,
        "steps": args.steps,
        "local": local,
        "ray": ray_run,
        "ray_async": ray_async,
        "ratio_ray_over_local": ray_run["steady_median_samples_per_second"] / lsps,
        "ratio_ray_async_over_local": ray_async["steady_median_samples_per_second"] / lsps,
        "async_overrides": args.async_extra,
        "ratios_per_repeat": [
            {"ray_sync": ratio(rep, 1), "ray_async": ratio(rep, 2)} for rep in reps
        ],
        "weight_sync": sync,
    }
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    print("| mode | samples/s (steady median) | vs local | learner busy (median) | driver bytes |")
    print("|---|---|---|---|---|")
    for name, r in (("local", local), ("Ray sync", ray_run), ("Ray async (lag 1)", ray_async)):
        sps = r["steady_median_samples_per_second"]
        frac = r.get("driver_bytes_fraction_median")
        share = "-" if frac is None else f"{frac:.2%} of the rollout bytes"
        print(
            f"| {name} | {sps:.1f} | {sps / lsps:.2f} | "
            f"{r['learner_busy_fraction_median']:.2f} | {share} |"
        )


if __name__ == "__main__":
    main()
