"""Diversity-aware and multi-reward advantages (``maskgrpo_ray/algo/advantages.py``), each
against a hand-computed group, and the driver's rule (``phases.batch_advantages``)."""

from __future__ import annotations

import pytest
import torch

from maskgrpo_ray.algo.advantages import (
    centred_advantages,
    diversity_advantages,
    gardo_scale,
    gdpo_advantages,
)
from maskgrpo_ray.algo.diversity import nearest_neighbour_distance
from maskgrpo_ray.algo.grpo import group_advantages


def test_gardo_scales_positive_advantages_by_the_hand_computed_factor_only():
    # one group of 4: r = [2, 2, 0.5, 1]; mean 1.375, so A = [0.625, 0.625, -0.875, -0.375]
    r = torch.tensor([2.0, 2.0, 0.5, 1.0])
    adv = centred_advantages(r, 4)
    torch.testing.assert_close(adv, torch.tensor([0.625, 0.625, -0.875, -0.375]))
    # nearest-neighbour distances d = [0, 0.25, 0.125, 0.125]: mean 0.125, so the positive
    # advantages are scaled by d / 0.125 = 0 and 2; the negative ones stay
    d = torch.tensor([0.0, 0.25, 0.125, 0.125])
    got = gardo_scale(adv, d, 4)
    torch.testing.assert_close(got, torch.tensor([0.0, 1.25, -0.875, -0.375]), rtol=0, atol=1e-6)
    # per group: a second group with its own mean distance (0.5), positives scaled by d / 0.5
    r2 = torch.cat([r, torch.tensor([1.0, 0.0, 0.0, 1.0])])
    d2 = torch.cat([d, torch.tensor([0.25, 0.5, 0.5, 0.75])])
    got2 = gardo_scale(centred_advantages(r2, 4), d2, 4)
    torch.testing.assert_close(got2[4:], torch.tensor([0.5 * 0.5, -0.5, -0.5, 0.5 * 1.5]))
    # the composed rule with the GARDO form (centred) is the same thing
    torch.testing.assert_close(
        diversity_advantages(r2, 4, kind="centred", diversity="gardo", distance=d2), got2
    )


def test_gardo_leaves_a_group_of_alike_samples_at_zero_and_never_nan():
    r = torch.tensor([1.5, 1.5, 1.5])
    got = gardo_scale(centred_advantages(r, 3), torch.zeros(3), 3)
    assert torch.equal(got, torch.zeros(3))


def test_gdpo_equals_its_formula_on_a_hand_made_group():
    # two groups of 3, two components; component a: [1, 0, 0 | 2, 2, 2], b: [0, 3, 6 | 1, 0, 2]
    a = torch.tensor([1.0, 0.0, 0.0, 2.0, 2.0, 2.0])
    b = torch.tensor([0.0, 3.0, 6.0, 1.0, 0.0, 2.0])
    w = torch.tensor([1.0, 0.5])
    eps = 1e-4
    # within-group normalisation (unbiased std): a, group 0: mean 1/3, std sqrt(1/3)
    s3 = (1 / 3) ** 0.5
    na = torch.tensor([(2 / 3) / (s3 + eps), (-1 / 3) / (s3 + eps), (-1 / 3) / (s3 + eps), 0, 0, 0])
    # b, group 0: mean 3, std 3; group 1: mean 1, std 1
    nb = torch.tensor([-3 / (3 + eps), 0.0, 3 / (3 + eps), 0.0, -1 / (1 + eps), 1 / (1 + eps)])
    s = 1.0 * na + 0.5 * nb
    want = (s - s.mean()) / (s.std(unbiased=True) + eps)
    got = gdpo_advantages(torch.stack([a, b]), w, 3, eps)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    # each component has its say per unit of its own spread: scaling one component's rewards
    # by 10 changes nothing in GDPO (up to eps), while the plain sum's GRPO advantages move
    scaled = gdpo_advantages(torch.stack([10 * a, b]), w, 3, eps)
    torch.testing.assert_close(scaled, got, rtol=0, atol=1e-3)
    plain, plain10 = group_advantages(a + 0.5 * b, 3), group_advantages(10 * a + 0.5 * b, 3)
    assert (plain - plain10).abs().max() > 0.3
    torch.testing.assert_close(
        diversity_advantages(a + 0.5 * b, 3, kind="gdpo", parts=torch.stack([a, b]), weights=w),
        got,
    )


