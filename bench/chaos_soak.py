"""Chaos soak: faults at random moments of one long toy run on the Ray backend; the run must end
with the weights of a fault-free run.

    .venv/bin/python -m bench.chaos_soak [--steps 40] [--faults 16] [--seed 0]
        [--out bench/results_chaos_soak.json]

Both runs are ``configs/toy.yaml`` on the Ray backend (2 rollout actors, 1 reward actor, 2
DeepSpeed learner ranks, asynchronous rollouts one step ahead: ``rollout.max_policy_lag=1``,
a checkpoint every 3 steps, keep 2), started with the command a user types
(``maskgrpo_ray.cli.main``), with the same seed. The faulty run gets a plan drawn from
``--seed``: SIGKILLs of a rollout actor, the reward actor, the filter actor and a learner rank
(either), each at one of these moments of a step:

* ``start``: as the step starts;
* ``random``: a timer fires 0 to 0.3 s after the step starts (a toy step takes about 0.15 s
  here: wherever the run then is, this step or the next, update, sync, evaluation);
* ``sync``: as the weight sync after the update starts;
* ``checkpoint``: as the checkpoint after the step starts being written;
* ``ahead``: during the update, while the next step's rollouts run ahead of it;

and once a learner rank of the new group while it is being restored after the first learner
fault (``restore``: a second fault in a recovery); at most one fault per step, and none in the last two steps (the final evaluation is not a
step). Once, at a step's start, the driver gets SIGTERM: the run checkpoints and exits 0; the
newest checkpoint's largest file is then cut to half its size, and the same command is run
again: it must find the damage, say so in one line and resume from the checkpoint before.

The soak's table: faults injected by kind and moment; groups lost and trained twice (each
step's ``prompts_trained`` against the fault-free run's: 0 / 0); the compared metrics' largest
relative difference per step; the final weights (``final_policy.safetensors``) against the
fault-free run's (max |difference|, bit-equal or not); recovery seconds per fault kind (from
the fault to the executor's "replaced" / "restored" event; for SIGTERM, signal to exit), median
and max; every death counted in the row metrics (``*_actor_restarts``, ``learner_restarts``);
throughput (samples/s) of the fault-free steps against the steps right after a recovery.
``tests/test_chaos_soak.py`` runs a short plan (a few faults, about two minutes) in CI. Files:
``chaos_plan.py`` (which fault, when), ``chaos_inject.py`` (injecting them into the running
run); this file runs the two runs and reports.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench import fault_drill  # (the drill's command, rows and group accounting)
from bench.chaos_inject import Chaos, truncate_newest_checkpoint
from bench.chaos_plan import CHECKPOINT_EVERY, KINDS, MOMENTS, RESTORE, Fault, plan_faults

ROOT = Path(__file__).resolve().parents[1]
SOAK_SETTINGS = [
    "rollout.max_policy_lag=1",
    f"run.checkpoint_every_steps={CHECKPOINT_EVERY}",
    "run.keep_checkpoints=2",
    "rollout.max_restarts=1000",
    "reward.max_restarts=1000",
    "run.max_learner_restarts=1000",
]
RESTART_COUNTER = {
    "rollout": "rollout_actor_restarts",
    "reward": "reward_actor_restarts",
    "filter": "filter_actor_restarts",
    "learner": "learner_restarts",
}
RECOVERED = {
    "rollout": "replaced",
    "reward": "replaced",
    "filter": "replaced",
    "learner": "restored",
}


class _Lines(logging.Handler):
    """The run's warnings, kept for the report."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def run_soak(run_dir: Path, steps: int, faults: list[Fault] | None) -> dict[str, Any]:
    """One run (``faults`` None: fault-free) to completion, resumed after its SIGTERM."""
    extra = [f"train.steps={steps}", *SOAK_SETTINGS]
    chaos = Chaos(faults or [])
    lines = _Lines()
    logging.getLogger().addHandler(lines)
    out: dict[str, Any] = {"exit_codes": []}
    t0 = time.monotonic()
    try:
        with chaos.installed():
            out["exit_codes"].append(fault_drill._train(run_dir, extra))
            summary = json.loads((run_dir / "summary.json").read_text())
            if not summary.get("completed"):
                out["first_summary"] = summary
                sig = next(f for f in chaos.faults if f.kind == "sigterm")
                out["signal_to_exit_s"] = time.monotonic() - (sig.t or 0.0)
                out["truncated"] = truncate_newest_checkpoint(run_dir)
                chaos.segment = 1
                t1 = time.monotonic()
                out["exit_codes"].append(fault_drill._train(run_dir, extra))
                resumed = [r for r in chaos.rows if r["segment"] == 1]
                out["resume_to_first_step_s"] = resumed[0]["t"] - t1 if resumed else None
    finally:
        logging.getLogger().removeHandler(lines)
    out["wall_s"] = time.monotonic() - t0
    out["warnings"] = lines.lines
    out["rows"] = fault_drill._rows(run_dir)
    out["all_rows"] = chaos.rows
    out["summary"] = json.loads((run_dir / "summary.json").read_text())
    out["faults"] = chaos.faults
    out["events"] = [e for ex in chaos.executors for e in ex.events]
    return out


