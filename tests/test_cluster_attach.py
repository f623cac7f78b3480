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


# --------------------------------------------------------------- RAY_ADDRESS as the job API's URL


@pytest.fixture
def local_head(monkeypatch):
    """A stand-in for the local head's address file (the module reads it through one call)."""
    from maskgrpo_ray.cluster import attach as ray_cluster

    state = {"address": "127.0.0.1:26379"}
    monkeypatch.setattr(ray_cluster, "_local_head_address", lambda: state["address"])
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    return state


def test_the_job_api_url_on_this_machine_means_the_local_heads_gcs(local_head, monkeypatch):
    from maskgrpo_ray.cluster.attach import HeadAddress, find_head

    monkeypatch.setenv("RAY_ADDRESS", "http://127.0.0.1:8265")  # what the docs give ray job submit
    head = find_head(None)
    assert head.gcs == "127.0.0.1:26379" and head.dashboard == "127.0.0.1:8265"
    assert "the local head's address file, for RAY_ADDRESS=http://127.0.0.1:8265" in head.where
    # --address wins over RAY_ADDRESS; a GCS address is taken as it is
    assert find_head("10.0.0.5:6379") == HeadAddress(
        "10.0.0.5:6379", "10.0.0.5:6379 (from --address)"
    )
    assert find_head("http://localhost:9000").dashboard == "localhost:9000"
    local_head["address"] = None
    with pytest.raises(ConnectionError, match="no head was started on this machine"):
        find_head(None)


def test_the_job_api_url_of_another_host_tries_its_default_gcs_port_and_says_so(local_head, caplog):
    from maskgrpo_ray.cluster.attach import find_head

    head = find_head("https://head.example:8443")
    assert head.gcs == "head.example:6379" and head.dashboard == "head.example:8443"
    (record,) = [r for r in caplog.records if r.levelname == "WARNING"]
    assert "joining the GCS at head.example:6379 (Ray's default port" in record.getMessage()


def test_the_joined_heads_dashboard_must_be_the_urls():
    from maskgrpo_ray.cluster.attach import _same_endpoint

    assert _same_endpoint("127.0.0.1:8265", "localhost:8265")
    assert not _same_endpoint("127.0.0.1:8265", "127.0.0.1:8266")
    assert not _same_endpoint("10.0.0.1:8265", "10.0.0.2:8265")


def test_train_joins_the_gcs_behind_a_job_api_url_in_ray_address(local_head, monkeypatch):
    # `maskgrpo train` in a shell where RAY_ADDRESS holds the job API's URL (ray job submit's
    # value): ray.init gets the GCS; a head whose dashboard is elsewhere is refused
    import types

    import ray

    from maskgrpo_ray.cluster import attach as ray_cluster

    calls = []
    dashboard = {"url": "127.0.0.1:8265"}

    def init(address=None, **kwargs):
        calls.append(address)
        return types.SimpleNamespace(dashboard_url=dashboard["url"])

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", lambda: calls.append("shutdown"))
    monkeypatch.setenv("RAY_ADDRESS", "http://127.0.0.1:8265")
    handle = ray_cluster.connect(None)
    assert calls == ["127.0.0.1:26379"] and handle.address == "127.0.0.1:26379"
    dashboard["url"] = "127.0.0.1:9999"
    with pytest.raises(ConnectionError, match="dashboard at 127.0.0.1:9999, not 127.0.0.1:8265"):
        ray_cluster.connect(None)
    assert calls[-1] == "shutdown"
