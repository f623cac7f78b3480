"""Faults in a real Ray job on a local head (started as docs/operations.md starts one:
``deploy/start_head.sh``, 127.0.0.1 only, token auth on), the job submitted with
``ray job submit``: SIGKILL of the job's driver process, then the same command submitted again
(it resumes from the newest checkpoint); SIGKILL of a learner rank (the run restores a new
learner group from its checkpoint inside the job). Both jobs must end with final weights
bit-equal to an uninterrupted job's. Slow: three toy jobs of 12 steps on 2 cores.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from tiny_runs import NO_GRIDS, ONE_OF_EACH, tiny_toy

from bench import fault_drill  # (the drill's small toy run: its settings)

ROOT = Path(__file__).parents[1]
RAY = Path(sys.executable).with_name("ray")
STEPS = 12

SETTINGS = [
    s
    for s in fault_drill.SETTINGS
    if not s.startswith(("train.steps=", "run.checkpoint_every_steps="))
] + [f"train.steps={STEPS}", "run.checkpoint_every_steps=3"]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _pids(needle: str, prefix: str = "") -> list[int]:
    """Processes whose command line holds ``needle`` (and starts with ``prefix``)."""
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            line = _cmdline(int(p.name))
            if needle in line and line.startswith(prefix):
                out.append(int(p.name))
    return out


def _steps_done(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    return sum(1 for x in path.read_text().splitlines() if x.strip())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Head:
    def __init__(self, tmp: Path) -> None:
        home = tmp / "home"
        home.mkdir()
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        env.update(HOME=str(home), RAY_BIN=str(RAY), PATH=f"{RAY.parent}:{env['PATH']}")
        env["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="rt", dir="/tmp")
        env["RAY_AUTH_MODE"] = "token"
        env["METRICS_EXPORT_PORT"] = str(_free_port())
        port, self.dash = _free_port(), _free_port()
        self.env = env
        out = subprocess.run(
            [
                "bash",
                str(ROOT / "deploy" / "start_head.sh"),
                "--num-cpus=4",
                f"--port={port}",
                f"--dashboard-port={self.dash}",
                # the job agent's HTTP port (Ray's default 52365) may still be held by another
                # head's agent: an in-process cluster of an earlier test leaves its agent up for
                # a while after ray.shutdown(), and a job submitted here then lands in that dead
                # cluster ("Job ... does not exist" on every status call after a good submit)
                f"--dashboard-agent-listen-port={_free_port()}",
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert out.returncode == 0, out.stderr[-3000:]

    def submit(self, run_dir: Path, sub_id: str) -> None:
        cmd = [
            str(RAY),
            "job",
            "submit",
            "--address",
            f"http://127.0.0.1:{self.dash}",
            "--submission-id",
            sub_id,
            "--no-wait",
            "--",
            sys.executable,
            "-m",
            "maskgrpo_ray.cli",
            "train",
            "--config",
            str(ROOT / "configs" / "toy.yaml"),
            "--backend",
            "ray",
            "--run-dir",
            str(run_dir),
        ]
        for s in SETTINGS:
            cmd += ["--set", s]
        out = subprocess.run(
            cmd, env=self.env, capture_output=True, text=True, timeout=120, cwd=ROOT
        )
        assert out.returncode == 0, out.stderr[-3000:]

    def submit_sh(self, args: list[str], sub_id: str) -> None:
        """``deploy/submit.sh`` as docs/operations.md's local-head example runs it (the checkout
        uploaded as the job's working directory), without waiting."""
        cmd = ["bash", str(ROOT / "deploy" / "submit.sh"), "--address", self.url]
        cmd += ["--submission-id", sub_id, "--no-wait", "--", *args]
        deadline = time.monotonic() + 120
        while True:  # a head just started may have no job agent (or dashboard route) up yet:
            # its refusals vary ("No available agent", a 5xx, a reset connection), so any failed
            # submit is tried again until the deadline; one that got through before failing
            # leaves the submission id taken, which is the job we asked for
            out = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=120)
            taken = out.returncode != 0 and "already exists" in out.stderr
            if out.returncode == 0 or taken or time.monotonic() > deadline:
                break
            time.sleep(2)
        assert out.returncode == 0 or taken, out.stderr[-3000:]

    def ray_job(self, *args: str) -> str:
        """``ray job ARGS --address ...``: its output."""
        cmd = [str(RAY), "job", *args, "--address", self.url]
        out = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=300)
        return out.stdout + out.stderr

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.dash}"

    def status(self, sub_id: str) -> str:
        out = subprocess.run(
            [str(RAY), "job", "status", "--address", f"http://127.0.0.1:{self.dash}", sub_id],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        text = (out.stdout + out.stderr).lower()  # "Job 'x' succeeded", "... is currently running"
        for word in ("SUCCEEDED", "FAILED", "STOPPED", "RUNNING", "PENDING"):
            if f"{sub_id}' {word.lower()}" in text or f"status: {word.lower()}" in text:
                return word
        if f"{sub_id}' was stopped" in text:  # Ray 2.60's line for a stopped job
            return "STOPPED"
        if "currently running" in text:
            return "RUNNING"
        return text[-200:]

    def wait(self, sub_id: str, timeout: float = 420) -> str:
        """The job's final status, or ``TIMEOUT`` with its last status and its log's tail
        (within the tests' 600 s, so a job that hangs says where)."""
        t0, st = time.monotonic(), ""
        while time.monotonic() - t0 < timeout:
            st = self.status(sub_id)
            if st in ("SUCCEEDED", "FAILED", "STOPPED"):
                return st
            time.sleep(2)
        return f"TIMEOUT (last status {st!r}); log: {self.ray_job('logs', sub_id)[-2000:]}"

    def stop(self) -> None:
        subprocess.run(
            [str(RAY), "stop", "--force"], env=self.env, capture_output=True, timeout=120
        )


def _weights(run_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(run_dir / "final_policy.safetensors"))


def _bit_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and bool((a[k] == b[k]).all()) for k in a
    )


