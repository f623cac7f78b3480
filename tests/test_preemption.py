"""SIGTERM to a training driver: a checkpoint, exit 0 within the grace period, and the same
command run again finishes the run with every step logged once. On the Ray backend the signal
goes to every process of the run at once (its process group, and each of its processes), as
``timeout``, SLURM's ``scancel`` or a container's stop deliver it."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tiny_runs import NO_GRIDS, ONE_OF_EACH, tiny_toy

from maskgrpo_ray.checkpoints.run_store import latest_checkpoint
from maskgrpo_ray.loop.recovery import Preemption, StepAbandoned

STEPS = 12
GRACE_S = 20.0
SMALL = tiny_toy(
    STEPS,
    3,
    "run.checkpoint_every_steps=0",  # the only checkpoint is the one the signal makes
    f"run.preemption_grace_seconds={GRACE_S}",
)


RAY = [*ONE_OF_EACH, NO_GRIDS]  # one actor of each kind, small CPU shares: fits 2 cores


def _command(run: Path, backend: str = "local") -> list[str]:
    out = [sys.executable, "-m", "maskgrpo_ray.cli", "train", "--backend", backend]
    out += ["--run-dir", str(run)]
    for s in SMALL + (RAY if backend == "ray" else []):
        out += ["--set", s]
    return out


def _steps(run: Path) -> list[int]:
    return [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.timeout(600)
def test_sigterm_checkpoints_exits_zero_and_the_same_command_resumes(tmp_path):
    run = tmp_path / "run"
    env = {**os.environ, "MASKGRPO_CACHE_DIR": str(tmp_path / "cache")}
    log_path = tmp_path / "first.log"
    with log_path.open("w") as log_file:
        proc = subprocess.Popen(_command(run), env=env, stdout=log_file, stderr=subprocess.STDOUT)
        metrics = run / "metrics.jsonl"
        deadline = time.monotonic() + 300
        while not (metrics.exists() and metrics.read_text().strip()):
            assert proc.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, "no metrics line within 300 s"
            time.sleep(0.05)
        t_signal = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=GRACE_S + 30)
        took = time.monotonic() - t_signal
    out = log_path.read_text()
    assert rc == 0, out
    assert took < GRACE_S, (took, out)
    assert "SIGTERM received" in out
    done = _steps(run)
    assert 1 <= len(done) < STEPS, "the run should have been stopped mid-way"
    assert done == list(range(len(done)))
    ck = latest_checkpoint(run)
    assert ck is not None and ck.name == f"step_{len(done):06d}", (ck, done)
    assert (ck / "manifest.json").exists()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["completed"] is False and summary["stopped_by"] == "SIGTERM"
    assert summary["steps_done"] == summary["resume_step"] == len(done)

    again = subprocess.run(
        _command(run), env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"from checkpoint step_{len(done):06d}" in again.stderr
    assert _steps(run) == list(range(STEPS))  # each step exactly once, in order
    summary = json.loads((run / "summary.json").read_text())
    assert summary["completed"] is True and summary["start_step"] == len(done)
    print(f"SIGTERM to exit: {took:.2f} s; stopped after {len(done)} of {STEPS} steps")


def _descendants(pid: int) -> list[int]:
    """Every process started under ``pid`` (its local Ray cluster: GCS, raylet, workers)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _weights(run: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(run / "final_policy.safetensors"))


