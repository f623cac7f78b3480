"""MaskFocus's critical steps (train.unmasking_step_selection: critical): each group's k steps
whose prediction moved the intermediate image furthest towards the final one, chosen from the
rollout's record; by hand on tiny cases and a made-up trajectory, the forward estimator's
step_focus sizes from the same steps, a group's advantages at a trained step summing to zero,
and k = S is the full trajectory exactly."""

from __future__ import annotations

import json
import os
from dataclasses import replace

import pytest
import torch
from tiny_runs import TOY_G3

from maskgrpo_ray.algo.estimators import focus_step_counts
from maskgrpo_ray.algo.grpo import critical_steps, group_agreement, prediction_agreement
from maskgrpo_ray.cli import main
from maskgrpo_ray.config import load_config
from maskgrpo_ray.pipeline.build import build_policy
from maskgrpo_ray.pipeline.learner_core import (
    TorchOptimizing,
    UpdatePlan,
    UpdatePlanner,
    apply_update,
    build_optimizer,
)
from maskgrpo_ray.pipeline.learner_loss import train_pairs
from maskgrpo_ray.pipeline.messages import TrainBatch
from maskgrpo_ray.pipeline.phases import generate
from maskgrpo_ray.pipeline.settings import settings_from_config

TOY = os.path.join(os.path.dirname(__file__), "..", "configs", "toy.yaml")
SMALL = TOY_G3


def test_prediction_agreement_by_hand():
    final = torch.tensor([[1, 2, 3, 4]])
    unmask_step = torch.tensor([[0, 1, 2, 2]])  # position 0 committed at step 0, ...
    predictions = torch.tensor([[[1, 9, 3, 9], [7, 2, 8, 4], [0, 0, 3, 4]]])  # [N=1, S=3, L=4]
    # step 0: every position masked before it: [1, 9, 3, 9] -> 2 of 4 agree
    # step 1: position 0 committed (its final token 1 stands), [1, 2, 8, 4] -> 3 of 4
    # step 2: positions 0, 1 committed, [1, 2, 3, 4] -> 4 of 4 (the last step is the final)
    agree = prediction_agreement(predictions, final, unmask_step)
    assert agree.tolist() == [[0.5, 0.75, 1.0]]


def test_critical_steps_by_hand():
    # S = 6; binary fractions so the jumps are exact. MaskFocus's candidates are t = 1..4 with
    # score |a_t - a_(t-1)|: t1 0.125, t2 0.5, t3 0.125, t4 0.0625; t0 and t5 unscored
    a = torch.tensor([[0.125, 0.25, 0.75, 0.875, 0.9375, 1.0]])
    assert critical_steps(a, 1).tolist() == [[2]]
    assert critical_steps(a, 2).tolist() == [[1, 2]]  # t1 and t3 tie: the earlier
    assert critical_steps(a, 3).tolist() == [[1, 2, 3]]
    assert critical_steps(a, 4).tolist() == [[1, 2, 3, 4]]
    assert critical_steps(a, 5).tolist() == [[0, 1, 2, 3, 4]]  # unscored: step 0, then S-1
    assert critical_steps(a, 6).tolist() == [list(range(6))]
    # per sample: a second sample whose big move is at step 4
    b = torch.tensor([[0.0, 0.0625, 0.125, 0.1875, 0.875, 1.0]])
    assert critical_steps(torch.cat([a, b]), 1).tolist() == [[2], [4]]
    with pytest.raises(ValueError, match="k must be in"):
        critical_steps(a, 7)


# A made-up trajectory: one group of G = 2, S = 5 steps, L = 4 tokens. Committed positions hold
# 0 in the predictions (the agreement must read the committed token there, not the sampler's).
FINAL = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
UNMASK_STEP = torch.tensor([[0, 1, 3, 4], [0, 2, 3, 4]])  # the step that commits each position
PREDICTIONS = torch.tensor(
    [
        # A, masked before step t: all; 1,2,3; 2,3; 2,3; 3
        [[1, 0, 0, 0], [0, 2, 0, 0], [0, 0, 3, 4], [0, 0, 0, 4], [0, 0, 0, 4]],
        # B, masked before step t: all; 1,2,3; 1,2,3; 2,3; 3
        [[5, 6, 0, 0], [0, 0, 0, 0], [0, 6, 0, 0], [0, 0, 7, 8], [0, 0, 0, 8]],
    ]
)  # [N=2, S=5, L=4]