def _kill_when(
    run_dir: Path, steps: int, needle: str, prefix: str = "", timeout: float = 600
) -> int:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if _steps_done(run_dir) >= steps:
            pids = _pids(needle, prefix)
            assert pids, f"no process with {needle!r}"
            os.kill(pids[0], signal.SIGKILL)
            return pids[0]
        time.sleep(0.2)
    raise AssertionError(f"{run_dir} never reached step {steps}")


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.skipif(not RAY.exists(), reason="the venv's ray executable")
def test_driver_and_learner_killed_in_ray_jobs_end_bit_equal(tmp_path):
    head = Head(tmp_path)
    try:
        clean = tmp_path / "clean"
        head.submit(clean, "clean")
        assert head.wait("clean") == "SUCCEEDED"

        # the job's driver SIGKILLed at step 5 (last checkpoint: step 3); the same command again
        driver = tmp_path / "driver"
        head.submit(driver, "driver-1")
        # the job's python process (not the shell Ray starts it with)
        _kill_when(driver, 5, f"--run-dir {driver} ", prefix=sys.executable)
        assert head.wait("driver-1") == "FAILED"
        head.submit(driver, "driver-2")
        assert head.wait("driver-2") == "SUCCEEDED"
        assert json.loads((driver / "summary.json").read_text())["completed"] is True

        # a learner rank SIGKILLed at step 7 (last checkpoint: step 6): healed inside the job
        learner = tmp_path / "learner"
        head.submit(learner, "learner")
        _kill_when(learner, 7, "ray::LearnerWorker")
        assert head.wait("learner") == "SUCCEEDED"
        rows = [json.loads(x) for x in (learner / "metrics.jsonl").read_text().splitlines() if x]
        assert [r["step"] for r in rows] == list(range(STEPS))
        assert rows[-1]["learner_restarts"] == 1.0

        base = _weights(clean)
        assert _bit_equal(base, _weights(driver)), "driver kill + resubmit"
        assert _bit_equal(base, _weights(learner)), "learner kill"
    finally:
        head.stop()


JOB_SMALL = tiny_toy(None, 3, *ONE_OF_EACH, NO_GRIDS)  # a job of a few steps that fits 2 cores


