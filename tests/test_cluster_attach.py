"""``maskgrpo status`` / ``scale`` against a real loopback head started as docs/operations.md
starts one (``deploy/start_head.sh``: 127.0.0.1 only, token auth on): they find it through the
head's own address file and join it on loopback; with the head gone they end in one line within
the stated timeout."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
RAY = Path(sys.executable).with_name("ray")


def _maskgrpo(args: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "maskgrpo_ray.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


@pytest.mark.skipif(not RAY.exists(), reason="the venv's ray executable")
def test_status_joins_a_loopback_head_and_fails_fast_without_it(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS",)}
    env.update(HOME=str(home), RAY_BIN=str(RAY), PATH=f"{RAY.parent}:{env['PATH']}")
    ray_tmp = tempfile.mkdtemp(prefix="rt", dir="/tmp")  # short: unix socket paths
    env["RAY_TMPDIR"] = ray_tmp  # this head's session files and address file, not /tmp/ray's
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    started = subprocess.run(
        ["bash", str(ROOT / "deploy" / "start_head.sh"), "--num-cpus=1", f"--port={port}"],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    try:
        assert started.returncode == 0, started.stderr[-2000:]
        t0 = time.monotonic()
        out = _maskgrpo(["status", "--run", "nosuch", "--timeout", "60"], env, timeout=240)
        # it joined the head (no job of that name there): one line, exit 2, no hang
        lines = [x for x in out.stderr.splitlines() if x.startswith("maskgrpo:")]
        assert out.returncode == 2, out.stderr[-2000:]
        assert lines and "no running job named 'nosuch'" in lines[-1], out.stderr[-2000:]
        assert time.monotonic() - t0 < 240
    finally:
        subprocess.run([str(RAY), "stop", "--force"], env=env, capture_output=True, timeout=120)
    t0 = time.monotonic()
    out = _maskgrpo(["status", "--run", "nosuch", "--timeout", "5"], env, timeout=120)
    took = time.monotonic() - t0
    lines = [x for x in out.stderr.splitlines() if x.strip()]
    assert out.returncode == 2 and len(lines) == 1, out.stderr[-2000:]
    # `ray stop` removes the head's address file: nothing to try, or a refused port if one stays
    assert "no running Ray cluster found" in lines[0] or "no Ray head answers" in lines[0], lines
    assert took < 120  # the interpreter's start and imports included; no wait on the cluster
    shutil.rmtree(ray_tmp, ignore_errors=True)