def final_weights_diff(a: Path, b: Path) -> tuple[float, bool]:
    from safetensors.torch import load_file

    wa, wb = (
        load_file(str(a / "final_policy.safetensors")),
        load_file(str(b / "final_policy.safetensors")),
    )
    if wa.keys() != wb.keys():
        return float("inf"), False
    diff = max(float((wa[k].double() - wb[k].double()).abs().max()) for k in wa)
    return diff, all(wa[k].dtype == wb[k].dtype and bool((wa[k] == wb[k]).all()) for k in wa)


def report(
    clean: dict[str, Any], faulty: dict[str, Any], clean_dir: Path, faulty_dir: Path
) -> dict[str, Any]:
    """The soak's figures (see the module docstring)."""
    base = fault_drill.compare(
        clean, {**faulty, "fault": "soak", "events": [], "signal_to_exit_s": 0.0}
    )
    faults: list[Fault] = faulty["faults"]
    delivered = [f for f in faults if f.t is not None and f.t > 0]
    by_kind: dict[str, list[float]] = {}
    first_rows: list[float] = []  # the first step ending after a recovery
    recovered_rows: list[float] = []  # the three after it
    for f in delivered:
        if f.kind == "sigterm":
            by_kind.setdefault("sigterm", []).append(faulty["signal_to_exit_s"])
            continue
        want = RECOVERED[f.kind]
        role = f.kind
        t_rec = next(
            (
                t
                for t, r, what in sorted(faulty["events"])
                if t >= f.t and r == role and what == want
            ),
            None,
        )
        if t_rec is not None:
            by_kind.setdefault(f.kind, []).append(t_rec - f.t)
            after = [r for r in faulty["all_rows"] if r["t"] > t_rec][:4]
            if after and after[0].get("samples_per_second"):  # (it holds the recovery's tail)
                first_rows.append(after[0]["samples_per_second"])
            recovered_rows += [
                r["samples_per_second"] for r in after[1:] if r.get("samples_per_second")
            ]
    # deaths in the row metrics: per process segment, the last row's counters
    counted: dict[str, float] = {}
    for seg in (0, 1):
        rows = [r for r in faulty["all_rows"] if r["segment"] == seg]
        if rows:
            for kind, key in RESTART_COUNTER.items():
                counted[kind] = counted.get(kind, 0.0) + float(rows[-1].get(key) or 0.0)
    injected = {k: sum(1 for f in delivered if f.kind == k) for k in (*KINDS, "sigterm")}
    diff, bit_equal = final_weights_diff(clean_dir, faulty_dir)
    fault_steps = {f.step for f in delivered}
    clean_sps = [r["samples_per_second"] for r in clean["rows"] if r.get("samples_per_second")]
    quiet = [
        r["samples_per_second"]
        for r in faulty["rows"]
        if r["step"] not in fault_steps and r.get("samples_per_second")
    ]
    fallback = [w for w in faulty["warnings"] if "is not usable" in w and "falling back" in w]
    by_step = {r["step"]: r for r in clean["rows"]}
    first_diff = next(
        (
            (r["step"], k, by_step[r["step"]].get(k), r.get(k))
            for r in faulty["rows"]
            for k in fault_drill.COMPARED
            if r.get(k) != by_step[r["step"]].get(k)
        ),
        None,
    )
    return {
        "steps": len(clean["rows"]),
        "completed": base["completed"],
        "exit_codes": faulty["exit_codes"],
        "steps_in_metrics": base["steps_in_metrics"],
        "injected": injected,
        "by_moment": {
            m: sum(1 for f in delivered if f.moment == m and f.kind != "sigterm")
            for m in (*MOMENTS, RESTORE)
        },
        "deaths_counted": counted,
        "groups_lost": base["groups_lost"],
        "groups_duplicated": base["groups_duplicated"],
        "max_rel_diff": base["max_rel_diff"],
        "first_diff": first_diff,  # (step, metric, fault-free, faulty) or None
        "final_weights_max_abs_diff": diff,
        "final_weights_bit_equal": bit_equal,
        "recovery_s": {
            k: {"n": len(v), "median": statistics.median(v), "max": max(v)}
            for k, v in by_kind.items()
        },
        "truncated": faulty.get("truncated"),
        "fallback_lines": fallback,
        "resume_to_first_step_s": faulty.get("resume_to_first_step_s"),
        "sps_clean_run": statistics.median(clean_sps) if clean_sps else None,
        "sps_quiet_steps": statistics.median(quiet) if quiet else None,
        "sps_first_step_after_recovery": statistics.median(first_rows) if first_rows else None,
        "sps_after_recovery": statistics.median(recovered_rows) if recovered_rows else None,
        "faults": [asdict(f) for f in faults],
        "wall_s": {"clean": clean["wall_s"], "faulty": faulty["wall_s"]},
    }


