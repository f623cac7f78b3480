"""The fault drill (bench/fault_drill.py) as tests, on a real local Ray cluster: SIGKILL to a
rollout actor's, the reward actor's, the filter actor's and a learner rank's process, and
SIGTERM to the driver, each at the start of step 3 of a 6-step run with a checkpoint every 2.

Each faulty run must end with every step done once in ``metrics.jsonl``, no group lost or
trained twice (per prompt position, against the uninterrupted run), and the same metrics as the
uninterrupted run (relative tolerance 1e-5: the replays are the same computations, seeds and
weights, so the figures are in fact bit-equal on this machine; the tolerance only allows for a
summation order change should one appear). The learner case checks the in-job recovery; the
SIGTERM case is the Ray-backend interrupted-and-resumed run.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

from bench import fault_drill as drill

ROOT = Path(__file__).resolve().parents[1]

REL = 1e-5


@pytest.fixture(scope="module")
def clean(ray_cluster, tmp_path_factory):
    out = drill.run_one(None, tmp_path_factory.mktemp("clean") / "run")
    assert out["exit_codes"] == [0] and out["summary"]["completed"] is True
    assert [r["step"] for r in out["rows"]] == list(range(drill.STEPS))
    return out


def _check(row: dict, fault: str) -> None:
    print(drill.table([row]))
    assert row["exit_codes"] == ([0, 0] if fault == "sigterm" else [0])
    assert row["completed"] and row["steps_completed"] == drill.STEPS
    assert row["steps_in_metrics"] == drill.STEPS  # each step once in metrics.jsonl
    assert row["groups_lost"] == 0 and row["groups_duplicated"] == 0
    assert row["max_rel_diff"] <= REL, row
    if fault != "sigterm":
        assert row["detect_s"] is not None and row["recover_s"] is not None, row


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("fault", ["learner", "sigterm"])  # CI: the default-cadence case below
def test_drill_learner_and_driver(clean, tmp_path, fault):
    row = drill.compare(clean, drill.run_one(fault, tmp_path / fault))
    _check(row, fault)
    if fault == "learner":
        assert row["learner_restarts"] == 1.0


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("fault", ["rollout", "reward", "filter"])
def test_drill_actors(clean, tmp_path, fault):
    row = drill.compare(clean, drill.run_one(fault, tmp_path / fault))
    _check(row, fault)
    if fault in ("rollout", "reward"):
        assert row[f"{fault}_actor_restarts"] == 1.0


@pytest.mark.slow
@pytest.mark.ci
@pytest.mark.timeout(900)
def test_learner_lost_with_the_default_cadence_rolls_back_to_the_start(clean, tmp_path):
    """The time cadence alone (``checkpoint_every_steps=0``; ``run.checkpoint_every_minutes``
    is on by default, and its 10 minutes never come in this run): the run's start is a
    checkpoint, so a learner killed at step 3 rolls the run back to step 0 and it completes,
    equal to the uninterrupted run."""
    out = drill.run_one("learner", tmp_path / "run", ["run.checkpoint_every_steps=0"])
    row = drill.compare(clean, out)
    _check(row, "learner")
    assert row["learner_restarts"] == 1.0


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_learner_lost_without_checkpoint_continues_from_the_rollout_weights(
    clean, tmp_path, caplog
):
    """Both cadences off: no checkpoint to roll back to. The run still completes: the new
    learner group starts from the rollout actors' weights (the version the lost update
    started from) with fresh optimizer state and step 3 runs again from its start, announced in
    one warning and counted (``learner_fallbacks``). Steps 0-2 equal the uninterrupted run's;
    no group is lost or trained twice; from step 3 on the figures differ (fresh Adam moments),
    which is why the cadences are on by default."""
    none = ["run.checkpoint_every_steps=0", "run.checkpoint_every_minutes=0"]
    with caplog.at_level("WARNING"):
        out = drill.run_one("learner", tmp_path / "run", none)
    assert out["exit_codes"] == [0] and out["summary"]["completed"] is True
    rows = out["rows"]
    assert [r["step"] for r in rows] == list(range(drill.STEPS))
    assert [r["learner_fallbacks"] for r in rows if "learner_fallbacks" in r][-1] == 1.0
    assert rows[-1]["learner_restarts"] == 1.0
    lines = [r.getMessage() for r in caplog.records if "rollout actors' weights" in r.getMessage()]
    assert len(lines) == 1 and "learner rank 1 died during update" in lines[0], lines
    assert "fresh optimizer state" in lines[0] and "learner_fallbacks" in lines[0]
    row = drill.compare(clean, out)
    assert row["groups_lost"] == 0 and row["groups_duplicated"] == 0, row
    by_step = {r["step"]: r for r in clean["rows"]}
    for r in rows[: drill.FAULT_STEP]:
        assert r["loss"] == by_step[r["step"]]["loss"], r["step"]
    for r in rows:  # the redone step starts at the version the lost update started at
        assert r["policy_version"] == by_step[r["step"]]["policy_version"], r["step"]


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("chunks", ["kept", "lost"])
def test_a_learner_rank_lost_mid_write_finishes_bit_equal(
    clean, tmp_path, monkeypatch, caplog, chunks
):
    """``run.checkpoint_async``: the checkpoint at step 2 is held in its background write until
    learner rank 1 is SIGKILLed at the start of step 2; the step's update finds the rank lost
    and the run rolls back. ``kept``: on one node the dead rank's object-store chunks are still
    readable (measured here), the write completes and the run rolls back to it (step 2).
    ``lost``: the write fails as it does where the chunks died with the rank's node (here the
    held write raises Ray's ObjectLostError once the rank is dead: a stand-in, one node cannot
    lose its object store); the recovery discards it (before issue 57 ``recover_learner``'s
    ``flush()`` raised it and the run crashed) and rolls back to the start's checkpoint. Either
    way every step runs once and the final weights are bit-equal to the uninterrupted run's."""
    import threading

    from ray.exceptions import ObjectLostError
    from safetensors.torch import load_file

    from maskgrpo_ray.learner.group import LearnerGroup
    from maskgrpo_ray.loop import driver

    killed, held = threading.Event(), threading.Event()
    real_write, real_step = LearnerGroup.write_snapshot, driver.run_step

    def write_snapshot(self, folder, per_rank):  # noqa: ANN001, ANN202
        if ".tmp-step_000002" in folder and not killed.is_set():
            held.set()
            assert killed.wait(120), "the learner rank was not killed"
            if chunks == "lost":
                raise ObjectLostError(
                    "ff" * 28, None, "learner rank 1's checkpoint chunk (its node died)"
                )
        return real_write(self, folder, per_rank)

    def run_step(ex, settings, s, *args, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        if s == 2 and not killed.is_set():
            assert held.wait(60), "no checkpoint write in flight at step 2"
            os.kill(ex.learner.pids()[1], signal.SIGKILL)
            killed.set()
        return real_step(ex, settings, s, *args, **kw)

    monkeypatch.setattr(LearnerGroup, "write_snapshot", write_snapshot)
    monkeypatch.setattr(driver, "run_step", run_step)
    with caplog.at_level("WARNING"):
        out = drill.run_one(None, tmp_path / "run", ["run.checkpoint_async=true"])
    assert killed.is_set()
    failed = "the checkpoint being written when the learner was lost failed" in caplog.text
    assert failed == (chunks == "lost")
    back_to = "step_000000" if chunks == "lost" else "step_000002"
    assert f"run from checkpoint {back_to}" in caplog.text
    row = drill.compare(clean, out)
    _check(row, "learner")
    assert row["learner_restarts"] == 1.0
    mine, base = (load_file(str(Path(r) / "final_policy.safetensors")) for r in (
        out["run_dir"], clean["run_dir"]))  # fmt: skip
    assert mine.keys() == base.keys() and all(torch.equal(mine[k], base[k]) for k in base)


# --------------------------------------------------------------- asynchronous rollouts (lag 1)

ASYNC = ["rollout.max_policy_lag=1"]


@pytest.fixture(scope="module")
def clean_async(ray_cluster, tmp_path_factory):
    out = drill.run_one(None, tmp_path_factory.mktemp("clean_async") / "run", ASYNC)
    assert out["exit_codes"] == [0] and out["summary"]["completed"] is True
    return out


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_async_rollouts_lag_one_step_and_train_every_group_once(clean, clean_async):
    """With max_policy_lag 1 the step after each non-checkpoint step uses rollouts made one
    version behind (generated during the previous update): its policy_version_lag is 1 and its
    first-pass |log-ratio| is no longer 0 (the ratio is against the behaviour policy). The
    stream hands out the same prompts in the same steps as the synchronous run, every group is
    trained once, and checkpoint steps (2, 4) are never crossed: steps 0, 2, 4 are synchronous."""
    rows = clean_async["rows"]
    assert [r["step"] for r in rows] == list(range(drill.STEPS))
    lag = [r["policy_version_lag"] for r in rows]
    # step 0: first step; steps 2 and 4 follow a checkpoint (every 2): made synchronously
    assert lag == [0, 1, 0, 1, 0, 1], lag
    sync_first = {r["step"]: r["abs_log_ratio_max"] for r in clean["rows"]}
    for r in rows:
        if r["policy_version_lag"] == 1:
            assert r["abs_log_ratio_max"] > 1e-4, r  # one update apart
        else:
            assert r["abs_log_ratio_max"] <= sync_first[r["step"]] + 1e-6
    # the same prompts per step as the synchronous run, each trained once or counted as given
    # up by the filter (its samples differ from the synchronous run's, so a prompt the filter
    # drops max_resamples + 1 times there may pass here, or the other way round)
    for a, b in zip(clean["rows"], rows, strict=True):
        handed = {
            x: len(r["prompts_trained"]) + r["groups_exhausted"] + r["groups_invalid"]
            for x, r in (("sync", a), ("async", b))
        }
        assert handed["sync"] == handed["async"], (a["step"], handed)
        assert len(set(b["prompts_trained"])) == len(b["prompts_trained"])  # once each
        union = set(a["prompts_trained"]) | set(b["prompts_trained"])
        assert len(union) <= handed["sync"]  # drawn from the same prompts of the stream
    row = drill.compare(clean, clean_async)  # per prompt over the run: differences are the
    assert row["groups_lost"] <= sum(r["groups_exhausted"] for r in rows)  # filter's only
    assert row["groups_duplicated"] <= sum(r["groups_exhausted"] for r in clean["rows"])
    busy = [r["learner_busy_fraction"] for r in rows]
    assert all(0 < b <= 1 for b in busy), busy


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("fault", ["learner", "sigterm"])
def test_async_drill_learner_and_driver(clean_async, tmp_path, fault):
    """The learner roll-back and the SIGTERM resume keep their guarantees with asynchronous
    rollouts: a rollout in flight is dropped (and its prompts given back to the stream on
    SIGTERM), and the run equals the uninterrupted asynchronous one."""
    row = drill.compare(clean_async, drill.run_one(fault, tmp_path / fault, ASYNC))
    _check(row, fault)
