"""A checkout is a working package (issue 55): ``actors/``, ``learner/`` and ``configs/`` are
top-level folders that an install maps to ``maskgrpo_ray.actors``, ``maskgrpo_ray.learner`` and
``maskgrpo_ray.configs`` (pyproject's ``package-dir``); a checkout on the path reaches them
through ``maskgrpo_ray/{actors,learner,configs}/__init__.py``, whose ``__path__`` is the folder.

The first tests copy the checkout's package folders into an empty folder and import them with
``PYTHONPATH`` alone: once with no site-packages at all (``python -S``: nothing installed can
help), once with the test environment's (the import must still come from the copy, not from an
installed or editable package). The slow one is the Ray user's way to ship code: a local head
and ``deploy/submit.sh`` (``ray job submit --working-dir .``) from a copy of the checkout; the
job's driver and its Ray workers import the uploaded folder, and a short toy run completes.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("maskgrpo_ray", "actors", "learner", "configs")


def _copy_checkout(dest: Path, folders: tuple[str, ...] = FOLDERS) -> Path:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in folders:
        shutil.copytree(ROOT / name, dest / name, ignore=ignore)
    return dest


def _bare_env(copy: Path) -> dict[str, str]:
    """PATH and PYTHONPATH only: no user site, no variable of this session."""
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(copy)}


def test_a_bare_checkout_imports_actors_learner_and_configs_through_pythonpath_alone(tmp_path):
    copy = _copy_checkout(tmp_path / "clone")
    code = (
        "import maskgrpo_ray.actors as a, maskgrpo_ray.learner as l, maskgrpo_ray.configs as c\n"
        "print(a.__path__[0], l.__path__[0], c.__path__[0])\n"
        "print(a.__doc__.splitlines()[0])\n"
    )
    # -S: no site-packages, so neither an installed nor an editable maskgrpo_ray can answer
    out = subprocess.run(
        [sys.executable, "-S", "-c", code],
        cwd=tmp_path,
        env=_bare_env(copy),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    paths, doc = out.stdout.splitlines()
    assert paths.split() == [str(copy / n) for n in ("actors", "learner", "configs")]
    assert doc == (ROOT / "actors" / "__init__.py").read_text().strip().strip('"')


def test_the_checkouts_folders_win_over_an_installed_package(tmp_path):
    """With this environment's site-packages (an editable install maps the same names to this
    worktree): modules, built-in configs and the package doc still come from the copy."""
    copy = _copy_checkout(tmp_path / "clone")
    code = (
        "import maskgrpo_ray.actors.pool as p, maskgrpo_ray.learner.group as g\n"
        "from maskgrpo_ray.config import builtin\n"
        "print(p.__file__, g.__file__, builtin.path_of('toy'))\n"
    )
    env = {**_bare_env(copy), "HOME": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == [
        str(copy / "actors" / "pool.py"),
        str(copy / "learner" / "group.py"),
        str(copy / "configs" / "toy.yaml"),
    ]


def test_a_checkout_missing_a_folder_says_which_in_one_line(tmp_path):
    copy = _copy_checkout(tmp_path / "clone", ("maskgrpo_ray", "learner", "configs"))
    out = subprocess.run(
        [sys.executable, "-S", "-c", "import maskgrpo_ray.actors"],
        cwd=tmp_path,
        env=_bare_env(copy),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: maskgrpo_ray.actors: ") and "actors/ folder" in last


# ----------------------------------------------------------------------------- ray job


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# What the job's driver and one of its Ray workers import: both must be the uploaded copy
# (Ray unpacks the working dir once per node and starts the job's processes in it).
WHERE = (
    "import os, ray\n"
    "import maskgrpo_ray.actors.pool as p\n"
    "ray.init()\n"
    "@ray.remote(num_cpus=0.1)\n"
    "def where():\n"
    "    import maskgrpo_ray.actors.pool as q, maskgrpo_ray.learner.group as g\n"
    "    return os.getcwd(), q.__file__, g.__file__\n"
    "print('WHERE', os.getcwd(), p.__file__, *ray.get(where.remote()))\n"
)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ray_job_submit_with_the_checkout_as_working_dir(tmp_path):
    """A local head (``deploy/start_head.sh``: 127.0.0.1, token auth), a copy of the checkout
    as a user's clone, and the job path of docs/operations.md from it: ``deploy/submit.sh``
    (``ray job submit --working-dir . --runtime-env deploy/runtime_env.yaml``) running
    ``maskgrpo train --config configs/toy.yaml`` with the shipped toy weights, 2 steps."""
    ray_bin = _commands(tmp_path / "bin")
    clone = tmp_path / "clone"
    _copy_checkout(clone, (*FOLDERS, "deploy"))
    shutil.copy(ROOT / "pyproject.toml", clone / "pyproject.toml")
    home = tmp_path / "home"
    home.mkdir()
    dash = _free_port()
    env = {
        **os.environ,
        "HOME": str(home),
        "RAY_BIN": str(ray_bin),
        "RAY_AUTH_MODE": "token",
        "RAY_TMPDIR": tempfile.mkdtemp(prefix="rt", dir="/tmp"),  # short: unix socket paths
        "METRICS_EXPORT_PORT": str(_free_port()),
        "PATH": f"{ray_bin.parent}:{os.environ.get('PATH', '/usr/bin:/bin')}",
        "MASKGRPO_CACHE_DIR": str(tmp_path / "cache"),
    }
    env.pop("PYTHONPATH", None)
    env.pop("RAY_ADDRESS", None)
    address = f"http://127.0.0.1:{dash}"
    head_cmd = ["bash", str(ROOT / "deploy" / "start_head.sh"), "--num-cpus=4", "--block"]
    head_cmd += [f"--port={_free_port()}", f"--dashboard-port={dash}"]
    head_cmd += [f"--dashboard-agent-listen-port={_free_port()}"]
    # --block: the head lives as long as this process group, which the test ends by its id
    head = subprocess.Popen(
        head_cmd,
        cwd=home,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        where = [str(ray_bin), "job", "submit", "--address", address, "--working-dir", "."]
        where += ["--", "python", "-c", WHERE]
        out = _submit_when_ready(where, clone, env)
        line = next((x for x in out.stdout.splitlines() if x.startswith("WHERE ")), "")
        assert line, out.stdout[-3000:] + out.stderr[-3000:]
        cwd, driver_pool, worker_cwd, worker_pool, worker_group = line.split()[1:]
        assert cwd == worker_cwd and not cwd.startswith(str(clone))  # Ray's unpacked upload
        assert driver_pool == worker_pool == f"{cwd}/actors/pool.py"
        assert worker_group == f"{cwd}/learner/group.py"

        run_dir = tmp_path / "run"
        small = [
            "train.steps=2",
            "train.prompts_per_step=3",
            "rollout.unmasking_steps=4",
            "rollout.num_actors=1",
            "eval.samples_per_prompt=1",
            "filter.warmup_groups=2",
            "logging.progress_bar=false",
            "rollout.num_cpus_per_actor=0.25",
            "reward.num_cpus_per_actor=0.25",
            "learner.num_cpus_per_worker=0.25",
        ]
        submit = ["bash", "deploy/submit.sh", "--address", address, "--"]
        submit += ["train", "--config", "configs/toy.yaml", "--run-dir", str(run_dir)]
        submit += [x for s in small for x in ("--set", s)]
        out = _submit_when_ready(submit, clone, env)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["completed"] is True and summary["steps"] == 2
    finally:
        _end_group(head)
        shutil.rmtree(env["RAY_TMPDIR"], ignore_errors=True)


def _commands(folder: Path) -> Path:
    """``ray``, ``maskgrpo`` and ``python`` run by this test's interpreter (a console script's
    shebang may name another environment's), first on the head's PATH. Returns ``ray``."""
    folder.mkdir()
    mains = {"ray": "-m ray.scripts.scripts", "maskgrpo": "-m maskgrpo_ray.cli", "python": ""}
    for name, args in mains.items():
        (folder / name).write_text(f'#!/bin/sh\nexec "{sys.executable}" {args} "$@"\n')
        (folder / name).chmod(0o755)
    return folder / "ray"


def _end_group(head: subprocess.Popen) -> None:
    """The head's processes, by their group id (``ray stop`` would stop every Ray head of this
    user on the machine): SIGTERM, then SIGKILL for what outlives it (gcs_server does)."""
    for sig, grace in ((signal.SIGTERM, 10), (signal.SIGKILL, 0)):
        try:
            os.killpg(head.pid, sig)
        except ProcessLookupError:
            return
        time.sleep(grace)
    head.wait(timeout=30)


def _submit_when_ready(cmd: list[str], cwd: Path, env: dict[str, str]):
    """Run ``cmd`` (a job submission that waits for the job); the head's job agent starts a few
    seconds after the head, so "No available agent" is retried for up to two minutes."""
    t0 = time.monotonic()
    while True:
        out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=480)
        waiting = "No available agent" in out.stderr or "Connection refused" in out.stderr
        if not waiting or time.monotonic() - t0 > 120:
            return out
        time.sleep(3)
