"""Guards of the clipped objective: log-ratio clamp, dual-clip, clamped k3, KL normalisation.

Every expectation is computed by hand in the comments; the unguarded value is shown to be what
the guard exists for (an overflow or a runaway term), so each test fails if its guard is removed.
"""

from __future__ import annotations

import math

import pytest
import torch

from maskgrpo_ray.algo.grpo import grpo_loss, k3_kl
from maskgrpo_ray.config import ConfigError, load_config
from maskgrpo_ray.pipeline.learner_loss import abs_log_ratio_stats, pair_query


def _t(*xs: float) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.float32)


def test_log_ratio_clamp_keeps_an_exploded_ratio_finite():
    # logp - old = 100 nats (a p1 threshold flip on a 1024-token step): exp(100) overflows
    # float32 (max ~3.4e38 = exp(88.7)), so with A = -1 the unguarded loss is +inf.
    logp, old, adv = _t(0.0).requires_grad_(), _t(-100.0), _t(-1.0)
    plain, _ = grpo_loss(logp, old, adv, clip_low=0.2, clip_high=0.28)
    assert math.isinf(float(plain.detach()))
    # clamped at 20: surrogate = min(e^20 * -1, 1.28 * -1) = -e^20, loss = e^20
    loss, _ = grpo_loss(logp, old, adv, clip_low=0.2, clip_high=0.28, log_ratio_clamp=20.0)
    assert float(loss.detach()) == pytest.approx(math.exp(20.0), rel=1e-6)
    loss.backward()
    # the clamp is flat beyond 20 nats: no gradient through the exploded pair
    assert float(logp.grad) == 0.0


