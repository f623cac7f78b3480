"""MaskFocus's critical steps (train.unmasking_step_selection: critical): each sample's k steps
whose prediction moved the intermediate image furthest towards the final one, chosen from the
rollout's record; by hand on tiny cases, and k = S is the full trajectory exactly."""

from __future__ import annotations

import json
import os

import pytest
import torch
from tiny_runs import TOY_G3

from maskgrpo_ray.algo.grpo import critical_steps, prediction_agreement
from maskgrpo_ray.cli import main
from maskgrpo_ray.config import load_config
from maskgrpo_ray.pipeline.build import build_policy
from maskgrpo_ray.pipeline.learner_core import (
    TorchOptimizing,
    UpdatePlanner,
    apply_update,
    build_optimizer,
)
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
    # the share of tokens already committed before step t agrees by construction: a lower bound
    committed = torch.stack([(batch.unmask_step < t).float().mean(-1) for t in range(4)], 1)
    assert (a >= committed - 1e-7).all()


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
