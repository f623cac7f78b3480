"""The package as a pip user gets it: the wheel built from this tree, installed with
``pip install --no-deps`` into a fresh virtual environment where only the wheel's declared
dependency closure is importable (``tests/fresh_env.py`` says how, and what that catches), and
the default ``maskgrpo train`` (local and Ray), ``maskgrpo eval`` and ``maskgrpo plan`` run from
a folder outside the repository with the built-in config (``--config toy``).

Issue 34: the wheel's ``train`` and ``eval`` crashed at the end (``matplotlib`` undeclared) and
``--config toy`` found nothing. The last test is the pip user's Ray job of docs/operations.md
(no working directory) on a local head. Slow (about three minutes on 2 cores: the environment in
under 10 s, four commands in about 100 s, the job in about a minute); CI runs them.
"""

from __future__ import annotations

import json
import socket
import subprocess
import tempfile
import time
import zipfile
from pathlib import Path

import pytest
from fresh_env import ROOT, FreshEnv, make_fresh_env

SMALL = [
    "model.toy.pretrain_steps=20",
    "train.steps=2",
    "train.prompts_per_step=3",
    "rollout.unmasking_steps=4",
    "eval.samples_per_prompt=1",
    "filter.warmup_groups=2",
    "logging.progress_bar=false",
    "rollout.num_actors=1",
    "rollout.num_cpus_per_actor=0.25",
    "reward.num_cpus_per_actor=0.25",
    "learner.num_cpus_per_worker=0.25",
]
OPTIONAL = ("pyarrow", "torch_fidelity", "tensorboard", "wandb", "mlflow", "s3fs", "ImageReward")
TIMES: dict[str, float] = {}


@pytest.fixture(scope="module")
def fresh(tmp_path_factory) -> FreshEnv:
    t0 = time.monotonic()
    env = make_fresh_env(tmp_path_factory.mktemp("fresh"))
    TIMES["environment (wheel, closure links, venv, pip install)"] = time.monotonic() - t0
    return env