def test_dual_clip_floors_negative_advantages_at_c_times_a():
    # three pairs, A = -2 for the first two, +1 for the third; clip range [0.8, 1.28], c = 3.
    # pair 0: ratio e^0.5 = 1.6487: min(-3.2974, 1.28 * -2 = -2.56) = -3.2974 > -6: not floored
    # pair 1: ratio e^1.5 = 4.4817: min(-8.9634, -2.56) = -8.9634 < 3 * -2 = -6: floored to -6
    # pair 2: ratio e^0.1 = 1.1052, A = +1: min(1.1052, 1.1052) = 1.1052 (dual-clip ignores A > 0)
    logp = _t(0.5, 1.5, 0.1).requires_grad_()
    old, adv = _t(0.0, 0.0, 0.0), _t(-2.0, -2.0, 1.0)
    loss, m = grpo_loss(logp, old, adv, clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    expect = -(-2 * math.exp(0.5) - 6.0 + math.exp(0.1)) / 3
    assert float(loss.detach()) == pytest.approx(expect, rel=1e-6)
    assert m["dual_clip_frac"] == pytest.approx(1 / 3)
    loss.backward()
    # d/dlogp of -(ratio * A)/3 = -ratio * A / 3; the floored pair has none
    grad = [-math.exp(0.5) * -2 / 3, 0.0, -math.exp(0.1) / 3]
    torch.testing.assert_close(logp.grad, _t(*grad), rtol=1e-6, atol=0)
    # without dual-clip pair 1 contributes -8.9634
    plain, _ = grpo_loss(logp.detach(), old, adv, clip_low=0.2, clip_high=0.28)
    assert float(plain) == pytest.approx(
        -(-2 * math.exp(0.5) - 2 * math.exp(1.5) + math.exp(0.1)) / 3
    )


def test_dual_clip_must_exceed_one():
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        grpo_loss(_t(0.0), _t(0.0), _t(1.0), clip_low=0.2, clip_high=0.2, dual_clip=1.0)


def test_k3_per_token_normalisation_by_hand():
    # d = ref - logp = 6 nats over a transition of n = 3 tokens.
    # per transition: e^6 - 6 - 1 = 396.4288; per token: k3(6 / 3) = e^2 - 2 - 1 = 4.3891
    # gradient per token: d/dlogp [exp(d/n) - d/n - 1] = -(exp(d/n) - 1) / n = -2.1297
    logp, ref = _t(-10.0).requires_grad_(), _t(-4.0)
    per_transition = k3_kl(ref, logp)
    assert float(per_transition) == pytest.approx(math.exp(6) - 7, rel=1e-6)
    per_token = k3_kl(ref, logp, num_tokens=_t(3.0))
    assert float(per_token) == pytest.approx(math.exp(2) - 3, rel=1e-6)
    per_token.backward()
    assert float(logp.grad) == pytest.approx(-(math.exp(2) - 1) / 3, rel=1e-6)


def test_k3_clamp_bounds_the_term():
    # d = 100: exp(100) overflows float32; clamped at 10 the term is e^10 - 10 - 1 = 22015.47
    logp, ref = _t(-100.0).requires_grad_(), _t(0.0)
    assert math.isinf(float(k3_kl(ref, logp.detach())))
    kl = k3_kl(ref, logp, clamp=10.0)
    assert float(kl) == pytest.approx(math.exp(10) - 11, rel=1e-6)
    kl.backward()
    assert float(logp.grad) == 0.0
    # inside the range the clamp changes nothing: d = -0.5 -> e^-0.5 + 0.5 - 1 = 0.10653
    assert float(k3_kl(_t(-1.5), _t(-1.0), clamp=10.0)) == pytest.approx(
        math.exp(-0.5) - 0.5, rel=1e-6
    )


def test_grpo_loss_kl_term_uses_the_normalisation():
    # ratio 1 and A = 0: the loss is beta * k3 alone; beta = 0.5, d = 6 over 3 tokens
    logp, old, adv, ref = _t(-10.0), _t(-10.0), _t(0.0), _t(-4.0)
    loss, m = grpo_loss(
        logp, old, adv, clip_low=0.2, clip_high=0.2, ref_logp=ref, kl_coef=0.5, kl_num_tokens=_t(3)
    )
    assert float(loss.detach()) == pytest.approx(0.5 * (math.exp(2) - 3), rel=1e-6)
    assert m["kl"] == pytest.approx(math.exp(2) - 3, rel=1e-6)


def test_pair_num_tokens_counts_the_likelihoods_tokens():
    from types import SimpleNamespace

    # one sample, L = 5, commit steps [0, 1, 1, 2, -1] (the last position was given)
    commit = torch.tensor([[0, 1, 1, 2, -1]])
    final = torch.tensor([[1, 2, 3, 0, 1]])
    samples, steps = torch.tensor([0, 0, 0]), torch.tensor([0, 1, 2])
    for transition, expect in (("p2", [1, 2, 1]), ("p1", [4, 3, 1]), ("ar", [4, 3, 1])):
        batch = SimpleNamespace(
            estimator="trajectory",
            final_tokens=final,
            unmask_step=commit,
            transition=transition,
            sampled=None,
            likelihood_tau=torch.zeros(3),
        )
        # p2 covers U_t (commit == t); p1 and ar every position masked at t (commit >= t)
        q = pair_query(batch, samples, steps, codebook_size=4)
        torch.testing.assert_close(q.num_tokens, _t(*expect))
    # forward: the re-masked tokens (sum), or 1 (mean: already per token)
    for reduction, expect in (("sum", [2, 5, 1]), ("mean", [1, 1, 1])):
        batch = SimpleNamespace(
            estimator="forward",
            final_tokens=final,
            mask_seed=torch.tensor([7]),
            mask_counts=torch.tensor([[2, 5, 1]]),
            forward_reduction=reduction,
            forward_coupling="none",
        )
        q = pair_query(batch, samples, steps, codebook_size=4)
        torch.testing.assert_close(q.num_tokens, _t(*expect))


def test_abs_log_ratio_stats_by_hand():
    # |log-ratio| 0.1, 0.3 at step 0 and 0.0, 2.0 at step 1: mean 0.6, max 2.0, step 1 worst
    # (mean 1.0 vs 0.2); p90 by linear interpolation over sorted [0, .1, .3, 2]: 0.3 + 0.7 * 1.7
    stats = abs_log_ratio_stats(_t(0.1, 0.3, 0.0, 2.0), torch.tensor([0, 0, 1, 1]))
    assert stats["abs_log_ratio_mean"] == pytest.approx(0.6)
    assert stats["abs_log_ratio_max"] == pytest.approx(2.0)
    assert stats["abs_log_ratio_worst_step"] == 1.0
    assert stats["abs_log_ratio_p90"] == pytest.approx(0.3 + 0.7 * 1.7)


def test_rank_metrics_reduce_max_by_max():
    from maskgrpo_ray.learner.group import reduce_rank_metrics

    outs = [
        {"loss": 1.0, "abs_log_ratio_max": 0.5, "abs_log_ratio_worst_step": 3.0},
        {"loss": 3.0, "abs_log_ratio_max": 2.5, "abs_log_ratio_worst_step": 7.0},
    ]
    out = reduce_rank_metrics(outs)
    assert out == {"loss": 2.0, "abs_log_ratio_max": 2.5, "abs_log_ratio_worst_step": 7.0}


def test_config_rejects_a_dual_clip_at_or_below_one():
    with pytest.raises(ConfigError, match=r"train.dual_clip=0.9.*must exceed 1"):
        load_config(None, ["train.dual_clip=0.9"])
    assert load_config(None, ["train.dual_clip=0"]).train.dual_clip == 0.0
