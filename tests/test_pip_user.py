"""Issue 42, what a pip user tripped over besides the README's lines (``tests/test_wheel.py``
runs those): third-party warnings on every run, an API that did not say where it wrote, and a
plan that cited a file only a checkout has.

The warnings are answered at their source: a local Ray cluster gets ``RAY_AUTH_MODE=token`` set
by us (what Ray's default picks, so Ray has nothing to announce), and DeepSpeed is told the
learner's device (``DS_ACCELERATOR``) instead of probing for one; a user's own setting of either
wins. A short default run on a local Ray cluster reads its whole output for any third-party
warning.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from output_noise import third_party_warnings
from tiny_runs import RAY_SHARES, tiny_toy

import maskgrpo_ray as mg
from maskgrpo_ray.cli import app as cli
from maskgrpo_ray.cli import main
from maskgrpo_ray.weights.safe_files import deepspeed_accelerator

ROOT = Path(__file__).resolve().parents[1]


def test_deepspeed_is_told_the_device_only_inside_the_block(monkeypatch):
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    with deepspeed_accelerator("cpu"):
        assert os.environ["DS_ACCELERATOR"] == "cpu"
    assert "DS_ACCELERATOR" not in os.environ  # no child process inherits it
    monkeypatch.setenv("DS_ACCELERATOR", "cuda")  # the user's choice wins
    with deepspeed_accelerator("cpu"):
        assert os.environ["DS_ACCELERATOR"] == "cuda"
    assert os.environ["DS_ACCELERATOR"] == "cuda"


CHOOSE = (
    "import os\n"
    "from maskgrpo_ray.cluster.attach import choose_token_auth\n"
    "from ray._raylet import AuthenticationMode, get_authentication_mode\n"
    "said = choose_token_auth()\n"
    "print(said, os.environ.get('RAY_AUTH_MODE'), get_authentication_mode() == "
    "AuthenticationMode.TOKEN)\n"
)


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        (None, "on token True"),  # chosen here, and Ray's cached config reads it again
        ("disabled", "RAY_AUTH_MODE=disabled disabled False"),  # the user's choice is obeyed
    ],
)
def test_a_local_cluster_gets_token_auth_chosen_here_unless_the_user_chose(mode, expected):
    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"}
    if mode is not None:
        env["RAY_AUTH_MODE"] = mode
    out = subprocess.run(
        [sys.executable, "-c", CHOOSE], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[-2] == expected


def test_the_api_returns_the_absolute_run_folder_and_names_it_once(
    tmp_path, monkeypatch, capsys, caplog
):
    monkeypatch.setattr(cli, "run_train", lambda cfg, run_dir, *a, **k: {"completed": True})
    monkeypatch.chdir(tmp_path)
    out = mg.train("toy", {"train.steps": 3}, run_dir="runs/mine", backend="local")
    assert out["run_dir"] == str(tmp_path / "runs" / "mine")  # absolute, from a relative one
    assert capsys.readouterr().err.splitlines()[-1] == f"run directory: {out['run_dir']}"
    # with logging set to show INFO lines, the line goes to the log instead (not twice)
    with caplog.at_level(logging.INFO, logger="maskgrpo_ray.api"):
        mg.train("toy", {"train.steps": 3}, run_dir="runs/mine", backend="local")
    assert f"run directory: {out['run_dir']}" in caplog.messages
    assert "run directory" not in capsys.readouterr().err


def test_plan_cites_what_a_pip_user_has(capsys):
    assert main(["plan", "--profile", "showo_512_h100", "--gpus", "16"]) == 0
    printed = capsys.readouterr().out
    assert "bench/" not in printed and "tests/" not in printed
    assert (
        "maskgrpo_ray.planner.cost_model.SHOWO_FLOPS; python -m pydoc maskgrpo_ray.planner.cost_model"
        in printed
    )


SHORT = tiny_toy(3, 3, "rollout.num_actors=1", *RAY_SHARES, quiet=False)


@pytest.mark.slow
@pytest.mark.ci
@pytest.mark.timeout(300)
def test_a_default_train_prints_no_third_party_warning(tmp_path):
    """``maskgrpo train --config toy`` (the default: a local Ray cluster, the DeepSpeed learner
    on this CPU machine), shortened, its whole output read: no warning but our own, and our
    line says how the cluster's authentication stands."""
    unset = ("RAY_AUTH_MODE", "DS_ACCELERATOR", "RAY_ADDRESS")  # as on a user's machine
    env = {k: v for k, v in os.environ.items() if k not in unset}
    sets = [x for s in SHORT for x in ("--set", s)]
    out = subprocess.run(
        [sys.executable, "-m", "maskgrpo_ray.cli", "train", "--config", "toy"]
        + ["--run-dir", str(tmp_path / "run"), *sets],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    printed = out.stdout + out.stderr
    assert third_party_warnings(printed) == [], "\n".join(third_party_warnings(printed))
    assert "starting a local Ray cluster bound to 127.0.0.1 (token authentication: on;" in printed
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["completed"] is True and summary["backend"] == "ray"
