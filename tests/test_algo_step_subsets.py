"""Cheaper learners: training k of the S unmasking steps per group (iso-temporal), a sliding
window, and the plans that carry them to the ranks. The group subsets are unbiased: over the
draws, the expected gradient of the mean over the k drawn steps equals the gradient of the mean
over all S, shown by enumerating every subset choice on a tiny case."""

from __future__ import annotations

import itertools
import os
from dataclasses import replace

import pytest
import torch
from tiny_runs import TOY_G3

from maskgrpo_ray.algo.grpo import select_group_steps, select_train_steps
from maskgrpo_ray.config import load_config
from maskgrpo_ray.pipeline.build import build_policy
from maskgrpo_ray.pipeline.learner_core import UpdatePlanner
from maskgrpo_ray.pipeline.learner_loss import accumulate_gradients, train_pairs
from maskgrpo_ray.pipeline.messages import TrainBatch
from maskgrpo_ray.pipeline.phases import generate
from maskgrpo_ray.pipeline.settings import settings_from_config

TOY = os.path.join(os.path.dirname(__file__), "..", "configs", "toy.yaml")
SMALL = TOY_G3


def _batch(policy, b: int = 2) -> TrainBatch:
    prompts = [
        "two red dots on the left",
        "one blue dot on the top",
        "three cyan dots on the right",
    ]
    rb = generate(
        policy,
        prompts[:b],
        list(range(b)),
        group_size=3,
        num_steps=4,
        temperature=1.0,
        gumbel_temperature=0.0,
        guidance_scale=0.0,
        transition="p1",
        policy_version=0,
        generator=torch.Generator().manual_seed(5),
    )
    adv = torch.randn(rb.num_samples, generator=torch.Generator().manual_seed(6))
    return TrainBatch.from_rollout(rb, adv)


def _grad(policy, batch: TrainBatch, units: torch.Tensor) -> torch.Tensor:
    policy.zero_grad(set_to_none=True)
    accumulate_gradients(
        policy, batch, train_steps=units, micro_batch=4096, clip_low=0.2, clip_high=0.28
    )
    return torch.cat([p.grad.flatten() for p in policy.parameters() if p.grad is not None])


def test_group_subsets_are_unbiased_by_enumeration():
    cfg = load_config(TOY, SMALL)
    policy = build_policy(cfg.model).train()
    batch = _batch(policy)  # B = 2 groups of G = 3, S = 4
    full = _grad(policy, batch, torch.arange(4))
    subsets = [torch.tensor(c) for c in itertools.combinations(range(4), 2)]  # C(4, 2) = 6
    total = torch.zeros_like(full)
    for k0, k1 in itertools.product(subsets, subsets):  # every (group 0, group 1) choice: 36
        units = torch.stack([k0, k0, k0, k1, k1, k1])  # [N, K], a group's rows alike
        total += _grad(policy, batch, units)
    mean = total / len(subsets) ** 2
    torch.testing.assert_close(mean, full, rtol=1e-4, atol=1e-7)
    # the "last 2" subset alone is not the full gradient (the identity above is not trivial)
    last = _grad(policy, batch, torch.tensor([2, 3]))
    assert (last - full).norm() > 0.1 * full.norm()


def test_group_draws_are_uniform_and_differ_between_groups():
    g = torch.Generator().manual_seed(0)
    draws = select_group_steps(8, 2, 4000, g)  # [B, K]
    assert draws.shape == (4000, 2) and (draws[:, 0] < draws[:, 1]).all()
    freq = torch.bincount(draws.flatten(), minlength=8).float() / 4000
    # each step is in a group's subset with probability k / S = 0.25; binomial sd ~ 0.007
    assert (freq - 0.25).abs().max() < 0.03
    assert not torch.equal(draws[0], draws[1]) or not torch.equal(draws[1], draws[2])


def test_the_window_slides_early_to_late_then_again():
    starts = [
        int(select_train_steps(8, "window", 3, update=u, window_shift=2)[0]) for u in range(14)
    ]
    # S - k + 1 = 6 window positions, each held for 2 updates
    assert starts == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 0, 0]
    assert select_train_steps(8, "window", 3, update=5, window_shift=1).tolist() == [5, 6, 7]


def test_the_planner_gives_each_group_its_steps_and_each_rank_its_rows():
    cfg = load_config(
        TOY,
        [*SMALL, "train.unmasking_step_selection=group_random", "train.unmasking_steps_trained=2"],
    )
    planner = UpdatePlanner(settings_from_config(cfg).update)
    plan = planner.plan(0, num_samples=9, group_size=3)
    units = plan.units_for_pass(0)
    assert units.shape == (9, 2) and plan.units_per_pass == 2
    for gi in range(3):  # iso-temporal: every sample of a group on the same steps
        assert (units[3 * gi : 3 * gi + 3] == units[3 * gi]).all()
    assert torch.equal(plan.rows(4, 9).units_for_pass(0), units[4:9])  # a rank's share
    again = UpdatePlanner(settings_from_config(cfg).update).plan(0, 9, 3)
    assert torch.equal(again.units_for_pass(0), units)  # seeded: the same on every rank
    assert not torch.equal(planner.plan(1, 9, 3).units_for_pass(0), units)  # anew per update
    with pytest.raises(ValueError, match="groups of 3"):
        planner.plan(2, num_samples=10, group_size=3)


def test_per_sample_pairs_are_sample_major():
    batch = replace(_batch(build_policy(load_config(TOY, SMALL).model)), advantages=torch.zeros(6))
    units = torch.tensor([[0, 2]] * 3 + [[1, 3]] * 3)
    samples, steps = train_pairs(batch, units)
    assert samples.tolist() == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5]
    assert steps.tolist() == [0, 2, 0, 2, 0, 2, 1, 3, 1, 3, 1, 3]
    with pytest.raises(ValueError, match="per-sample units"):
        train_pairs(batch, units[:4])
