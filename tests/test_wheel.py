"""The package as a pip user gets it: the README's "Installed with pip" section run line by line
(``tests/fresh_env.py`` makes the environment with its build and install lines: a stock venv, a
copy of the checkout, the wheel's declared dependency closure and nothing else importable; it
says how, and what that catches), then its commands from a folder outside the repository: the
default ``maskgrpo train`` and ``maskgrpo eval`` on a local Ray cluster, ``maskgrpo plan``, the
built-in configs, and the Python API, whose figures must lie in the ranges the README states.

Issue 34: the wheel's ``train`` and ``eval`` crashed at the end (``matplotlib`` undeclared) and
``--config toy`` found nothing. Issue 42: the README's build line failed in a stock venv, its
install line missed ``dist/``, and every run printed third-party warnings a user cannot act on
(``tests/output_noise.py``). The last test is the pip user's Ray job of docs/operations.md (no
working directory) on a local head. Slow (on 2 idle cores: the environment in about 20 s, the
README's commands in about 2 minutes (its default train about a minute), the local backend's
short run in 20 s, the job in about a minute); CI runs them.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import pytest
from fresh_env import CPU_INDEX, ROOT, FreshEnv, make_fresh_env, pip_section, run_line
from output_noise import third_party_warnings
from tiny_runs import RAY_SHARES, tiny_toy

SMALL = tiny_toy(2, 3, "rollout.num_actors=1", *RAY_SHARES)
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
    listed = zipfile.ZipFile(fresh.wheel).namelist()
    names = set(listed)
    assert len(listed) == len(names), sorted(n for n in names if listed.count(n) > 1)
    # the folders themselves, not the checkout's stand-ins maskgrpo_ray/{actors,...}/__init__.py
    for folder in ("actors", "learner", "configs"):
        shipped_init = zipfile.ZipFile(fresh.wheel).read(f"maskgrpo_ray/{folder}/__init__.py")
        assert shipped_init == (ROOT / folder / "__init__.py").read_bytes(), folder
    expected = {
        f"maskgrpo_ray/{p.relative_to(ROOT / folder).as_posix()}"
        if folder == "maskgrpo_ray"
        else f"maskgrpo_ray/{folder}/{p.relative_to(ROOT / folder).as_posix()}"
        for folder in ("maskgrpo_ray", "actors", "learner")
        for p in (ROOT / folder).rglob("*.py")
    }
    expected |= {f"maskgrpo_ray/configs/{p.name}" for p in (ROOT / "configs").glob("*.yaml")}
    shipped = ROOT / "maskgrpo_ray" / "worlds" / "pretrained"  # the worlds' pre-trained weights
    expected |= {f"maskgrpo_ray/worlds/pretrained/{p.name}" for p in shipped.glob("*.safetensors")}
    expected.add("maskgrpo_ray/worlds/pretrained/manifest.json")
    assert len(expected) > 100 and expected <= names, sorted(expected - names)
    assert "maskgrpo_ray/py.typed" in names
    assert not [n for n in names if n.split("/")[0] in ("actors", "learner", "tests", "configs")]
    (entry,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    assert "maskgrpo = maskgrpo_ray.cli:main" in zipfile.ZipFile(fresh.wheel).read(entry).decode()
    assert "matplotlib" in fresh.closure and "torch" in fresh.closure


def _installed(printed: str) -> set[str]:
    """The distributions pip's "Successfully installed a-1.0 b-2.0" line names (names only)."""
    line = next((x for x in printed.splitlines() if x.startswith("Successfully installed")), "")
    return {d.rsplit("-", 1)[0].lower() for d in line.split()[2:]}


@pytest.mark.slow
@pytest.mark.ci
@pytest.mark.timeout(300)
def test_the_readmes_build_and_install_lines_work_as_written(fresh):
    """The fixture ran them (a stock venv, a copy of the checkout; the build left nothing there
    but dist/): the install lines installed the wheel and nothing else, torch's CPU line names
    the versions requirements.txt tests and brought no torch (the closure's satisfied it)."""
    build, install = pip_section()[1][:2]
    assert [line for line, _ in fresh.ran][: len(build)] == build
    assert fresh.wheel.parent == fresh.checkout / "dist"
    torch_line, wheel_line = install
    assert CPU_INDEX in torch_line
    pins = dict(x.split("==") for x in (ROOT / "requirements.txt").read_text().split() if "==" in x)
    assert f"torch=={pins['torch']} torchvision=={pins['torchvision']}" in torch_line
    printed = dict(fresh.ran)
    assert _installed(printed[torch_line.replace(CPU_INDEX, "")]) <= {"setuptools"}
    assert wheel_line == f"pip install dist/{fresh.wheel.name}"
    assert _installed(printed[wheel_line]) == {"maskgrpo-ray"}, printed[wheel_line][-2000:]


