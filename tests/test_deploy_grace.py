"""The deploy files give a stopped run the time its driver needs: run.preemption_grace_seconds
to finish or abandon its step, checkpoint and exit 0, before anything SIGKILLs it. Checked
without a cluster: the RayJob's pods, the head's preStop hook (run here against a stand-in
driver), the job runtime envs (`ray job stop`'s wait), the cluster launcher's container stop
timeout and the local head's script."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

from maskgrpo_ray.config import load_config

ROOT = Path(__file__).resolve().parents[1]
RAYJOB = ROOT / "deploy" / "kuberay" / "rayjob.yaml"
SHOWO_CONFIG = ROOT / "configs" / "showo_512_clip.yaml"
MARGIN_S = 10  # the driver's shutdown after its checkpoint (a few seconds measured)


@pytest.fixture(scope="module")
def grace_s() -> float:
    """The grace period of the run the deploy files start (the RayJob's config)."""
    return load_config(SHOWO_CONFIG).run.preemption_grace_seconds


@pytest.fixture(scope="module")
def rayjob() -> dict[str, Any]:
    return yaml.safe_load(RAYJOB.read_text())


def _pods(rayjob: dict[str, Any]) -> list[dict[str, Any]]:
    spec = rayjob["spec"]["rayClusterSpec"]
    return [spec["headGroupSpec"]["template"]["spec"]] + [
        g["template"]["spec"] for g in spec["workerGroupSpecs"]
    ]


def _stop_wait(env_vars: dict[str, str]) -> float:
    return float(env_vars["RAY_JOB_STOP_WAIT_TIME_S"])


def test_ray_job_stop_waits_longer_than_the_run_needs(rayjob, grace_s):
    for name in ("runtime_env.yaml", "runtime_env_installed.yaml"):
        env = yaml.safe_load((ROOT / "deploy" / name).read_text())["env_vars"]
        assert _stop_wait(env) >= grace_s + MARGIN_S, name
    job_env = yaml.safe_load(rayjob["spec"]["runtimeEnvYAML"])["env_vars"]
    assert _stop_wait(job_env) >= grace_s + MARGIN_S
    head = _pods(rayjob)[0]["containers"][0]
    assert _stop_wait({e["name"]: e["value"] for e in head["env"]}) == _stop_wait(job_env)
    script = (ROOT / "deploy" / "start_head.sh").read_text()
    assert (
        f'RAY_JOB_STOP_WAIT_TIME_S="${{RAY_JOB_STOP_WAIT_TIME_S:-{int(_stop_wait(job_env))}}}"'
        in script
    )


def test_every_pod_outlives_the_stop_wait(rayjob, grace_s):
    """Every pod (the head with the driver, the workers with the learner ranks it checkpoints)
    gets at least `ray job stop`'s wait between its SIGTERM and SIGKILL, and a node that Ray
    drains on a SIGTERM keeps its workers for the run's grace period."""
    job_env = yaml.safe_load(rayjob["spec"]["runtimeEnvYAML"])["env_vars"]
    for pod in _pods(rayjob):
        assert pod["terminationGracePeriodSeconds"] >= _stop_wait(job_env)
        (container,) = pod["containers"]
        env = {e["name"]: e["value"] for e in container["env"]}
        assert float(env["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"]) >= grace_s + MARGIN_S


def test_the_cluster_launchers_containers_stop_slowly_enough(grace_s):
    cluster = yaml.safe_load((ROOT / "ray_cluster.yaml").read_text())
    stop = [o for o in cluster["docker"]["run_options"] if o.startswith("--stop-timeout=")]
    assert len(stop) == 1 and int(stop[0].split("=")[1]) >= grace_s + MARGIN_S
    head_start = " ".join(cluster["head_start_ray_commands"])
    assert "export RAY_JOB_STOP_WAIT_TIME_S=" in head_start


def test_the_heads_prestop_hook_signals_the_driver_and_waits_for_its_exit(rayjob, tmp_path):
    """The hook's own command, with the driver's pattern swapped for a unique one (so no run on
    this machine is signalled), against a stand-in driver that takes 2 s to exit after SIGTERM:
    the hook signals it, returns only after its exit, and does not signal itself."""
    hook = _pods(rayjob)[0]["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
    assert hook[:2] == ["/bin/sh", "-c"] and "[m]askgrpo train" in hook[2]
    marker = f"maskgrpo-stand-in-{uuid.uuid4().hex[:8]}"
    command = hook[2].replace("[m]askgrpo train", f"[{marker[0]}]{marker[1:]}")
    done = tmp_path / "done"
    driver = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"# {marker}\n"
            "import signal, sys, time\n"
            "def stop(*_):\n"
            "    time.sleep(2)\n"  # the checkpoint
            f"    open({str(done)!r}, 'w').close(); sys.exit(0)\n"
            "signal.signal(signal.SIGTERM, stop)\n"
            "print('ready', flush=True); time.sleep(120)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert driver.stdout is not None and driver.stdout.readline() == "ready\n"
    t0 = time.monotonic()
    hooked = subprocess.run(["/bin/sh", "-c", command], timeout=60)
    took = time.monotonic() - t0
    assert hooked.returncode == 0 and done.exists(), "the hook returned before the driver ended"
    assert driver.wait(timeout=10) == 0 and 2.0 <= took < 30, took
