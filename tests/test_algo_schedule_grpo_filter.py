"""Schedule, advantages, clipped loss, KL and the std-history filter."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from maskgrpo_ray.algo.filtering import StdHistoryFilter, percentile
from maskgrpo_ray.algo.grpo import group_advantages, grpo_loss, select_train_steps
from maskgrpo_ray.algo.schedule import num_masked_after_step, tokens_per_step


def test_tokens_per_step_matches_reference_counts():
    # Show-o's cosine schedule (showlab/Show-o models/sampling.py) at N=256 and S=18, computed
    # in float64, gives re-masked counts [255, 252, 247, ..., 22, 1]. The reference evaluates the cosine in float32, where
    # cos(pi/3) = 0.49999997, so step 11 keeps floor(127.99999) = 127, not 128; the Show-o
    # fixture run below confirms the float32 behaviour (7, not 8, at L=16, S=6, step 3).
    remasked = [255, 252, 247, 240, 232, 221, 209, 196, 181, 164, 146, 127, 108, 87, 66, 44, 22]
    commits = tokens_per_step(256, 18)
    masked = 256
    for t, m in enumerate(remasked):
        masked -= commits[t]
        assert masked == m
    assert sum(commits) == 256 and commits[-1] == 22
    assert sum(tokens_per_step(1024, 50)) == 1024
    assert tokens_per_step(1024, 50)[:4] == [1, 2, 2, 4]


def test_schedule_matches_showo_fixture_run(showo_fixtures):
    from safetensors.torch import load_file

    io = load_file(str(showo_fixtures / "tiny_showo_io.safetensors"))
    cfg = json.loads((showo_fixtures / "tiny_showo_config.json").read_text())
    steps = int(cfg["generation"]["timesteps"])
    ids = io["gen_step_model_input_ids"]  # [S, 2B, seq]
    n_cond = io["cond_input_ids"].shape[0]
    length = io["image_tokens"].shape[1]
    mask_id = int(ids.max())  # the mask token is the largest id in the vocabulary
    image = ids[:, :n_cond, -(length + 1) : -1]  # [S, B, L]
    masked_before = (image == mask_id).sum(-1)  # [S, B]
    for b in range(n_cond):
        masked = int(masked_before[0, b])
        for t in range(steps - 1):
            masked = num_masked_after_step(t, steps, length, masked)
            assert masked == int(masked_before[t + 1, b]), (b, t)


def test_group_advantages_equal_rewards_and_g1():
    adv = group_advantages(torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 2.0]), 3)
    assert torch.equal(adv[:3], torch.zeros(3))
    # group 2: mean 1, unbiased std 1 -> (-1, 0, 1) / (1 + 1e-4)
    torch.testing.assert_close(adv[3:], torch.tensor([-1.0, 0.0, 1.0]) / (1 + 1e-4))
    assert torch.equal(group_advantages(torch.tensor([3.0, 5.0]), 1), torch.zeros(2))


def test_clipped_loss_hand_computed():
    # ratios e^{0.3} = 1.3499, e^{-0.3} = 0.7408, 1; clip [0.8, 1.2].
    logp = torch.tensor([0.3, -0.3, 0.0, 0.3])
    old = torch.zeros(4)
    adv = torch.tensor([1.0, 1.0, -2.0, -1.0])
    # pair 0: A>0, ratio 1.3499 -> min(1.3499, 1.2) * 1 = 1.2   (clipped)
    # pair 1: A>0, ratio 0.7408 -> min(0.7408, 0.8) = 0.7408     (not clipped: pessimistic side)
    # pair 2: A<0, ratio 1 -> -2
    # pair 3: A<0, ratio 1.3499 -> min(-1.3499, -1.2) = -1.3499
    expect = -(1.2 + math.exp(-0.3) - 2.0 - math.exp(0.3)) / 4
    loss, m = grpo_loss(logp, old, adv, clip_low=0.2, clip_high=0.2)
    assert float(loss) == pytest.approx(expect, abs=1e-6)
    assert m["clip_frac"] == pytest.approx(0.25)
    # normalizer: two halves with normalizer 4 add up to the whole
    a, _ = grpo_loss(logp[:2], old[:2], adv[:2], clip_low=0.2, clip_high=0.2, normalizer=4)
    b, _ = grpo_loss(logp[2:], old[2:], adv[2:], clip_low=0.2, clip_high=0.2, normalizer=4)
    assert float(a + b) == pytest.approx(expect, abs=1e-6)


def test_clipped_gradient_is_zero_beyond_clip():
    logp = torch.tensor([0.5], requires_grad=True)
    loss, _ = grpo_loss(logp, torch.zeros(1), torch.tensor([1.0]), clip_low=0.2, clip_high=0.2)
    loss.backward()
    assert float(logp.grad) == 0.0


def test_kl_zero_at_reference_and_nonzero_gradient_away():
    logp = torch.tensor([-1.0, -2.0], requires_grad=True)
    adv = torch.zeros(2)
    loss, m = grpo_loss(
        logp,
        logp.detach(),
        adv,
        clip_low=0.2,
        clip_high=0.2,
        ref_logp=logp.detach().clone(),
        kl_coef=0.1,
    )
    assert m["kl"] == 0.0 and float(loss.detach()) == 0.0
    ref = torch.tensor([-1.5, -1.0])
    loss, m = grpo_loss(
        logp, logp.detach(), adv, clip_low=0.2, clip_high=0.2, ref_logp=ref, kl_coef=0.1
    )
    loss.backward()
    # By hand, d = ref - logp = [-1.5 - (-1), -1 - (-2)] = [-0.5, 1.0]:
    #   k3 = exp(d) - d - 1 = [e^-0.5 - 0.5, e - 2] = [0.1065306597, 0.7182818285],
    #   mean k3 = 0.4124062441; A = 0 so the surrogate adds nothing and
    #   loss = beta * mean k3 = 0.1 * 0.4124062441 = 0.0412406244.
    #   d k3 / d logp = (exp(d) - 1) * dd/dlogp = (exp(d) - 1) * (-1) = 1 - exp(d)
    #                 = [1 - e^-0.5, 1 - e] = [0.3934693403, -1.7182818285],
    #   times beta / M = 0.1 / 2: grad = [0.0196734670, -0.0859140914].
    assert m["kl"] == pytest.approx(0.4124062441, abs=1e-7)
    assert float(loss.detach()) == pytest.approx(0.0412406244, abs=1e-8)
    torch.testing.assert_close(
        logp.grad, torch.tensor([0.0196734670, -0.0859140914]), rtol=0, atol=1e-8
    )


def test_select_train_steps():
    assert select_train_steps(6, "all", 0).tolist() == list(range(6))
    assert select_train_steps(6, "first", 2).tolist() == [0, 1]
    assert select_train_steps(6, "last", 2).tolist() == [4, 5]
    r = select_train_steps(6, "random", 3, torch.Generator().manual_seed(0))
    assert len(set(r.tolist())) == 3 and r.tolist() == sorted(r.tolist())
    with pytest.raises(ValueError, match="k must be"):
        select_train_steps(6, "first", 7)


def test_percentile_matches_numpy():
    rng = np.random.default_rng(0)
    for n in (1, 2, 5, 37):
        xs = rng.random(n).tolist()
        for q in (0, 10, 50, 99.5, 100):
            assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))


def test_filter_warmup_and_percentile_on_hand_made_history():
    f = StdHistoryFilter(percentile_q=10, warmup_groups=10, max_history=100)
    # Warm-up: the first 10 groups are kept whatever their std (even 0).
    for s in [0.0, 1, 2, 3, 4, 5, 6, 7, 8, 9]:
        assert f.decide(float(s))
    # History 0..9: 10th percentile = 0 + 0.9 * (1 - 0) = 0.9.
    assert f.threshold() == pytest.approx(0.9)
    assert not f.decide(0.5)  # dropped, and recorded
    assert f.dropped == 1 and f.seen == 11
    # History now 0..9 + 0.5 (11 values): pos = 1.0 -> sorted[1] = 0.5
    assert f.threshold() == pytest.approx(0.5)
    assert f.decide(0.5)  # equal to the threshold is kept (only strictly below drops)
    restored = StdHistoryFilter.from_state_dict(f.state_dict())
    assert restored.state_dict() == f.state_dict()
    assert restored.threshold() == f.threshold()


def test_filter_bounded_history_and_bad_percentile():
    f = StdHistoryFilter(percentile_q=50, warmup_groups=1, max_history=3)
    for s in [10.0, 20.0, 30.0, 40.0]:
        f.decide(s)
    assert list(f.history) == [20.0, 30.0, 40.0]
    with pytest.raises(ValueError, match="percentile_q"):
        StdHistoryFilter(percentile_q=150)


@pytest.mark.parametrize("enabled", [True, False])
def test_filter_copy_restarts_a_filter_with_the_same_future(enabled):
    """A filter actor restarted from a copy's state (the driver's ``filter_copy``, the same
    class fed the same groups) decides every later group as the original would: the sliding
    window's overflow and invalid groups included."""
    from maskgrpo_ray.actors.filter import FilterActor
    from maskgrpo_ray.pipeline.settings import FilterSettings

    settings = FilterSettings(enabled, 10.0, warmup_groups=3, max_history=5)
    actor, copy = FilterActor(settings), FilterActor(settings)
    gen = torch.Generator().manual_seed(0)
    calls = []
    for call in range(8):
        rewards = torch.rand(4 * 3, generator=gen)
        if call % 3 == 1:
            rewards[4] = float("nan")  # group 1 invalid
        calls.append(rewards)
    for rewards in calls[:5]:
        a, b = actor.filter(rewards, 3), copy.filter(rewards, 3)
        assert torch.equal(a.keep, b.keep) and torch.equal(a.invalid, b.invalid)
    restarted = FilterActor(settings)
    restarted.load_state_dict(copy.state_dict())
    assert restarted.state_dict() == actor.state_dict()
    for rewards in calls[5:]:
        a, b = actor.filter(rewards, 3), restarted.filter(rewards, 3)
        assert torch.equal(a.keep, b.keep) and torch.equal(a.invalid, b.invalid)
        assert restarted.stats() == actor.stats()
    state = restarted.state_dict()
    if enabled:
        assert len(state["filter"]["history"]) == 5 and state["filter"]["seen"] > 5
        # the window overflowed and groups were dropped: the test exercised the decisions
        assert state["filter"]["dropped"] > 0
