"""Experiment trackers (``logging.trackers``) log what the run folder holds, read back with each
library's own reader: TensorBoard's ``EventAccumulator``, W&B's offline ``.wandb`` records (its
``wandb.proto`` messages), MLflow's ``MlflowClient`` over a local file store. Offline, no login.

One toy run (local backend) with all three, interrupted after its first checkpoint and resumed,
serves the read-back tests: every tracker must hold the final ``metrics.jsonl`` values, and the
resumed half must land in the same tracker run.
"""

from __future__ import annotations

import ast
import glob
import json
import logging
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_runs import crash_at_step, tiny_toy

from maskgrpo_ray.cli import main
from maskgrpo_ray.runlog.trackers import TensorBoardTracker, flatten, numbers

PKG = Path(__file__).resolve().parents[1] / "maskgrpo_ray"
SMALL = tiny_toy(4, 3, "run.checkpoint_every_steps=2", "logging.sample_grid_every_steps=2")
ALL = "logging.trackers=[tensorboard, wandb, mlflow]"


def _args(run: Path, *extra: str) -> list[str]:
    out = ["train", "--backend", "local", "--run-dir", str(run)]
    for s in (*SMALL, *extra):
        out += ["--set", s]
    return out


def _rows(run: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """A run with all three trackers that crashes in step 3 (checkpoint at step 2: rows 0-2
    logged) and is resumed (steps 2 and 3 again). Returns the run folder."""
    tmp = tmp_path_factory.mktemp("trackers")
    run = tmp / "run"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MASKGRPO_CACHE_DIR", str(tmp / "cache"))
        mp.setenv("WANDB_MODE", "offline")
        mp.setenv("WANDB_DIR", str(tmp / "wandb"))
        mp.setenv("WANDB_SILENT", "true")
        mp.delenv("WANDB_API_KEY", raising=False)
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        with crash_at_step(mp, 3, "simulated crash"), pytest.raises(KeyboardInterrupt):
            main(_args(run, ALL))
        assert sorted(_rows(run)) == [0, 1, 2]
        assert main(["train", "--resume", str(run)]) == 0
    assert sorted(_rows(run)) == [0, 1, 2, 3]
    assert "tracker_failures" not in json.loads((run / "summary.json").read_text())
    return run


def _expected(run: Path) -> dict[int, dict[str, float]]:
    """metrics.jsonl's numeric figures per step: what every tracker must hold."""
    out = {step: numbers(row) for step, row in _rows(run).items()}
    assert all(len(m) > 10 for m in out.values())
    return out


def _grid_steps(run: Path) -> list[int]:
    steps = sorted(int(p.stem.split("_")[1]) for p in (run / "samples").glob("step_*.png"))
    assert steps == [0, 2, 3]  # every 2 steps and the last
    return steps


def test_tensorboard_events_hold_the_steps_images_and_config(resumed):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(resumed / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    tags = acc.Tags()
    expected = _expected(resumed)
    for key in expected[0]:
        events = acc.Scalars(key)
        # purge_step on resume: the crashed run's step 2 is dropped, the re-done one stays
        assert [e.step for e in events] == sorted(s for s in expected if key in expected[s]), key
        for e in events:
            assert e.value == pytest.approx(expected[e.step][key], rel=1e-6, abs=1e-6), key
    assert [e.step for e in acc.Images("samples")] == _grid_steps(resumed)
    assert acc.Images("samples")[0].width > 50
    # the per-tag grids, base and tuned, under their own tag: the base at 0, the tuned at the end
    assert [e.step for e in acc.Images("eval_tags")] == [0, 3]
    text = b"".join(acc.Tensors("config/text_summary")[-1].tensor_proto.string_val).decode()
    assert "train.steps = 4" in text and "model.kind = toy" in text
    assert "hparams" in acc.PluginTagToContent("hparams") or acc.summary_metadata
    assert any("summary/final_reward" in t for t in tags["scalars"])


def _wandb_records(path: str):
    """The records of a ``.wandb`` file: wandb's LevelDB-style log (7-byte file header, 32 KiB
    blocks, chunks with a crc32/length/type header) of ``wandb.proto`` ``Record`` messages."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B"
    block, pos, buf = 32768, 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # too small for a chunk header: padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:
            break
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        buf = chunk if kind in (1, 2) else buf + chunk  # FULL, FIRST | MIDDLE, LAST
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(buf)
            yield rec


def test_wandb_offline_run_holds_steps_config_and_summary_and_the_resume_continues_it(resumed):
    files = sorted(glob.glob(str(resumed.parent / "wandb" / "wandb" / "offline-run-*" / "*.wandb")))
    assert len(files) == 2  # the crashed start and the resume
    ids = {Path(f).stem for f in files}
    stored = json.loads((resumed / "trackers.json").read_text())["wandb"]
    assert ids == {f"run-{stored}"}  # the same W&B run id: `wandb sync` merges them
    history: dict[int, dict[str, float]] = {}
    config: dict[str, object] = {}
    summary: dict[str, object] = {}
    images = []
    for f in files:
        for rec in _wandb_records(f):
            kind = rec.WhichOneof("record_type")
            if kind == "history":
                item = {
                    ".".join(i.nested_key) or i.key: json.loads(i.value_json)
                    for i in rec.history.item
                }
                history.setdefault(item["_step"], {}).update(item)  # the later write wins
            elif kind == "run":
                config.update({u.key: json.loads(u.value_json) for u in rec.run.config.update})
            elif kind == "config":
                config.update({u.key: json.loads(u.value_json) for u in rec.config.update})
            elif kind == "summary":
                summary.update({u.key: json.loads(u.value_json) for u in rec.summary.update})
    expected = _expected(resumed)
    assert sorted(history) == sorted(expected)
    for step, figures in expected.items():
        for key, value in figures.items():
            assert history[step][key] == pytest.approx(value, rel=1e-9, abs=1e-12), (step, key)
        if "samples._type" in history[step]:  # wandb.Image's record, flattened
            images.append(step)
            assert history[step]["samples._type"] == "image-file"
            media = history[step]["samples.path"]  # under the run folder's files/
            assert any((Path(f).parent / "files" / media).is_file() for f in files), media
    assert images == _grid_steps(resumed)
    assert config["train.steps"] == 4 and config["model.kind"] == "toy"
    final = json.loads((resumed / "summary.json").read_text())
    assert summary["summary/final_reward"] == pytest.approx(final["final_reward"])
    assert summary["summary/start_step"] == 2  # the resumed part's summary


def test_mlflow_run_holds_metric_history_params_images_and_summary(resumed):
    from mlflow.tracking import MlflowClient

    stored = json.loads((resumed / "trackers.json").read_text())["mlflow"]
    client = MlflowClient(tracking_uri=(resumed / "mlruns").resolve().as_uri())
    exp = client.get_experiment_by_name("maskgrpo")
    runs = client.search_runs([exp.experiment_id])
    assert [r.info.run_id for r in runs] == [stored]  # the resume continued the one run
    run = runs[0]
    assert run.info.status == "FINISHED"
    expected = _expected(resumed)
    for key in expected[0]:
        latest: dict[int, tuple[int, float]] = {}
        # the file store's name for it ("/" -> "."); step 2 twice: crashed, re-done
        for m in client.get_metric_history(stored, key.replace("/", ".")):
            if m.step not in latest or m.timestamp >= latest[m.step][0]:
                latest[m.step] = (m.timestamp, m.value)
        want = {s: f[key] for s, f in expected.items() if key in f}
        assert {s: v for s, (_, v) in latest.items()} == pytest.approx(want, rel=1e-9), key
    config = json.loads((resumed / "config.json").read_text())
    assert run.data.params == {k: str(v) for k, v in flatten(config).items()}
    pngs = sorted(Path(a.path).name for a in client.list_artifacts(stored, "samples"))
    assert pngs == [f"step_{s:06d}.png" for s in _grid_steps(resumed)]
    final = json.loads((resumed / "summary.json").read_text())
    assert run.data.metrics["summary.final_reward"] == pytest.approx(final["final_reward"])
    assert run.data.metrics["summary.completed"] == 1.0
    assert "summary.base_eval.eval_reward.counting" in run.data.metrics  # `a` beside `a/b`


def test_a_named_tracker_that_is_not_installed_fails_validation_with_the_pip_command(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.setitem(sys.modules, "mlflow", None)  # `import mlflow` now fails: not installed
    code = main(_args(tmp_path / "run", "logging.trackers=[tensorboard, mlflow]"))
    lines = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert code == 2 and len(lines) == 1, lines
    assert "logging.trackers" in lines[0] and "'mlflow'" in lines[0]
    assert "pip install 'maskgrpo-ray[trackers]'" in lines[0]
    assert not (tmp_path / "run").exists()  # failed before anything started


def test_a_tracker_failing_mid_run_is_disabled_with_one_warning_and_the_run_completes(
    tmp_path, monkeypatch, caplog
):
    monkeypatch.setenv("MASKGRPO_CACHE_DIR", str(tmp_path / "cache"))
    real = TensorBoardTracker.log_metrics

    def flaky(self, step, metrics):
        if step >= 1:
            raise ConnectionError("server unreachable")
        real(self, step, metrics)

    monkeypatch.setattr(TensorBoardTracker, "log_metrics", flaky)
    run = tmp_path / "run"
    with caplog.at_level(logging.WARNING, logger="maskgrpo_ray.runlog.trackers"):
        assert main(_args(run, "logging.trackers=[tensorboard]")) == 0
    warned = [r for r in caplog.records if r.name == "maskgrpo_ray.runlog.trackers"]
    assert len(warned) == 1 and "tensorboard" in warned[0].getMessage()
    assert "server unreachable" in warned[0].getMessage()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["completed"] is True and summary["tracker_failures"] == {"tensorboard": 1}
    assert sorted(_rows(run)) == [0, 1, 2, 3]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("reward_mean")] == [0]  # nothing after it failed


def test_a_default_run_imports_no_tracker_library(tmp_path):
    code = (
        "import sys\n"
        "from maskgrpo_ray.runlog import run_log, trackers\n"
        "from maskgrpo_ray.loop import driver\n"
        "from maskgrpo_ray.config import load_config\n"
        "cfg = load_config('configs/toy.yaml')\n"
        "assert cfg.logging.trackers == []\n"
        "with run_log.RunLog(__import__('pathlib').Path(sys.argv[1])).tracking(\n"
        "    [], {}, cfg.model_dump(mode='json'), 0, 'x'):\n"
        "    pass\n"
        "print([m for m in ('wandb', 'mlflow', 'tensorboard', 'torch.utils.tensorboard')"
        " if m in sys.modules])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "run")],
        cwd=PKG.parent,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["[]"]


def test_only_the_trackers_module_imports_a_tracker_library_and_only_the_driver_opens_them():
    libraries = ("wandb", "mlflow", "tensorboard", "torch.utils.tensorboard")
    importers, openers = set(), set()
    for path in PKG.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            if any(n == lib or n.startswith(lib + ".") for n in names for lib in libraries):
                importers.add(path.name)
            if isinstance(node, ast.Attribute) and node.attr == "tracking":
                openers.add(path.relative_to(PKG).as_posix())
    assert importers == {"trackers.py"}
    assert openers == {"loop/driver.py"}  # the driver process; actors never hold a tracker