@pytest.mark.slow
@pytest.mark.ci
@pytest.mark.timeout(300)
def test_an_extra_goes_on_the_wheels_path_not_the_packages_name(fresh, tmp_path):
    """The README's two forms, resolved by pip with no index and no find-links (``--dry-run
    --no-index``, the machine's pip config left out): before the wheel is installed (an empty
    venv), ``maskgrpo-ray[trackers]`` asks for a package of that name; in the README's
    environment, the wheel's path with ``[trackers]`` asks for the extra's packages, and so does
    the name form once the wheel is installed."""
    section = pip_section()[0]
    good = re.search(r"pip install '(dist/maskgrpo_ray-[^']+\.whl\[trackers\])'", section)
    assert good and "`'maskgrpo-ray[trackers]'`" in section
    env = {k: v for k, v in fresh.env(tmp_path).items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull

    def dry_run(python: Path, requirement: str) -> str:
        out = subprocess.run(
            [sys.executable, "-m", "pip", "--python", str(python), "install", "--dry-run"]
            + ["--no-index", requirement],
            cwd=fresh.checkout,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode != 0, out.stdout[-1000:]  # no index: something is missing
        return out.stderr

    empty = tmp_path / "empty"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(empty)], check=True)
    by_name = dry_run(empty / "bin" / "python", "maskgrpo-ray[trackers]")
    assert "the requirement maskgrpo-ray[trackers] (from versions: none)" in by_name, by_name
    for requirement in (good.group(1), "maskgrpo-ray[trackers]"):
        wants = dry_run(fresh.bin / "python", requirement)
        assert "requirement tensorboard>=2.21" in wants, wants  # the extra's first package
        assert "(from maskgrpo-ray[trackers])" in wants, wants


@pytest.mark.slow
@pytest.mark.ci
@pytest.mark.timeout(600)
def test_the_readmes_commands_run_line_by_line_from_outside_the_repository(fresh, tmp_path):
    """The README's "then anywhere" lines, each as written, in a folder outside the repository
    (``runs/toy-<time>`` is the folder the train line named): the default train and eval on a
    local Ray cluster, the plan, and the API's 20 steps, whose figures lie in the ranges the
    README states for them. No command prints a third-party warning (issue 42)."""
    section, (_, _, commands) = pip_section()
    section = " ".join(section.split())
    work, home = tmp_path / "work", tmp_path / "home"
    work.mkdir()
    env = fresh.env(home)
    env["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="rt", dir="/tmp")  # short: unix socket paths
    printed: dict[str, str] = {}  # the line as written -> what it printed
    run_dir = None
    for line in commands:
        t0 = time.monotonic()
        out = run_line(line.replace("runs/toy-<time>", str(run_dir)), work, env)
        TIMES[f"README: {line[:60]}"] = time.monotonic() - t0
        noise = third_party_warnings(out)
        assert noise == [], f"{line}: third-party warnings\n" + "\n".join(noise)
        printed[line] = out
        if line.startswith("maskgrpo train"):
            run_dir = _run_directory(out, work)

    def of(start: str) -> str:
        (out,) = [v for k, v in printed.items() if k.startswith(start)]
        return out

    assert run_dir is not None and run_dir.is_relative_to(work), run_dir
    train = json.loads((run_dir / "summary.json").read_text())
    assert train["completed"] is True and train["backend"] == "ray"
    assert "toy" in of("maskgrpo configs list") and (work / "showo_512_clip.yaml").is_file()
    assert "report: " in of("maskgrpo eval") and "recommended: " in of("maskgrpo plan")
    api = of("python -c")
    api_dir = _run_directory(api, work)
    assert api_dir.is_absolute() and api_dir.parent == work / "runs", api_dir
    figures = re.search(r"^(\d\.\d+) (\d\.\d+)$", api, flags=re.M)  # print(base, final)
    assert figures, api[-2000:]
    base, final = map(float, figures.groups())
    summary = json.loads((api_dir / "summary.json").read_text())
    assert (base, final) == (summary["base_accuracy"], summary["final_accuracy"])
    b_lo, b_hi = map(float, re.search(r"base model scores (\S+)-(\S+) and", section).groups())
    f_lo, f_hi = map(float, re.search(r"tuned one between (\S+) and (\S+) \(", section).groups())
    assert b_lo <= base <= b_hi and f_lo <= final <= f_hi, (base, final)
    print("\n" + "\n".join(f"{v:7.1f} s  {k}" for k, v in TIMES.items()))


def _run_directory(printed: str, work: Path) -> Path:
    """The folder a train line named ("run directory: X"; relative to ``work`` if relative)."""
    named = [x.split(": ", 1)[1] for x in printed.splitlines() if x.startswith("run directory: ")]
    assert named, printed[-2000:]
    return work / named[-1]


@pytest.mark.slow
@pytest.mark.ci
@pytest.mark.timeout(900)
def test_the_local_backend_runs_from_outside_the_repository_and_no_extra_leaks(fresh, tmp_path):
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
    sets = [x for s in SMALL for x in ("--set", s)]
    out = _run(
        fresh,
        ["maskgrpo", "train", "--config", "toy", "--backend", "local", "--run-dir", "local"] + sets,
        work,
        "train --config toy --backend local",
    )
    # the folder is named absolute (resolved against the working directory of the command)
    assert out.splitlines()[-1] == f"run directory: {(work / 'local').resolve()}", out[-500:]
    summary = json.loads((work / "local" / "summary.json").read_text())
    assert summary["completed"] is True and summary["backend"] == "local"
    assert (work / "local" / "reward_curve.png").is_file()  # matplotlib, at the very end
    assert not (ROOT / "local").exists()
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
