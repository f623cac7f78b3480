"""Fault drill: real faults in real Ray training runs, measured against an uninterrupted run.

    .venv/bin/python -m bench.fault_drill [--faults rollout,reward,filter,learner,sigterm]
        [--out bench/results_fault_drill.json]

Every run is ``configs/toy.yaml`` on the Ray backend (2 rollout actors, 1 reward actor, 2
DeepSpeed learner ranks) for ``STEPS`` steps with a checkpoint every 2, started with the same
command a user types (``maskgrpo_ray.cli.main``). One run has no fault; each other run gets one
fault at the start of step ``FAULT_STEP`` (from a hook around ``driver.run_step``, the only test
hook here):

* ``rollout`` / ``reward`` / ``filter`` / ``learner``: SIGKILL to that actor's process (for the
  learner, rank 1: its peer is left blocked in a collective);
* ``sigterm``: SIGTERM to the driver (what Kubernetes sends); the run checkpoints and exits 0,
  then the same command is run again and resumes.

Per fault the table gives: the time from the fault to its detection (the executor's event log)
and to recovery (a replacement ready with the current weights; for the learner, a new group
restored from the checkpoint and the rollout actors re-synced; for SIGTERM, signal to exit), the
steps completed, the groups lost and duplicated (each step's trained prompt positions,
``prompts_trained`` in ``metrics.jsonl``, against the uninterrupted run: a prompt position
trained fewer times is lost, more times duplicated), the largest relative difference of the
compared metrics from the uninterrupted run over all steps, and throughput (samples/s, mean over
the steps before the fault and after recovery). ``tests/test_fault_drill.py`` runs it and
asserts 0 lost, 0 duplicated and equal metrics.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import logging
import os
import signal
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
STEPS = 6
FAULT_STEP = 3
FAULTS = ("rollout", "reward", "filter", "learner", "sigterm")
SETTINGS = [
    f"train.steps={STEPS}",
    "train.prompts_per_step=4",
    "rollout.unmasking_steps=4",
    "eval.samples_per_prompt=1",
    "rollout.num_actors=2",
    "reward.num_actors=1",
    "learner.num_workers=2",
    "rollout.num_cpus_per_actor=0.25",
    "reward.num_cpus_per_actor=0.25",
    "learner.num_cpus_per_worker=0.25",
    "logging.progress_bar=false",
    "logging.sample_grid_every_steps=0",
    "filter.warmup_groups=4",
    "run.checkpoint_every_steps=2",
]
COMPARED = ("reward_mean", "loss", "ratio_mean", "grad_norm", "groups_dropped", "policy_version")


def _pid(ref: Any) -> int:
    import ray

    return int(ray.get(ref, timeout=60))


def inject(fault: str, ex: Any) -> None:
    """Deliver ``fault`` to the running executor ``ex`` (or to this driver process)."""
    if fault == "rollout":
        pid = _pid(ex.fleet.rollout_handle(ex.fleet.rollout_actor_ids()[0]).pid.remote())
    elif fault == "reward":
        pid = _pid(ex.fleet.rewards.members[0].handle.pid.remote())
    elif fault == "filter":
        pid = _pid(ex.filters.actor.pid.remote())
    elif fault == "learner":
        pid = ex.learner.pids()[1]
    elif fault == "sigterm":
        os.kill(os.getpid(), signal.SIGTERM)
        return
    else:
        raise ValueError(f"fault {fault!r}: use one of {FAULTS}")
    os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def fault_at(fault: str | None, step: int, record: dict[str, Any]) -> Iterator[None]:
    """Wrap ``driver.run_step`` so that ``fault`` hits at the start of ``step`` (once); keep the
    executor and the fault's time in ``record``."""
    from maskgrpo_ray.loop import driver

    real = driver.run_step

    def run_step(ex, settings, s, *args, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        record["executor"] = ex
        if fault is not None and s == step and "t_fault" not in record:
            record["t_fault"] = time.monotonic()
            inject(fault, ex)
        return real(ex, settings, s, *args, **kw)

    driver.run_step = run_step
    try:
        yield
    finally:
        driver.run_step = real


def _train(run_dir: Path, extra: list[str]) -> int:
    from maskgrpo_ray.cli.app import main

    args = ["train", "--config", str(ROOT / "configs/toy.yaml"), "--backend", "ray"]
    args += ["--run-dir", str(run_dir)]
    for s in [*SETTINGS, *extra]:
        args += ["--set", s]
    return main(args)


def _rows(run_dir: Path) -> list[dict[str, Any]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(x) for x in lines if x.strip()]


def run_one(fault: str | None, run_dir: Path, extra: list[str] | None = None) -> dict[str, Any]:
    """One training run with ``fault`` (None: none); its rows, exit codes and event times."""
    record: dict[str, Any] = {}
    t0 = time.monotonic()
    with fault_at(fault, FAULT_STEP, record):
        rc = _train(run_dir, list(extra or []))
    out: dict[str, Any] = {"fault": fault, "exit_codes": [rc], "wall_s": time.monotonic() - t0}
    out["run_dir"] = str(run_dir)
    if fault == "sigterm":  # the job is retried with the same command: it resumes
        out["signal_to_exit_s"] = time.monotonic() - record["t_fault"]
        out["first_summary"] = json.loads((run_dir / "summary.json").read_text())
        t1 = time.monotonic()
        out["exit_codes"].append(_train(run_dir, list(extra or [])))
        out["resume_wall_s"] = time.monotonic() - t1
    ex = record.get("executor")
    events = [e for e in getattr(ex, "events", []) if e[0] >= record.get("t_fault", t0)]
    out["t_fault"] = record.get("t_fault")
    out["events"] = [(t - record.get("t_fault", t0), role, what) for t, role, what in events]
    out["rows"] = _rows(run_dir) if (run_dir / "metrics.jsonl").exists() else []
    summary = run_dir / "summary.json"
    out["summary"] = json.loads(summary.read_text()) if summary.exists() else {}
    return out


def _trained(rows: list[dict[str, Any]]) -> collections.Counter:
    return collections.Counter(p for r in rows for p in r.get("prompts_trained") or [])


def compare(clean: dict[str, Any], faulty: dict[str, Any]) -> dict[str, Any]:
    """The drill's table row for ``faulty`` against ``clean``."""
    a, b = _trained(clean["rows"]), _trained(faulty["rows"])
    lost = sum((a - b).values())
    duplicated = sum((b - a).values())
    by_step = {r["step"]: r for r in clean["rows"]}
    worst = 0.0
    for r in faulty["rows"]:
        for k in COMPARED:
            x, y = by_step[r["step"]].get(k), r.get(k)
            if x is None or y is None:
                worst = max(worst, 0.0 if x is y else float("inf"))
                continue
            worst = max(worst, abs(x - y) / max(abs(x), 1e-12))
    ev = faulty["events"]
    detect = next((t for t, _, what in ev if what == "lost"), None)
    recover = next((t for t, _, what in ev if what in ("replaced", "restored")), None)
    if faulty["fault"] == "sigterm":
        detect, recover = 0.0, faulty["signal_to_exit_s"]

    def sps(rows: list[dict[str, Any]]) -> float | None:
        vals = [r["samples_per_second"] for r in rows if r.get("samples_per_second")]
        return statistics.mean(vals) if vals else None

    rows = faulty["rows"]
    return {
        "fault": faulty["fault"],
        "detect_s": detect,
        "recover_s": recover,
        "steps_completed": len({r["step"] for r in rows}),
        "steps_in_metrics": len(rows),
        "completed": bool(faulty["summary"].get("completed")),
        "exit_codes": faulty["exit_codes"],
        "groups_lost": lost,
        "groups_duplicated": duplicated,
        "max_rel_diff": worst,
        "sps_before": sps([r for r in rows if r["step"] < FAULT_STEP]),
        "sps_after": sps([r for r in rows if r["step"] > FAULT_STEP]),
        "learner_restarts": rows[-1].get("learner_restarts", 0.0),
        "rollout_actor_restarts": rows[-1].get("rollout_actor_restarts"),
        "reward_actor_restarts": rows[-1].get("reward_actor_restarts"),
    }


def table(rows: list[dict[str, Any]]) -> str:
    def f(x: Any, fmt: str = "{:.1f}") -> str:
        return "-" if x is None else fmt.format(x)

    out = [
        "| fault | detect (s) | recover (s) | steps | lost / duplicated | max rel. diff "
        "| samples/s before / after |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['fault']} | {f(r['detect_s'], '{:.2f}')} | {f(r['recover_s'])} "
            f"| {r['steps_completed']}/{STEPS} | {r['groups_lost']} / {r['groups_duplicated']} "
            f"| {r['max_rel_diff']:.1e} | {f(r['sps_before'])} / {f(r['sps_after'])} |"
        )
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--faults", default=",".join(FAULTS))
    ap.add_argument("--out", default=str(ROOT / "bench" / "results_fault_drill.json"))
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    import ray

    from maskgrpo_ray.cluster.attach import connect

    connect(None, num_cpus=4, include_dashboard=False)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            clean = run_one(None, Path(tmp) / "clean")
            results = [
                compare(clean, run_one(fault, Path(tmp) / fault))
                for fault in args.faults.split(",")
            ]
    finally:
        ray.shutdown()
    print(table(results))
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