def test_critical_steps_of_a_made_up_trajectory_by_hand():
    # a_t (committed tokens count as agreeing):
    #   A: t0 1/4 (pos 0), t1 2/4 (pos 0 committed, pos 1), t2 4/4, t3 3/4 (pos 2 wrong), t4 4/4
    #   B: t0 2/4 (pos 0, 1), t1 1/4 (pos 0 committed), t2 2/4, t3 4/4, t4 4/4
    agree = prediction_agreement(PREDICTIONS, FINAL, UNMASK_STEP)
    assert agree.tolist() == [[0.25, 0.5, 1.0, 0.75, 1.0], [0.5, 0.25, 0.5, 1.0, 1.0]]
    # per sample the two would disagree: A's biggest jump is t2 (0.5), B's t3 (0.5)
    assert critical_steps(agree, 1).tolist() == [[2], [3]]
    # the group's mean: 0.375, 0.375, 0.75, 0.875, 1.0; jumps t1 0, t2 0.375, t3 0.125
    group = group_agreement(agree, 2)
    assert group.tolist() == [[0.375, 0.375, 0.75, 0.875, 1.0]] * 2
    assert critical_steps(group, 1).tolist() == [[2], [2]]
    assert critical_steps(group, 2).tolist() == [[2, 3], [2, 3]]
    assert critical_steps(group, 3).tolist() == [[1, 2, 3], [1, 2, 3]]
    assert critical_steps(group, 4).tolist() == [[0, 1, 2, 3], [0, 1, 2, 3]]  # t0 before t4
    # step_focus: the same steps, their masked counts (A: 4, 3, 2, 2, 1; B: 4, 3, 3, 2, 1)
    assert focus_step_counts(PREDICTIONS, FINAL, UNMASK_STEP, 2, 2).tolist() == [[2, 2], [3, 2]]
    assert focus_step_counts(PREDICTIONS, FINAL, UNMASK_STEP, 1, 2).tolist() == [[2], [3]]
    # one sample a group: its own steps (A: t2, then t1 and t3 tie at 0.25: the earlier, so
    # t1, t2 -> 3, 2; B: t3, then t1 and t2 tie at 0.25: t1, so t1, t3 -> 3, 2)
    assert focus_step_counts(PREDICTIONS, FINAL, UNMASK_STEP, 2, 1).tolist() == [[3, 2], [3, 2]]
    with pytest.raises(ValueError, match="groups of 3"):
        group_agreement(agree, 3)


def _batch(policy) -> TrainBatch:
    rb = generate(
        policy,
        ["two red dots on the left", "one blue dot on the top"],
        [0, 1],
        group_size=3,
        num_steps=4,
        temperature=1.0,
        gumbel_temperature=0.0,
        guidance_scale=0.0,
        transition="p1",
        policy_version=0,
        generator=torch.Generator().manual_seed(5),
        step_agreement=True,
    )
    adv = torch.randn(rb.num_samples, generator=torch.Generator().manual_seed(6))
    return TrainBatch.from_rollout(rb, adv)


def test_the_rollout_records_each_steps_agreement():
    batch = _batch(build_policy(load_config(TOY, SMALL).model))
    a = batch.step_agreement
    assert a is not None and a.shape == (6, 4)
    assert (a[:, -1] == 1.0).all() and ((a >= 0) & (a <= 1)).all()
    # the group's mean; the share of tokens already committed before step t agrees by
    # construction: a lower bound of the group's mean agreement
    assert torch.equal(a, a.view(2, 3, 4)[:, :1].expand(2, 3, 4).reshape(6, 4))
    committed = torch.stack([(batch.unmask_step < t).float().mean(-1) for t in range(4)], 1)
    assert (a >= group_agreement(committed, 3) - 1e-7).all()


def test_a_groups_members_train_the_same_steps_and_its_advantages_sum_to_zero():
    batch = _batch(build_policy(load_config(TOY, SMALL).model))
    centred = batch.advantages - batch.advantages.view(2, 3).mean(1).repeat_interleave(3)
    batch = replace(batch, advantages=centred)  # group advantages: zero sum per group
    plan = UpdatePlan(torch.arange(0), 1e-3, critical=1).resolved(batch)
    units = plan.sample_units
    assert units is not None and units.shape == (6, 1)
    assert torch.equal(units, units[::3].repeat_interleave(3, dim=0))
    samples, steps = train_pairs(batch, units)
    for g in range(2):
        for t in steps.unique().tolist():
            at = (samples // 3 == g) & (steps == t)
            assert int(at.sum()) in (0, 3)
            assert abs(float(batch.advantages[samples[at]].sum())) < 1e-6


def _updated(over: list[str], batch: TrainBatch) -> dict[str, torch.Tensor]:
    cfg = load_config(TOY, [*SMALL, *over])
    up = settings_from_config(cfg).update
    torch.manual_seed(0)
    policy = build_policy(cfg.model)
    opt = TorchOptimizing(policy, build_optimizer(up, policy), up.grad_clip_norm)
    plan = UpdatePlanner(up).plan(0, batch.num_samples, batch.group_size)
    m = apply_update(opt, batch, plan, up)
    assert m["forward_passes_per_sample"] == plan.units_per_pass
    return {k: v.detach().clone() for k, v in policy.state_dict().items()}


def test_k_equal_to_s_is_the_full_trajectory_exactly():
    batch = _batch(build_policy(load_config(TOY, SMALL).model))
    full = _updated(["train.unmasking_step_selection=all"], batch)
    crit = _updated(
        ["train.unmasking_step_selection=critical", "train.unmasking_steps_trained=4"], batch
    )
    assert all(torch.equal(full[k], crit[k]) for k in full)
    two = _updated(
        ["train.unmasking_step_selection=critical", "train.unmasking_steps_trained=2"], batch
    )
    assert any(not torch.equal(full[k], two[k]) for k in full)


def test_a_run_trains_k_critical_steps(tmp_path):
    run = tmp_path / "run"
    sets = [
        *SMALL,
        "train.steps=2",
        "train.prompts_per_step=2",
        "eval.samples_per_prompt=1",
        "logging.progress_bar=false",
        "logging.sample_grid_every_steps=0",
        "train.unmasking_step_selection=critical",
        "train.unmasking_steps_trained=2",
    ]
    args = ["train", "--backend", "local", "--run-dir", str(run)]
    for s in sets:
        args += ["--set", s]
    assert main(args) == 0
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["forward_passes_per_sample"] for r in rows] == [2.0, 2.0]
