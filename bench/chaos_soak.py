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
``tests/test_chaos_soak.py`` runs a short plan (a few faults, about two minutes) in CI.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import random
import signal
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench import fault_drill  # (the drill's command, rows and group accounting)

ROOT = Path(__file__).resolve().parents[1]

KINDS = ("rollout", "reward", "filter", "learner")
MOMENTS = ("start", "random", "sync", "checkpoint", "ahead")
RESTORE = "restore"  # a learner rank of the group being restored after a learner fault
CHECKPOINT_EVERY = 3
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


@dataclass
class Fault:
    step: int
    kind: str  # one of KINDS, or "sigterm"
    moment: str  # one of MOMENTS ("start" for sigterm)
    delay_s: float = 0.0  # "random": seconds after the step's start
    rank: int = 0  # "learner": which rank is killed
    t: float | None = None  # when it was delivered (monotonic)
    segment: int | None = None  # 0: before the SIGTERM, 1: the resumed process
    note: str = ""


def checkpoint_step(step: int) -> bool:
    """A checkpoint is written after ``step`` (the one at ``step + 1``)."""
    return (step + 1) % CHECKPOINT_EVERY == 0


def has_ahead(step: int, steps: int) -> bool:
    """``step``'s update runs with the next step's rollouts in flight (lag 1, no checkpoint
    between them, not the last step)."""
    return step + 1 < steps and not checkpoint_step(step)