def table(r: dict[str, Any]) -> str:
    rec = r["recovery_s"]
    lines = [
        f"steps {r['steps']}, completed {r['completed']}, exit codes {r['exit_codes']}, "
        f"wall {r['wall_s']['faulty']:.0f} s (fault-free {r['wall_s']['clean']:.0f} s)",
        f"faults injected by kind: {r['injected']}; by moment: {r['by_moment']}",
        f"deaths in the row metrics: {r['deaths_counted']}",
        f"groups lost / trained twice: {r['groups_lost']} / {r['groups_duplicated']}; "
        f"metrics max rel. diff {r['max_rel_diff']:.1e} (first difference: {r['first_diff']})",
        f"final weights vs fault-free: max |diff| {r['final_weights_max_abs_diff']:.3g}, "
        f"bit-equal {r['final_weights_bit_equal']}",
        f"truncated before the resume: {r['truncated']}; the line: {r['fallback_lines']}",
        "recovery (s): "
        + ", ".join(
            f"{k} n={v['n']} median {v['median']:.2f} max {v['max']:.2f}" for k, v in rec.items()
        ),
        "samples/s (medians): fault-free run {}, the faulty run's steps without a fault {}, "
        "the first step ending after a recovery {}, the 3 steps after that {}".format(
            *(
                "-" if r[k] is None else f"{r[k]:.0f}"
                for k in (
                    "sps_clean_run",
                    "sps_quiet_steps",
                    "sps_first_step_after_recovery",
                    "sps_after_recovery",
                )
            )
        ),
    ]
    return "\n".join(lines)


def soak(steps: int, n_faults: int, seed: int, tmp: Path, restore: bool = True) -> dict[str, Any]:
    faults = plan_faults(seed, steps, n_faults, restore)
    clean = run_soak(tmp / "clean", steps, None)
    faulty = run_soak(tmp / "faulty", steps, faults)
    return report(clean, faulty, tmp / "clean", tmp / "faulty")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--faults", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-restore", action="store_true", help="no kill during a restore")
    ap.add_argument("--keep", default=None, help="keep both runs' folders here")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results_chaos_soak.json"))
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    import ray

    from maskgrpo_ray.cluster.attach import connect

    connect(None, num_cpus=4, include_dashboard=False)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            where = Path(args.keep) if args.keep else Path(tmp)
            res = soak(args.steps, args.faults, args.seed, where, not args.no_restore)
    finally:
        ray.shutdown()
    print(table(res))
    Path(args.out).write_text(json.dumps(res, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
