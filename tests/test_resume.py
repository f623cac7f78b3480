"""Checkpoints are atomic and retained; an interrupted run resumes to the same metrics."""

from __future__ import annotations

import json

import pytest
from tiny_runs import ONE_OF_EACH, crash_at_step, sets, tiny_toy

from maskgrpo_ray.checkpoints.run_store import latest_checkpoint, save_checkpoint
from maskgrpo_ray.cli import main

SMALL = tiny_toy(6, 3, "run.checkpoint_every_steps=2", "run.keep_checkpoints=2")
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


def _args(run, backend="local", extra=()):
    out = ["train", "--backend", backend, "--run-dir", str(run)]
    for s in [*SMALL, *extra]:
        out += ["--set", s]
    return out


def _rows(run):
    return {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


# run.checkpoint_async: the checkpoints are snapshots written in the background; the run is the
# same, and the interrupt waits for the write in flight (the run's end flushes it)
@pytest.mark.parametrize("extra", [(), ("run.checkpoint_async=true",)], ids=["sync", "async"])
def test_interrupted_run_resumes_to_identical_metrics(tmp_path, monkeypatch, extra):
    monkeypatch.setenv("MASKGRPO_CACHE_DIR", str(tmp_path / "cache"))
    full, cut = tmp_path / "full", tmp_path / "cut"
    assert main(_args(full, extra=extra)) == 0

    with crash_at_step(monkeypatch, 5), pytest.raises(KeyboardInterrupt):
        main(_args(cut, extra=extra))
    assert latest_checkpoint(cut).name == "step_000004"
    assert sorted(_rows(cut)) == [0, 1, 2, 3, 4]  # step 4 ran but is after the checkpoint
    assert main(["train", "--resume", str(cut)]) == 0
    a, b = _rows(full), _rows(cut)
    assert sorted(b) == list(range(6))
    for step in range(6):
        for key in COMPARED:
            assert a[step].get(key) == pytest.approx(b[step].get(key), rel=1e-6, abs=1e-7), (
                step,
                key,
            )
    # retention: only the newest two checkpoints are kept
    kept = sorted(p.name for p in (cut / "checkpoints").glob("step_*"))
    assert kept == ["step_000004", "step_000006"]
    summary = json.loads((cut / "summary.json").read_text())
    assert summary["start_step"] == 4 and summary["base_accuracy"] is not None


def _files(run):
    """Every file of a run folder: relative path -> (bytes, mtime)."""
    return {
        str(f.relative_to(run)): (f.read_bytes(), f.stat().st_mtime_ns)
        for f in sorted(run.rglob("*"))
        if f.is_file()
    }


def test_a_completed_run_ends_with_a_checkpoint_and_resume_continues_or_leaves_it(
    tmp_path, monkeypatch, caplog, capsys
):
    """A run's end is a checkpoint (5 steps, cadence 2: steps 0, 2, 4 and the end's, 5). Its
    resume with the same train.steps says in one line that it is complete and changes no file
    (exit 0); with more steps it continues from step 5 and the finished run's summary and
    policy move aside, so the folder describes one run."""
    monkeypatch.setenv("MASKGRPO_CACHE_DIR", str(tmp_path / "cache"))
    run = tmp_path / "run"
    assert main(_args(run) + ["--set", "train.steps=5"]) == 0
    assert latest_checkpoint(run).name == "step_000005"
    before = _files(run)
    caplog.clear()
    assert main(["train", "--resume", str(run)]) == 0
    lines = [r.getMessage() for r in caplog.records if "is complete" in r.getMessage()]
    assert len(lines) == 1 and "train.steps above 5" in lines[0], lines
    assert _files(run) == before  # nothing written, nothing moved
    assert main(["train", "--resume", str(run), "--set", "train.steps=3"]) == 0  # fewer: same
    assert _files(run) == before

    old_summary = json.loads((run / "summary.json").read_text())
    assert main(["train", "--resume", str(run), "--set", "train.steps=7"]) == 0
    assert sorted(_rows(run)) == list(range(7))  # steps 5 and 6 added, each step once
    summary = json.loads((run / "summary.json").read_text())
    assert summary["completed"] is True and summary["start_step"] == 5 and summary["steps"] == 7
    (aside,) = (run / "superseded").iterdir()
    assert aside.name.endswith("-from-step_000005")
    assert json.loads((aside / "summary.json").read_text()) == old_summary
    assert (aside / "final_policy.safetensors").exists() and not (aside / "metrics.jsonl").exists()
    assert latest_checkpoint(run).name == "step_000007"
    # an unfinished run (no summary) whose checkpoint is past train.steps: refused, one line
    (run / "summary.json").unlink()
    caplog.clear()
    assert main(["train", "--resume", str(run), "--set", "train.steps=5"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "train.steps=5" in err[0] and "train.steps=7" in err[0], err


def test_a_resume_to_an_earlier_checkpoint_keeps_the_rows_it_discards(
    tmp_path, monkeypatch, caplog
):
    """The newest checkpoint (the end's, step 6) corrupt: the resume goes back to step 4. The
    rows of steps 4 and 5, the summary and the final policy of the first attempt move to
    superseded/, named in one WARNING; the replayed steps equal the rows set aside."""
    monkeypatch.setenv("MASKGRPO_CACHE_DIR", str(tmp_path / "cache"))
    run = tmp_path / "run"
    assert main(_args(run)) == 0
    first = _rows(run)
    with (run / "checkpoints" / "step_000006" / "driver.pt").open("ab") as f:
        f.write(b"x")  # no longer what its manifest says
    caplog.clear()
    assert main(["train", "--resume", str(run)]) == 0
    (aside,) = (run / "superseded").iterdir()
    said = [r.getMessage() for r in caplog.records if str(aside.resolve()) in r.getMessage()]
    assert len(said) == 1 and "checkpoint step_000004" in said[0], said
    kept = [json.loads(x) for x in (aside / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in kept] == [4, 5]
    assert {p.name for p in aside.iterdir()} >= {"summary.json", "final_policy.safetensors"}
    again = _rows(run)
    assert sorted(again) == list(range(6))
    for r in kept:  # the same seeds: the replay is the run it replaced
        for key in COMPARED:
            assert again[r["step"]][key] == pytest.approx(r[key], rel=1e-6, abs=1e-7)
        assert first[r["step"]] == r


def test_crash_while_writing_keeps_previous_latest(tmp_path):
    save_checkpoint(tmp_path, 1, lambda d: (d / "a.txt").write_text("one"), keep=3)

    def broken(folder):
        (folder / "a.txt").write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError):
        save_checkpoint(tmp_path, 2, broken, keep=3)
    latest = latest_checkpoint(tmp_path)
    assert latest.name == "step_000001" and (latest / "a.txt").read_text() == "one"


def test_resume_without_checkpoint_is_a_clear_error(tmp_path, capsys):
    assert main(["train", "--resume", str(tmp_path)]) == 2
    assert "no complete checkpoint" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.ci
@pytest.mark.timeout(900)
def test_ray_backend_resumes_to_identical_metrics(tmp_path, monkeypatch):
    """The same drill on the Ray backend: DeepSpeed checkpoint per learner rank, filter actor
    state, policy version; each `main` starts and stops its own local cluster."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    extra = sets([*ONE_OF_EACH, "train.steps=4"])
    full, cut = tmp_path / "full", tmp_path / "cut"
    assert main(_args(full, "ray") + extra) == 0
    with crash_at_step(monkeypatch, 3), pytest.raises(KeyboardInterrupt):
        main(_args(cut, "ray") + extra)
    assert latest_checkpoint(cut).name == "step_000002"
    assert main(["train", "--resume", str(cut)]) == 0
    a, b = _rows(full), _rows(cut)
    assert sorted(b) == [0, 1, 2, 3]
    for step in range(4):
        for key in COMPARED:
            assert a[step].get(key) == pytest.approx(b[step].get(key), rel=1e-5, abs=1e-6), (
                step,
                key,
            )