def _train_args(steps: int, *extra: str) -> list[str]:
    out = ["train", "--config", "configs/toy.yaml", *extra]
    for s in [*JOB_SMALL, f"train.steps={steps}"]:
        out += ["--set", s]
    return out


def _logged(pattern: str, text: str) -> str:
    found = re.search(pattern, text)
    assert found, f"{pattern!r} not in the job's log: {text[-3000:]}"
    return found.group(1)


@pytest.mark.slow
@pytest.mark.ci
@pytest.mark.timeout(600)
@pytest.mark.skipif(not RAY.exists(), reason="the venv's ray executable")
def test_a_jobs_run_folder_outlives_its_working_directory(tmp_path):
    """The local-head example's command (deploy/submit.sh -- train --config configs/toy.yaml,
    no --run-dir): the job runs in the working directory Ray unpacked, and its run folder goes
    to ~/maskgrpo-runs/ instead, named absolute at the run's start and end. With the head
    stopped and Ray's temporary folder (the session, the unpacked working directory) deleted,
    the summary is still there."""
    head = Head(tmp_path)
    try:
        head.submit_sh(_train_args(4), "plain")
        assert head.wait("plain") == "SUCCEEDED"
        text = head.ray_job("logs", "plain")
    finally:
        head.stop()
    job_dir = Path(_logged(r"in the Ray job's working directory (\S+) ", text))
    run_dir = Path(_logged(r"run directory: (\S+)", text))
    home = Path(head.env["HOME"])
    assert run_dir.parent == home / "maskgrpo-runs" and run_dir.name.startswith("toy-")
    assert f"starting {run_dir} from step 0" in text and f"run folder: {run_dir}" in text
    tmp_root = Path(head.env["RAY_TMPDIR"])
    assert tmp_root in job_dir.parents and "_ray_pkg_" in job_dir.name
    shutil.rmtree(tmp_root)  # Ray's session, with the job's working directory
    assert not job_dir.exists()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["completed"] is True and summary["steps"] == 4
    assert (run_dir / "final_policy.safetensors").exists()


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.skipif(not RAY.exists(), reason="the venv's ray executable")
def test_ray_job_stop_checkpoints_and_the_same_job_resumes(tmp_path):
    """`ray job stop` mid-run (SIGTERM to the job's driver, SIGKILL after
    RAY_JOB_STOP_WAIT_TIME_S, which deploy/runtime_env.yaml sets): the driver writes a
    checkpoint at most one step behind and exits by itself; the same command submitted again
    finishes the run with every step once, bit-equal to an uninterrupted job."""
    steps = 10
    head = Head(tmp_path)
    try:
        clean, run = tmp_path / "clean", tmp_path / "run"
        head.submit_sh(_train_args(steps, "--run-dir", str(clean)), "clean")
        assert head.wait("clean") == "SUCCEEDED"
        head.submit_sh(_train_args(steps, "--run-dir", str(run)), "stop-1")
        deadline = time.monotonic() + 600
        while _steps_done(run) < 2:
            assert time.monotonic() < deadline, head.ray_job("logs", "stop-1")[-3000:]
            time.sleep(0.05)
        t0 = time.monotonic()
        head.ray_job("stop", "stop-1")  # waits for the job to stop
        assert head.wait("stop-1", timeout=120) == "STOPPED"
        took = time.monotonic() - t0
        text = head.ray_job("logs", "stop-1")
        assert "SIGTERM received" in text and "stopped by SIGTERM" in text, text[-3000:]
        done = _steps_done(run)
        summary = json.loads((run / "summary.json").read_text())
        assert summary["stopped_by"] == "SIGTERM" and done - 1 <= summary["resume_step"] <= done
        head.submit_sh(_train_args(steps, "--run-dir", str(run)), "stop-2")
        assert head.wait("stop-2") == "SUCCEEDED"
    finally:
        head.stop()
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x]
    assert [r["step"] for r in rows] == list(range(steps))
    assert _bit_equal(_weights(clean), _weights(run))
    print(f"ray job stop to STOPPED: {took:.1f} s, after {done} of {steps} steps")