def plan_faults(seed: int, steps: int, n: int, restore: bool = True) -> list[Fault]:
    """``n`` faults and one SIGTERM on distinct steps of ``1 .. steps - 3``; every kind and
    every moment at least once where ``n`` allows (a checkpoint moment on a checkpoint step, an
    ahead moment on a step with rollouts ahead). ``restore``: one more, a learner rank killed
    during the restore that the first learner fault causes (it shares that fault's step)."""
    rng = random.Random(seed)
    usable = list(range(1, steps - 2))
    if n + 1 > len(usable):
        raise ValueError(f"{n} faults and a SIGTERM need {n + 1} steps in 1..{steps - 3}")
    sigterm = usable[len(usable) // 2 + rng.randrange(-1, 2)]
    free = [s for s in usable if s != sigterm]
    combos = [(k, m) for m in MOMENTS for k in KINDS]
    rng.shuffle(combos)
    # the first picks cover every moment (learner at the checkpoint and the sync first: the
    # hardest) and every kind, the rest are drawn freely
    wanted = [
        ("learner", "checkpoint"),
        ("learner", "sync"),
        ("rollout", "ahead"),
        ("reward", "random"),
        ("filter", "start"),
    ]
    picks = wanted[:n] + [rng.choice(combos) for _ in range(max(n - len(wanted), 0))]
    faults = []
    for kind, moment in picks:
        if moment == "checkpoint":
            cands = [s for s in free if checkpoint_step(s)]
        elif moment == "ahead":
            cands = [s for s in free if has_ahead(s, steps)]
        else:
            cands = list(free)
        if not cands:
            moment, cands = "start", list(free)
        s = rng.choice(cands)
        free.remove(s)
        faults.append(Fault(s, kind, moment, delay_s=rng.uniform(0.0, 0.3), rank=rng.randrange(2)))
    faults.append(Fault(sigterm, "sigterm", "start"))
    learner = sorted(f.step for f in faults if f.kind == "learner")
    if restore and learner:
        faults.append(Fault(learner[0], "learner", RESTORE, rank=rng.randrange(2)))
    return sorted(faults, key=lambda f: f.step)


def _pid(ex: Any, f: Fault) -> int:
    if f.kind == "learner":
        return ex.learner.pids()[f.rank]
    if f.kind == "rollout":
        return fault_drill._pid(
            ex.fleet.rollout_handle(ex.fleet.rollout_actor_ids()[0]).pid.remote()
        )
    if f.kind == "reward":
        return fault_drill._pid(ex.fleet.rewards.members[0].handle.pid.remote())
    return fault_drill._pid(ex.filters.actor.pid.remote())


class Chaos:
    """Delivers a plan's faults from hooks around ``driver.run_step`` and the executor's
    ``update``, ``sync_weights`` and ``save`` (the only test hooks: the faults themselves are
    real signals to real processes). Each fault is delivered once, the first time its step
    and moment come (a step replayed after a learner roll-back gets none twice)."""

    def __init__(self, faults: list[Fault]) -> None:
        self.faults = faults
        self.step: int | None = None
        self.ahead = 0
        self.segment = 0
        self.executors: list[Any] = []
        self.rows: list[dict[str, Any]] = []  # every logged row, replays included
        self.timers: list[threading.Timer] = []
        self.in_step = False
        self.recovering = False

    def _due(self, moment: str) -> Fault | None:
        for f in self.faults:
            if f.t is not None or f.moment != moment or self.step is None:
                continue
            if f.step == self.step or (moment == RESTORE and f.step <= self.step):
                return f
        return None

    def _deliver(self, ex: Any, f: Fault, pid: int | None = None) -> None:
        f.t, f.segment = time.monotonic(), self.segment
        if f.kind == "sigterm":
            for t in self.timers:
                t.cancel()
            os.kill(os.getpid(), signal.SIGTERM)
            return
        try:
            os.kill(pid if pid is not None else _pid(ex, f), signal.SIGKILL)
        except ProcessLookupError:  # it died before the signal came: counted as not delivered
            f.t, f.note = -1.0, "the process was already gone"

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        from maskgrpo_ray.backend.ray_executor import RayExecutor
        from maskgrpo_ray.loop import driver
        from maskgrpo_ray.loop.recovery import Checkpoints

        real_step, real_loop_step = driver.run_step, driver._Loop.step
        real_recover = Checkpoints.recover_learner
        real = {n: getattr(RayExecutor, n) for n in ("update", "sync_weights", "save", "load")}
        chaos = self

        def run_step(ex, settings, s, source, pending=None, *, ahead=0):  # noqa: ANN001, ANN202
            if ex not in chaos.executors:
                chaos.executors.append(ex)
            chaos.step, chaos.ahead, chaos.in_step = s, ahead, True
            if s >= settings.steps - 1:  # no timer reaches the final evaluation
                for t in chaos.timers:
                    t.cancel()
            f = chaos._due("start")
            if f is not None:
                chaos._deliver(ex, f)
            f = chaos._due("random")
            if f is not None:
                pid = _pid(ex, f)  # looked up now; the timer thread only signals
                f.t = -1.0  # taken (the timer sets the delivery time)
                timer = threading.Timer(f.delay_s, lambda: chaos._deliver(ex, f, pid))
                timer.daemon = True
                chaos.timers.append(timer)
                timer.start()
            try:
                return real_step(ex, settings, s, source, pending, ahead=ahead)
            finally:
                chaos.in_step = False

        def loop_step(self_, step, stop):  # noqa: ANN001, ANN202
            row = real_loop_step(self_, step, stop)
            chaos.rows.append({**row, "segment": chaos.segment, "t": time.monotonic()})
            return row

        def recover_learner(self_, *args, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
            chaos.recovering = True
            try:
                return real_recover(self_, *args, **kw)
            finally:
                chaos.recovering = False

        def hooked(name: str, moment: str) -> Any:
            def call(ex, *args, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
                f = chaos._due(moment)
                if moment == RESTORE and not chaos.recovering:
                    f = None  # a resume's restore (before the loop) is not a recovery
                if f is not None and (moment != "sync" or chaos.in_step):
                    if moment == "ahead" and not chaos.ahead:
                        f.note = "no rollout was ahead at this update"
                    chaos._deliver(ex, f)
                return real[name](ex, *args, **kw)

            return call

        driver.run_step = run_step
        driver._Loop.step = loop_step
        RayExecutor.update = hooked("update", "ahead")
        RayExecutor.sync_weights = hooked("sync_weights", "sync")
        RayExecutor.save = hooked("save", "checkpoint")
        RayExecutor.load = hooked("load", RESTORE)
        Checkpoints.recover_learner = recover_learner
        try:
            yield
        finally:
            for t in self.timers:
                t.cancel()
            driver.run_step, driver._Loop.step = real_step, real_loop_step
            Checkpoints.recover_learner = real_recover
            for n, fn in real.items():
                setattr(RayExecutor, n, fn)


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def truncate_newest_checkpoint(run_dir: Path) -> str:
    """Cut the largest file of the checkpoint ``latest`` names to half its size."""
    root = run_dir / "checkpoints"
    name = (root / "latest").read_text().strip()
    biggest = max(
        (p for p in (root / name).rglob("*") if p.is_file()), key=lambda p: p.stat().st_size
    )
    data = biggest.read_bytes()
    biggest.write_bytes(data[: len(data) // 2])
    return str(biggest.relative_to(root))


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
