"""The on-policy check looks at the whole first pass (every micro-batch of the first update)
and, under trajectory shrinkage, at the block starts against the rollout's cached log-probs
(issue 57: it read the first micro-batch only, and 0 under shrinkage whatever happened). A
0.5-nat shift of the cached log-probs at late steps: ``exp(-0.5)`` off 1, ``1 - e^-0.5 =
0.3935``, and a log-ratio of 0.5."""

from __future__ import annotations

import logging
import math
from dataclasses import replace

import pytest
from test_trajectory_shrinkage import ALL, SMALL, TOY, _batch, _update

from maskgrpo_ray.config import load_config
from maskgrpo_ray.loop.staleness import ONPOLICY_FIRST_RATIO, ONPOLICY_MEASURED, onpolicy_check
from maskgrpo_ray.pipeline.build import build_policy

SHIFT = 0.5
OFF = 1.0 - math.exp(-SHIFT)  # the learner's log-prob is 0.5 below the shifted cached one
MB2 = "train.micro_batch_pairs_per_gpu=2"  # 24 pairs, the first micro-batch sample 0's t0, t1


def _shifted(steps: list[int]):
    policy = build_policy(load_config(TOY, SMALL).model)
    batch = _batch(policy)
    old = batch.old_logp.clone()
    old[:, steps] += SHIFT
    return policy, replace(batch, old_logp=old)


def test_a_shift_at_late_steps_is_seen_over_the_whole_first_pass():
    policy, batch = _shifted([2, 3])
    m = _update([MB2, ALL], batch, policy)
    assert m["onpolicy_measured_share"] == 1.0
    assert m["first_ratio_abs_dev_max"] == pytest.approx(OFF, abs=1e-4)
    assert m["abs_log_ratio_max"] == pytest.approx(SHIFT, abs=1e-4)
    assert m["abs_log_ratio_worst_step"] in (2.0, 3.0)


@pytest.mark.parametrize("micro_batch", [MB2, "train.micro_batch_pairs_per_gpu=16"])
def test_under_shrinkage_a_shift_at_a_block_start_is_seen(micro_batch):
    policy, batch = _shifted([2])  # s = 2: blocks {0, 1}, {2, 3}; step 2 starts one
    m = _update([micro_batch, ALL, "train.trajectory_shrinkage=2"], batch, policy)
    assert m["onpolicy_measured_share"] == 0.5
    assert m["first_ratio_abs_dev_max"] == pytest.approx(OFF, abs=1e-4)
    assert m["abs_log_ratio_max"] == pytest.approx(SHIFT, abs=1e-4)
    assert m["abs_log_ratio_worst_step"] == 2.0


def test_under_shrinkage_steps_inside_a_block_are_not_measured(caplog):
    # step 3 alone is trained: scored from Y_2, its ratio says nothing about the weights
    policy, batch = _shifted([3])
    over = ["train.unmasking_step_selection=last", "train.unmasking_steps_trained=1"]
    m = _update([*over, "train.trajectory_shrinkage=2"], batch, policy)
    assert m["onpolicy_measured_share"] == 0.0
    assert "first_ratio_abs_dev_max" not in m and "abs_log_ratio_max" not in m
    row = {"staleness/lag_max": 0.0, **m}
    with caplog.at_level(logging.WARNING):
        onpolicy_check(row, 3, tolerance=1e-3)
    assert math.isnan(row[ONPOLICY_FIRST_RATIO]) and row[ONPOLICY_MEASURED] == 0.0
    assert "on-policy check failed" not in caplog.text


def test_the_same_batch_unshifted_passes():
    for over in ([MB2, ALL], [MB2, ALL, "train.trajectory_shrinkage=2"]):
        policy, batch = _shifted([])  # a fresh policy: the update moves the weights
        m = _update(over, batch, policy)
        assert m["first_ratio_abs_dev_max"] < 1e-5