def test_none_is_bit_for_bit_plain_grpo():
    g = torch.Generator().manual_seed(0)
    r = torch.rand(48, generator=g) * 2
    want = group_advantages(r, 6, 1e-4)
    got = diversity_advantages(r, 6, kind="grpo", diversity="none", eps=1e-4)
    assert torch.equal(got, want)


def test_the_bonus_is_the_weighted_distance_added_to_the_reward():
    g = torch.Generator().manual_seed(1)
    r, d = torch.rand(12, generator=g), torch.rand(12, generator=g)
    got = diversity_advantages(r, 6, kind="grpo", diversity="bonus", distance=d, bonus_weight=3.0)
    assert torch.equal(got, group_advantages(r + 3.0 * d, 6, 1e-4))


def test_nearest_neighbour_distance_by_hand():
    # one-hot rows: a == b, c differs from a in both entries of its 2 (cos 0 -> distance 1)
    f = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    got = nearest_neighbour_distance(f, 4)
    # a, b: 0 (each other); c: nearest is d at 1 - 1/sqrt(2); d: 1 - 1/sqrt(2) to all
    x = 1 - 2**-0.5
    torch.testing.assert_close(got, torch.tensor([0.0, 0.0, x, x]), rtol=0, atol=1e-6)
    assert torch.isnan(nearest_neighbour_distance(f[:1], 1)).all()  # a group of one


def test_a_missing_distance_or_component_is_a_clear_error():
    r = torch.rand(6)
    with pytest.raises(ValueError, match="needs a distance"):
        diversity_advantages(r, 6, diversity="gardo")
    with pytest.raises(ValueError, match="needs the reward components"):
        diversity_advantages(r, 6, kind="gdpo")


# ----------------------------------------------------------------------------- the driver's rule


