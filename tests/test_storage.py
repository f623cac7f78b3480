"""Checkpoint storage: local folders and S3 (a real moto server), manifests, fallback, resume.

The S3 tests start ``python -m moto.server`` on a free loopback port and talk to it with the
real clients (s3fs/aiobotocore for the store, boto3 to create buckets), configured through
the standard AWS environment variables as a user would.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from tiny_runs import crash_at_step, tiny_toy

from maskgrpo_ray.checkpoints.storage import MANIFEST, CheckpointError, CheckpointStore
from maskgrpo_ray.cli import main

# ----------------------------------------------------------------------------- fixtures


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def s3_server():
    """A moto S3 server on 127.0.0.1 and the AWS_* variables that point the clients at it."""
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(f"{url}/moto-api/", timeout=2).close()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"moto server did not answer on {url} (exit code {proc.poll()})")
            time.sleep(0.1)
    env = {
        "AWS_ENDPOINT_URL": url,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    yield url
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    proc.terminate()
    proc.wait(timeout=30)


def _bucket(name: str) -> str:
    import boto3

    boto3.client("s3").create_bucket(Bucket=name)
    return name


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path) -> CheckpointStore:
    if request.param == "local":
        return CheckpointStore(str(tmp_path / "store"))
    request.getfixturevalue("s3_server")
    bucket = _bucket(f"unit-{request.node.name.split('[')[0].replace('_', '-')[:40]}")
    return CheckpointStore(f"s3://{bucket}/runs/a")


def _writer(payload: bytes):
    def write(folder: Path) -> None:
        (folder / "driver.pt").write_bytes(b"driver-" + payload)
        (folder / "learner").mkdir()
        (folder / "learner" / "weights.bin").write_bytes(payload * 1000)

    return write


def _corrupt(store: CheckpointStore, rel: str, change) -> None:
    """Rewrite one stored file of the store with ``change(bytes)``."""
    path = f"{store.root}/{rel}"
    store.fs.pipe_file(path, change(bytes(store.fs.cat_file(path))))


# ----------------------------------------------------------------------------- the store


def test_roundtrip_manifest_and_retention(store, tmp_path):
    for step, payload in ((2, b"a"), (4, b"b"), (6, b"c")):
        store.save(step, _writer(payload), keep=2)
    assert store.list() == ["step_000004", "step_000006"]  # the newest 2 kept
    assert store.latest() == "step_000006"
    got = store.fetch_valid(tmp_path / "scratch")
    assert got is not None and got.name == "step_000006"
    assert (got / "driver.pt").read_bytes() == b"driver-c"
    assert (got / "learner" / "weights.bin").read_bytes() == b"c" * 1000
    manifest = json.loads((got / MANIFEST).read_text())
    # sha256 of 1000 bytes b"c", computed independently of the store's code
    import hashlib

    want = hashlib.sha256(b"c" * 1000).hexdigest()
    assert manifest["files"]["learner/weights.bin"] == {"size": 1000, "sha256": want}
    assert sorted(manifest["files"]) == ["driver.pt", "learner/weights.bin"]


@pytest.mark.parametrize(
    ("change", "says"),
    [
        (lambda b: b[: len(b) // 2], "has 500 bytes, the manifest says 1000 (truncated?)"),
        (lambda b: b[:10] + bytes([b[10] ^ 0x01]) + b[11:], "does not match its sha256"),
    ],
    ids=["truncated", "flipped_byte"],
)
def test_corrupt_latest_falls_back_to_previous(store, tmp_path, caplog, change, says):
    store.save(2, _writer(b"a"), keep=2)
    store.save(4, _writer(b"b"), keep=2)
    _corrupt(store, "step_000004/learner/weights.bin", change)
    with caplog.at_level(logging.WARNING, logger="maskgrpo_ray.checkpoints.storage"):
        got = store.fetch_valid(tmp_path / "scratch")
    assert got is not None and got.name == "step_000002"
    assert (got / "learner" / "weights.bin").read_bytes() == b"a" * 1000
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "step_000004" in warnings[0] and "step_000002" in warnings[0]
    assert f"file learner/weights.bin {says}" in warnings[0]


def test_missing_manifest_or_file_is_detected(store, tmp_path, caplog):
    store.save(2, _writer(b"a"), keep=3)
    store.save(4, _writer(b"b"), keep=3)
    store.save(6, _writer(b"c"), keep=3)
    store.fs.rm(f"{store.root}/step_000006/{MANIFEST}")
    store.fs.rm(f"{store.root}/step_000004/driver.pt")
    with caplog.at_level(logging.WARNING, logger="maskgrpo_ray.checkpoints.storage"):
        got = store.fetch_valid(tmp_path / "scratch")
    assert got is not None and got.name == "step_000002"
    text = "\n".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert "manifest.json is missing (an incomplete write); falling back to" in text
    assert "file driver.pt is missing" in text


def test_no_valid_checkpoint_is_a_clear_error(store, tmp_path):
    store.save(2, _writer(b"a"), keep=2)
    _corrupt(store, "step_000002/driver.pt", lambda b: b + b"x")
    with pytest.raises(CheckpointError) as err:
        store.fetch_valid(tmp_path / "scratch")
    msg = str(err.value)
    assert f"no valid checkpoint at {store.location}" in msg
    assert "step_000002: file driver.pt has 9 bytes, the manifest says 8" in msg
    assert "Fix:" in msg


def test_empty_location_means_a_fresh_start(store, tmp_path):
    assert store.fetch_valid(tmp_path / "scratch") is None
    assert not store.has_checkpoints()


def test_cli_refuses_to_restart_over_corrupt_checkpoints(tmp_path, capsys, monkeypatch):
    """`maskgrpo train` into a folder whose checkpoints are all corrupt: exit 2 with the
    location and the fix, never a silent start from step 0."""
    monkeypatch.setenv("MASKGRPO_CACHE_DIR", str(tmp_path / "cache"))
    run = tmp_path / "run"
    store = CheckpointStore(str(run / "checkpoints"))
    store.save(2, _writer(b"a"), keep=2)
    _corrupt(store, "step_000002/driver.pt", lambda b: b[:3])
    assert main(["train", "--backend", "local", "--run-dir", str(run)]) == 2
    err = capsys.readouterr().err
    assert f"no valid checkpoint at {run / 'checkpoints'}" in err and "Fix:" in err


# ----------------------------------------------------------------------------- training on S3

SMALL = tiny_toy(4, 3, "run.checkpoint_every_steps=2")
COMPARED = (
    "reward_mean",
    "reward_std",
    "accuracy",
    "loss",
    "ratio_mean",
    "grad_norm",
    "groups_dropped",
    "filter_threshold",
    "policy_version",
    "learning_rate",
)


def _args(run: Path, *extra: str, backend: str = "local") -> list[str]:
    out = ["train", "--backend", backend, "--run-dir", str(run)]
    for s in [*SMALL, *extra]:
        out += ["--set", s]
    return out


def _rows(run: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


def _assert_same_steps(full: Path, resumed: Path, steps: range, rel: float) -> None:
    a, b = _rows(full), _rows(resumed)
    assert sorted(b) == list(steps)  # a fresh folder: only the steps run after the resume
    for step in steps:
        for key in COMPARED:
            assert a[step].get(key) == pytest.approx(b[step].get(key), rel=rel, abs=rel / 10), (
                step,
                key,
            )


def test_local_run_resumes_from_s3_into_a_fresh_run_dir(s3_server, tmp_path, monkeypatch, caplog):
    """Checkpoints only on S3: a run that dies after its step-2 checkpoint is continued on
    "another machine" (an empty run folder) from the bucket, to the uninterrupted metrics."""
    monkeypatch.setenv("MASKGRPO_CACHE_DIR", str(tmp_path / "cache"))
    _bucket("train-local")
    storage = "run.storage=s3://train-local/runs/toy"
    full, cut, fresh = tmp_path / "full", tmp_path / "cut", tmp_path / "fresh"
    assert main(_args(full)) == 0
    with (
        crash_at_step(monkeypatch, 3, "simulated node loss"),
        pytest.raises(KeyboardInterrupt),
    ):
        main(_args(cut, storage))
    assert not (cut / "checkpoints").exists()  # nothing local: the bucket holds them
    assert CheckpointStore("s3://train-local/runs/toy").latest() == "step_000002"
    with caplog.at_level(logging.INFO, logger="maskgrpo"):
        assert main(_args(fresh, storage)) == 0
    assert any(
        "resuming" in r.getMessage() and "step_000002" in r.getMessage() for r in caplog.records
    )
    _assert_same_steps(full, fresh, range(2, 4), rel=1e-6)
    summary = json.loads((fresh / "summary.json").read_text())
    assert summary["start_step"] == 2 and summary["completed"] is True
    assert CheckpointStore("s3://train-local/runs/toy").list() == ["step_000002", "step_000004"]


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_ray_run_resumes_from_s3_into_a_fresh_run_dir(
    s3_server, ray_cluster, tmp_path, monkeypatch
):
    """The same on the Ray backend (2 learner ranks, DeepSpeed): the ranks' checkpoint files
    travel to the driver through the object store, then to S3; the resume sends them back."""
    from test_ray_system import SMALL as RAY_SMALL

    _bucket("train-ray")
    extra = [*RAY_SMALL, "train.steps=4", "run.checkpoint_every_steps=2"]
    storage = "run.storage=s3://train-ray/runs/toy"

    def args(run: Path, *more: str) -> list[str]:
        out = ["train", "--backend", "ray", "--run-dir", str(run)]
        for s in [*extra, *more]:
            out += ["--set", s]
        return out

    full, cut, fresh = tmp_path / "full", tmp_path / "cut", tmp_path / "fresh"
    assert main(args(full)) == 0
    with (
        crash_at_step(monkeypatch, 3, "simulated node loss"),
        pytest.raises(KeyboardInterrupt),
    ):
        main(args(cut, storage))
    store = CheckpointStore("s3://train-ray/runs/toy")
    assert store.latest() == "step_000002"
    names = sorted(p.rsplit("/", 1)[-1] for p in store.fs.find(f"{store.root}/step_000002/learner"))
    assert any(n.endswith("model_states.pt") for n in names), names
    assert main(args(fresh, storage)) == 0
    _assert_same_steps(full, fresh, range(2, 4), rel=1e-5)
