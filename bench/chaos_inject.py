"""The chaos soak's hands: :class:`Chaos` kills the planned actor (SIGKILL by pid) at the planned
moment of a running toy run on the Ray backend, sends the driver SIGTERM once, and records when
each fault was injected; :func:`truncate_newest_checkpoint` damages the newest checkpoint."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench import fault_drill  # (the drill's command, rows and group accounting)
from bench.chaos_plan import RESTORE, Fault


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