@pytest.mark.slow
@pytest.mark.ci
@pytest.mark.timeout(900)
def test_sigterm_to_every_process_of_a_ray_run(tmp_path):
    """The Ray-backend toy run in its own process group; mid-run SIGTERM to the group and to
    every process under the driver (the local cluster's GCS, raylet and workers, the learner
    rank among them). It exits 0 within the grace period with a checkpoint at most one step
    behind; the same command finishes it, every step logged once, and its final weights are
    bit-equal to an uninterrupted run's."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["MASKGRPO_CACHE_DIR"] = str(tmp_path / "cache")
    full, cut = tmp_path / "full", tmp_path / "cut"
    ran = subprocess.run(_command(full, "ray"), env=env, capture_output=True, text=True)
    assert ran.returncode == 0, ran.stderr[-3000:]
    log_path = tmp_path / "first.log"
    with log_path.open("w") as log_file:
        proc = subprocess.Popen(
            _command(cut, "ray"),
            env=env,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, as `timeout` or a shell's job has
        )
        metrics = cut / "metrics.jsonl"
        deadline = time.monotonic() + 300
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
            assert proc.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "no second metrics line within 300 s"
            time.sleep(0.02)
        everyone = {pid: _cmdline(pid) for pid in _descendants(proc.pid)}
        t_signal = time.monotonic()
        os.killpg(proc.pid, signal.SIGTERM)
        for pid in everyone:  # the workers have process groups of their own
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        rc = proc.wait(timeout=GRACE_S + 60)
        took = time.monotonic() - t_signal
    out = log_path.read_text()
    assert rc == 0, out[-3000:]
    assert took < GRACE_S, (took, out[-3000:])
    assert "SIGTERM received" in out and "learner rank 0 died" not in out
    signalled = " ".join(everyone.values())
    assert "raylet" in signalled and "ray::LearnerWorker" in signalled, signalled
    gone_by = time.monotonic() + 20  # the driver has exited; its children are exiting too
    while [p for p in everyone if _alive(p)] and time.monotonic() < gone_by:
        time.sleep(0.2)
    left = {p: everyone[p] for p in everyone if _alive(p)}
    assert not left, f"a process of the first attempt outlived it by 20 s: {left}"
    done = _steps(cut)
    assert 1 <= len(done) < STEPS, "the run should have been stopped mid-way"
    assert done == list(range(len(done)))
    ck = latest_checkpoint(cut)
    assert ck is not None and int(ck.name.removeprefix("step_")) in (len(done) - 1, len(done))
    summary = json.loads((cut / "summary.json").read_text())
    assert summary["completed"] is False and summary["resume_step"] == int(ck.name[5:])

    again = subprocess.run(_command(cut, "ray"), env=env, capture_output=True, text=True)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"from checkpoint {ck.name}" in again.stderr
    assert _steps(cut) == list(range(STEPS))  # each step exactly once, in order
    a, b = _weights(full), _weights(cut)
    assert a.keys() == b.keys() and all(bool((a[k] == b[k]).all()) for k in a)
    print(f"group SIGTERM to exit 0: {took:.2f} s; stopped after {len(done)} of {STEPS} steps")


def _cmdline(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def test_a_step_that_would_overrun_the_grace_period_is_abandoned(monkeypatch):
    """A signal in a step with no time to finish it: StepAbandoned from the alarm, armed to
    fire when the grace period minus the checkpoint reserve runs out, and the handlers come
    back. No wall-clock bound a busy machine can break: the alarm's budget is read where it is
    armed, and the abandonment is the alarm's, not the signal's nor the step's end."""
    before = signal.getsignal(signal.SIGTERM)
    stop = Preemption(grace_s=1.0)
    stop.save_s = 0.2  # reserve = 0.2 * 1.5 + min(5, 0.1) = 0.4 s: abandon at about 0.6 s
    armed: list[tuple[float, float]] = []  # (seconds, when) of each non-zero alarm armed
    real_setitimer = signal.setitimer

    def setitimer(which: int, seconds: float, *rest: float):  # noqa: ANN202
        if which == signal.ITIMER_REAL and seconds > 0:
            armed.append((seconds, time.monotonic()))
        return real_setitimer(which, seconds, *rest)

    monkeypatch.setattr(signal, "setitimer", setitimer)
    assert stop.install()
    try:
        t0 = time.monotonic()
        with pytest.raises(StepAbandoned) as raised, stop.step():
            os.kill(os.getpid(), signal.SIGTERM)
            while time.monotonic() - t0 < 10:  # a step that would take 10 s
                time.sleep(0.01)
        took = time.monotonic() - t0
    finally:
        stop.uninstall()
    assert stop.requested and stop.signal_name == "SIGTERM"
    # one alarm, armed in the signal's handler for what is left of 1.0 - 0.4 s after the signal:
    # budget = 0.6 - (t_arm - t_signal) with t_arm at or before the spy's clock reading
    ((budget, t_arm),) = armed
    assert 0.6 - (t_arm - stop.t_signal) - 1e-6 <= budget <= 0.6
    assert raised.traceback[-1].name == "_on_alarm"  # the alarm ended the step, nothing else
    assert took >= 0.5, took  # the alarm fires at 0.6 s after the signal, never before
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_signal_between_steps_only_sets_the_flag():
    stop = Preemption(grace_s=30.0)
    assert stop.install()
    try:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.01)  # let the interpreter run the handler
        assert stop.requested and stop.signal_name == "SIGINT"
        assert stop.seconds_left() > 29.0
    finally:
        stop.uninstall()


@pytest.mark.slow
@pytest.mark.ci
@pytest.mark.timeout(300)
def test_an_actor_keeps_serving_after_sigterm(tmp_path):
    """On a cluster the run did not start (plain ``ray.init``: no blocked SIGTERM), a SIGTERM
    to one of the run's actors is logged and ignored (actors.base.outlive_sigterm), while an
    actor without it dies of the same signal (Ray's own handler): the signal reaches both."""
    import ray

    from maskgrpo_ray.actors.control import RemoteControlActor

    @ray.remote(num_cpus=0)
    class Plain:
        def pid(self) -> int:
            return os.getpid()

    os.environ.pop("RAY_ADDRESS", None)
    if ray.is_initialized():
        ray.shutdown()
    ray.init(num_cpus=1, include_dashboard=False)
    try:
        ours, plain = RemoteControlActor.remote(), Plain.remote()
        pids = ray.get([ours.pid.remote(), plain.pid.remote()], timeout=120)
        for pid in pids:
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        while _alive(pids[1]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(pids[1]), "Ray's handler should end a plain actor"
        assert ray.get(ours.get_status.remote(), timeout=30) == {"pending_rollout_request": None}
        assert _alive(pids[0])
    finally:
        ray.shutdown()