def _run(fresh: FreshEnv, args: list[str], cwd: Path, label: str, timeout: float = 400) -> str:
    env = fresh.env(cwd.parent / "home")
    env["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="rt", dir="/tmp")  # short: unix socket paths
    t0 = time.monotonic()
    out = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    TIMES[label] = time.monotonic() - t0
    assert out.returncode == 0, f"{label}: {out.stderr[-3000:]}"
    return out.stdout


@pytest.mark.slow
@pytest.mark.ci
@pytest.mark.timeout(300)
def test_the_wheel_holds_the_package_its_rooms_and_the_built_in_configs(fresh):
    names = set(zipfile.ZipFile(fresh.wheel).namelist())
    expected = {
        f"maskgrpo_ray/{p.relative_to(ROOT / folder).as_posix()}"
        if folder == "maskgrpo_ray"
        else f"maskgrpo_ray/{folder}/{p.relative_to(ROOT / folder).as_posix()}"
        for folder in ("maskgrpo_ray", "actors", "learner")
        for p in (ROOT / folder).rglob("*.py")
    }
    expected |= {f"maskgrpo_ray/configs/{p.name}" for p in (ROOT / "configs").glob("*.yaml")}
    assert len(expected) > 100 and expected <= names, sorted(expected - names)
    assert "maskgrpo_ray/py.typed" in names
    assert not [n for n in names if n.split("/")[0] in ("actors", "learner", "tests", "configs")]
    (entry,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    assert "maskgrpo = maskgrpo_ray.cli:main" in zipfile.ZipFile(fresh.wheel).read(entry).decode()
    assert "matplotlib" in fresh.closure and "torch" in fresh.closure


@pytest.mark.slow
@pytest.mark.ci
@pytest.mark.timeout(900)
def test_default_train_eval_and_plan_run_from_outside_the_repository(fresh, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    py = str(fresh.bin / "python")
    probe = (
        "import importlib.util as u, maskgrpo_ray\n"
        f"print(maskgrpo_ray.__file__, [m for m in {OPTIONAL!r} if u.find_spec(m)])\n"
    )
    where, found = _run(fresh, [py, "-c", probe], work, "probe").split(" ", 1)
    assert Path(where).is_relative_to(fresh.root), where  # the installed package, not the repo
    assert found.strip() == "[]"  # no extra's package leaks into the environment
    assert "toy" in _run(fresh, ["maskgrpo", "configs", "list"], work, "configs list")
    sets = [x for s in SMALL for x in ("--set", s)]
    for backend in ("local", "ray"):
        out = _run(
            fresh,
            ["maskgrpo", "train", "--config", "toy", "--backend", backend, "--run-dir", backend]
            + sets,
            work,
            f"train --config toy --backend {backend}",
        )
        assert out.splitlines()[-1] == f"run directory: {backend}", out[-500:]
        summary = json.loads((work / backend / "summary.json").read_text())
        assert summary["completed"] is True and summary["backend"] == backend
        assert (work / backend / "reward_curve.png").is_file()  # matplotlib, at the very end
    out = _run(
        fresh,
        ["maskgrpo", "eval", "--weights", "base", "--weights", "ray", "--out", "ev"],
        work,
        "eval --weights base --weights ray (Ray backend)",
    )
    assert out.splitlines()[-1] == "report: ev/report.md"
    means = json.loads((work / "ev" / "summary.json").read_text())
    assert set(means) == {"base", "tuned"} and "accuracy" in means["tuned"]
    out = _run(
        fresh, ["maskgrpo", "plan", "--profile", "showo_512_h100", "--gpus", "16"], work, "plan"
    )
    assert out.splitlines()[-1].startswith("recommended: 4 rollout + 12 learner GPUs")
    assert not (ROOT / "ev").exists() and not (ROOT / "local").exists()
    print("\n" + "\n".join(f"{v:7.1f} s  {k}" for k, v in TIMES.items()))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _steps_done(run_dir: Path) -> int:
    rows = run_dir / "metrics.jsonl"
    return len(rows.read_text().splitlines()) if rows.exists() else 0


@pytest.mark.slow
@pytest.mark.ci
@pytest.mark.timeout(900)
def test_a_pip_users_job_on_a_local_head_needs_no_working_dir(fresh, tmp_path):
    """The pip user's job path of docs/operations.md on a real local head: the head started by
    ``deploy/start_head.sh`` (127.0.0.1 only, token auth) from the fresh environment (its
    ``ray``; every worker runs its python), the job submitted by ``deploy/submit.sh --installed``
    (no working directory) as ``maskgrpo train --config toy``, which runs the installed package
    and its built-in config; while it runs, ``maskgrpo status`` finds it with ``RAY_ADDRESS`` set
    to the job API's URL."""
    work, home = tmp_path / "work", tmp_path / "home"
    work.mkdir()
    home.mkdir()
    env = fresh.env(home)
    env.update(RAY_BIN=str(fresh.bin / "ray"), RAY_AUTH_MODE="token")
    env["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="rt", dir="/tmp")
    env["METRICS_EXPORT_PORT"] = str(_free_port())
    dash = _free_port()
    t0 = time.monotonic()
    started = subprocess.run(
        ["bash", str(ROOT / "deploy" / "start_head.sh"), "--num-cpus=4"]
        + [f"--port={_free_port()}", f"--dashboard-port={dash}"]
        # the job agent's HTTP port (default 52365) may be another head's on a shared machine
        + [f"--dashboard-agent-listen-port={_free_port()}"],
        cwd=work,  # a job without a working dir starts where the head did: not in the repo
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    TIMES["job: start the head"] = time.monotonic() - t0
    try:
        assert started.returncode == 0, started.stderr[-3000:]
        run_dir = work / "jobrun"
        sets = [x for s in [*SMALL, "train.steps=16"] for x in ("--set", s)]
        submit = ["bash", str(ROOT / "deploy" / "submit.sh"), "--installed", "--no-wait"]
        submit += ["--address", f"http://127.0.0.1:{dash}", "--submission-id", "pip-user"]
        submit += ["--", "train", "--config", "toy", "--run-dir", str(run_dir), *sets]
        t0 = time.monotonic()
        while True:  # the head's job agent starts a few seconds after `ray start` returns
            out = subprocess.run(submit, cwd=work, env=env, capture_output=True, text=True)
            if "No available agent" not in out.stderr or time.monotonic() - t0 > 120:
                break
            time.sleep(3)
        assert out.returncode == 0, out.stderr[-3000:]
        while _steps_done(run_dir) < 2 and time.monotonic() - t0 < 300:
            time.sleep(1)  # two rows: the first step's status has reached the control actor
        assert _steps_done(run_dir) >= 2, _job(fresh, env, dash, "logs")[-3000:]
        status_env = {**env, "RAY_ADDRESS": f"http://127.0.0.1:{dash}"}  # the job API's URL
        status = subprocess.run(
            ["maskgrpo", "status", "--run", "toy", "--timeout", "60"],
            cwd=work,
            env=status_env,
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert status.returncode == 0, status.stderr[-3000:]
        figures = json.loads(status.stdout)
        assert figures["step"] >= 0 and len(figures["rollout_actors"]) == 1, figures
        print(f"\nmaskgrpo status (RAY_ADDRESS={status_env['RAY_ADDRESS']}): {figures}")
        while time.monotonic() - t0 < 600 and "SUCCEEDED" not in _job(fresh, env, dash, "status"):
            assert "FAILED" not in _job(fresh, env, dash, "status")
            time.sleep(2)
        TIMES["job: submit to SUCCEEDED (16 toy steps, Ray)"] = time.monotonic() - t0
        logs = _job(fresh, env, dash, "logs")
        built_in = f"{fresh.root}/lib/python3.11/site-packages/maskgrpo_ray/configs/toy.yaml"
        assert f"--config toy: the built-in config {built_in}" in logs, logs[-3000:]
        print("job log: " + next(x for x in logs.splitlines() if "the built-in config" in x))
        print("job log: " + logs.strip().splitlines()[-1])
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["completed"] is True and summary["steps"] == 16
    finally:
        subprocess.run([str(fresh.bin / "ray"), "stop", "--force"], env=env, capture_output=True)
    print("\n" + "\n".join(f"{v:7.1f} s  {k}" for k, v in TIMES.items() if k.startswith("job")))


def _job(fresh: FreshEnv, env: dict[str, str], dash: int, what: str) -> str:
    out = subprocess.run(
        [str(fresh.bin / "ray"), "job", what, "--address", f"http://127.0.0.1:{dash}", "pip-user"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return (out.stdout + out.stderr).upper() if what == "status" else out.stdout + out.stderr
