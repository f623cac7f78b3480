"""Staleness and on-policy checks: the lag of every group trained (per chunk on Ray), the groups
dropped for exceeding rollout.max_policy_lag, and the first micro-batch's ratio at lag 0, with
its warning. The driver computes them for both backends (tests/test_lag_reference.py compares
the Ray run's rows with the local run's, these keys included)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from tiny_runs import NO_GRIDS, tiny_toy

from maskgrpo_ray.cli import main
from maskgrpo_ray.loop.staleness import (
    ONPOLICY_FIRST_RATIO,
    group_versions,
    onpolicy_check,
    staleness_check,
)
from maskgrpo_ray.pipeline.data_plane import RolloutMeta, RolloutPiece, RolloutRefs


def _refs() -> RolloutRefs:
    """Three chunks of 2, 1 and 1 groups (G = 3) generated with versions 5, 4 and 2."""
    pieces = tuple(
        RolloutPiece(None, None, groups, RolloutMeta(3 * len(groups), v, 0, 0))
        for groups, v in (((0, 1), 5), ((0,), 4), ((1,), 2))  # a piece may hold some groups
    )
    return RolloutRefs(["a", "b", "c", "d"], [0, 1, 2, 3], 3, pieces)


def test_lags_by_hand_and_stale_groups_dropped(caplog):
    versions = group_versions(_refs())
    assert versions.tolist() == [5, 5, 4, 2]
    with caplog.at_level(logging.WARNING):
        keep, fig = staleness_check(versions, 5, 2, 3, step=9)
    # lags 0, 0, 1, 3: the last exceeds max_policy_lag 2 -> its 3 samples dropped;
    # kept lags 0, 0, 1: mean 1/3, worst 1
    assert keep.tolist() == [True, True, True, False]
    assert fig == {
        "staleness/lag_mean": pytest.approx(1 / 3),
        "staleness/lag_max": 1.0,
        "staleness/samples_dropped": 3.0,
    }
    assert "step 9: 3 samples dropped for staleness (lags [3]" in caplog.text
    keep, fig = staleness_check(versions, 5, 3, 3, step=9)  # lag 3 allowed: all kept
    assert keep.all() and fig["staleness/lag_max"] == 3.0 and fig["staleness/lag_mean"] == 1.0


def test_an_in_process_rollout_has_one_version():
    class Rb:  # the two fields group_versions reads of a RolloutBatch
        prompts = ["a", "b"]
        policy_version = 7

    assert group_versions(Rb()).tolist() == [7, 7]


def test_onpolicy_check_at_lag_zero_only(caplog):
    row = {"staleness/lag_max": 0.0, "first_ratio_abs_dev_max": 2e-3}
    with caplog.at_level(logging.WARNING):
        onpolicy_check(row, 7, tolerance=1e-3)
    assert row == {"staleness/lag_max": 0.0, ONPOLICY_FIRST_RATIO: 2e-3}
    assert "step 7: on-policy check failed" in caplog.text
    caplog.clear()
    row = {"staleness/lag_max": 0.0, "first_ratio_abs_dev_max": 1e-7}
    with caplog.at_level(logging.WARNING):
        onpolicy_check(row, 8, tolerance=1e-3)
    assert row[ONPOLICY_FIRST_RATIO] == 1e-7 and not caplog.text
    row = {"staleness/lag_max": 1.0, "first_ratio_abs_dev_max": 0.5}  # off-policy: no figure
    onpolicy_check(row, 9, tolerance=1e-3)
    assert row == {"staleness/lag_max": 1.0}


SMALL = tiny_toy(4, 4, NO_GRIDS)


def _rows(tmp_path: Path, lag: int) -> list[dict]:
    run = tmp_path / f"lag{lag}"
    args = ["train", "--backend", "local", "--run-dir", str(run)]
    for s in [*SMALL, f"rollout.max_policy_lag={lag}"]:
        args += ["--set", s]
    assert main(args) == 0
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_synchronous_run_is_on_policy_at_every_step(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        rows = _rows(tmp_path, 0)
    assert [r["staleness/lag_max"] for r in rows] == [0.0] * 4
    assert all(r["staleness/samples_dropped"] == 0.0 for r in rows)
    # the learner holds the rollout's weights: the ratio is 1 to float32 round-off
    assert all(0.0 <= r[ONPOLICY_FIRST_RATIO] < 1e-5 for r in rows)
    assert "on-policy check failed" not in caplog.text


def test_lag_one_is_on_policy_at_the_first_step_only(tmp_path):
    rows = _rows(tmp_path, 1)
    assert [r["staleness/lag_max"] for r in rows] == [0.0, 1.0, 1.0, 1.0]
    assert [r["staleness/lag_mean"] for r in rows] == [0.0, 1.0, 1.0, 1.0]
    assert [ONPOLICY_FIRST_RATIO in r for r in rows] == [True, False, False, False]
    assert all(r["staleness/samples_dropped"] == 0.0 for r in rows)
    assert all("first_ratio_abs_dev_max" not in r for r in rows)
    assert torch.tensor([r["abs_log_ratio_max"] for r in rows[1:]]).min() > 1e-4  # off-policy