def _scored(rewards, parts=None, diversity=None, g=3):
    from maskgrpo_ray.pipeline.messages import RolloutBatch, ScoredBatch

    n = rewards.numel()
    rb = RolloutBatch(
        prompts=[f"p{i}" for i in range(n // g)],
        prompt_indices=list(range(n // g)),
        group_size=g,
        cond_ids=torch.zeros(n, 6, dtype=torch.long),
        final_tokens=torch.zeros(n, 16, dtype=torch.long),
        unmask_step=torch.zeros(n, 16, dtype=torch.long),
        old_logp=torch.zeros(n, 4),
        sampled=None,
        images=torch.zeros(n, 4, 4, 3, dtype=torch.uint8),
        policy_version=0,
        transition="p1",
        guidance_scale=0.0,
        temperature=1.0,
        likelihood_tau=torch.zeros(4),
    )
    return ScoredBatch(rb, rewards, parts or {}, None, {}, diversity or {})


def _settings(*overrides):
    from maskgrpo_ray.config import load_config
    from maskgrpo_ray.pipeline.settings import advantage_settings

    return advantage_settings(load_config("configs/toy.yaml", list(overrides)))


def test_the_default_rule_is_plain_grpo_bit_for_bit():
    from maskgrpo_ray.pipeline.phases import make_train_batch

    r = torch.rand(12, generator=torch.Generator().manual_seed(2))
    keep = torch.tensor([True, False, True, True])
    new = make_train_batch(_scored(r), keep, _settings())
    old = make_train_batch(_scored(r), keep, 1e-4)  # the float form: Eq. 12 with that eps
    want = group_advantages(r.view(4, 3)[keep].reshape(-1), 3, 1e-4)
    assert torch.equal(new.advantages, want) and torch.equal(old.advantages, want)


def test_gdpo_reads_the_components_by_name_with_their_weights():
    from maskgrpo_ray.pipeline.phases import batch_advantages

    two = "reward.components=[{kind: toy_rules, weight: 2.0, args: {terms: score, name: s}}, {kind: toy_rules, args: {terms: correct, name: c}}]"
    s = _settings(two, "train.advantage=gdpo")
    assert s.component_weights == {"s": 2.0, "c": 1.0}
    a, c = (
        torch.tensor([0.2, 0.9, 0.5, 0.1, 0.3, 0.3]),
        torch.tensor([0.0, 1.0, 0.0, 0.0, 0.0, 1.0]),
    )
    got = batch_advantages(_scored(2 * a + c, {"s": a, "c": c}), s)
    want = gdpo_advantages(torch.stack([a, c]), torch.tensor([2.0, 1.0]), 3)
    assert torch.equal(got, want)


def test_a_diversity_rule_without_its_figure_is_one_clear_line():
    from maskgrpo_ray.errors import UserError
    from maskgrpo_ray.pipeline.phases import batch_advantages

    s = _settings("train.diversity.kind=gardo")
    with pytest.raises(UserError, match="train.diversity.kind='gardo' needs the per-sample"):
        batch_advantages(_scored(torch.rand(6)), s)
    d = torch.tensor([0.0, 0.1, 0.2, 0.3, 0.0, 0.0])
    got = batch_advantages(
        _scored(torch.tensor([2.0, 2.0, 1.0, 0.0, 1.0, 1.0]), diversity={"diversity/nn": d}), s
    )
    want = gardo_scale(group_advantages(torch.tensor([2.0, 2.0, 1.0, 0.0, 1.0, 1.0]), 3), d, 3)
    assert torch.equal(got, want)


def test_preflight_refuses_a_diversity_rule_no_reward_can_feed():
    from maskgrpo_ray.config import load_config
    from maskgrpo_ray.errors import UserError
    from maskgrpo_ray.pipeline.settings import check_diversity_spaces

    gardo = ["train.diversity.kind=gardo"]
    check_diversity_spaces(load_config("configs/toy.yaml", gardo))  # the toy's reward embeds
    blind = load_config("configs/toy.yaml", [*gardo, "reward.components=[{kind: sim_cost}]"])
    with pytest.raises(UserError, match="no reward component has an image embedding"):
        check_diversity_spaces(blind)


def test_batch_std_divides_each_groups_centred_rewards_by_the_batchs_std():
    from maskgrpo_ray.pipeline.phases import make_train_batch

    r = torch.tensor([1.0, 1.01, 0.99, 0.0, 2.0, 4.0])  # a near-constant group and a spread one
    got = make_train_batch(
        _scored(r), torch.ones(2, dtype=torch.bool), _settings("train.advantage=batch_std")
    ).advantages
    sd = float(torch.tensor(r.tolist()).std())  # unbiased, over all six
    want = [1.0 - 1.0, 1.01 - 1.0, 0.99 - 1.0, 0.0 - 2.0, 2.0 - 2.0, 4.0 - 2.0]
    assert got.tolist() == pytest.approx([w / (sd + 1e-4) for w in want], rel=1e-5)
    # per group (Eq. 12) the near-constant group's noise is blown up to unit size; here not
    assert group_advantages(r, 3).abs()[:3].max() > 0.9 and got.abs()[:3].max() < 0.01


def test_advantage_clip_clamps_after_the_rule_and_zero_changes_nothing():
    from maskgrpo_ray.pipeline.phases import make_train_batch

    r = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 10.0, 1.0, 2.0, 3.0])
    keep = torch.ones(3, dtype=torch.bool)
    plain = make_train_batch(_scored(r), keep, _settings()).advantages
    assert plain.abs().max() > 1.1  # the lone winner of a group of 3: 2 / sqrt(3)
    clipped = make_train_batch(_scored(r), keep, _settings("train.advantage_clip=1.0"))
    assert torch.equal(clipped.advantages, plain.clamp(-1.0, 1.0))
    assert _settings().clip == 0.0
