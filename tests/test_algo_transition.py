"""Transition log-probabilities (Eq. 13-15) against brute force and Monte Carlo."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from maskgrpo_ray.algo.sampling import rollout, unmask_step
from maskgrpo_ray.algo.schedule import num_masked_after_step, tokens_per_step
from maskgrpo_ray.algo.transition import step_log_prob


def _sample_next(
    logits: torch.Tensor, tokens: torch.Tensor, step: int, steps: int, n: int, seed: int
):
    """Run one tau=0 step on n copies of the same state; return (unmasked, sampled)."""
    g = torch.Generator().manual_seed(seed)
    out = unmask_step(logits.expand(n, -1, -1), tokens.expand(n, -1), step, steps, 0.0, generator=g)
    return out.unmasked, out.sampled


def _outcome_counts(unmasked: torch.Tensor, sampled: torch.Tensor):
    counts: dict[tuple, int] = {}
    keys = torch.where(unmasked, sampled, -1)
    uniq, cnt = torch.unique(keys, dim=0, return_counts=True)
    for row, c in zip(uniq.tolist(), cnt.tolist()):
        counts[tuple(row)] = c
    return counts


def _logp_of(outcome, logits, tokens, kind):
    vocab = logits.shape[-1]
    unmasked = torch.tensor([[x >= 0 for x in outcome]])
    toks = torch.tensor([[max(x, 0) for x in outcome]])
    return float(step_log_prob(logits, tokens == vocab, unmasked, toks, kind)[0])


@pytest.mark.parametrize("seed", [0, 1])
def test_p1_matches_monte_carlo_figure3(seed):
    # Paper Figure 3: 4 tokens, codebook 4, one token committed from the fully masked state.
    # With S = 3, m_0 = max(1, min(3, floor(4 cos(pi/6)))) = 3, so step 0 commits exactly one.
    assert tokens_per_step(4, 3)[0] == 1
    torch.manual_seed(100 + seed)
    logits = torch.randn(1, 4, 4) * 1.5  # distinct per position: ties have probability 0
    tokens = torch.full((1, 4), 4)
    n = 200_000
    counts = _outcome_counts(*_sample_next(logits, tokens, 0, 3, n, seed))
    # Exactness: the p1 probabilities of all 16 possible next states sum to 1.
    outcomes = [tuple(y if j == i else -1 for j in range(4)) for i in range(4) for y in range(4)]
    p1 = {o: math.exp(_logp_of(o, logits, tokens, "p1")) for o in outcomes}
    assert sum(p1.values()) == pytest.approx(1.0, abs=1e-5)
    worst_p2_z = 0.0
    for o in outcomes:
        freq = counts.get(o, 0) / n
        sigma = math.sqrt(max(p1[o] * (1 - p1[o]), 1e-12) / n)
        assert abs(freq - p1[o]) < 5 * sigma + 1e-6, (o, freq, p1[o])
        p2 = math.exp(_logp_of(o, logits, tokens, "p2"))
        worst_p2_z = max(worst_p2_z, abs(freq - p2) / max(sigma, 1e-9))
    # The wrong formula (Eq. 15 read as the probability of the transition) fails this bound.
    assert worst_p2_z > 20


def test_p1_matches_monte_carlo_partial_state():
    # 6 positions, codebook 3, two already committed, step 1 of S = 3. The schedule keeps
    # floor(6 cos(pi/3)) = 2 masked (float32 cosine is just under 0.5), so 2 of the 4 masked
    # positions commit: 6 position pairs x 3^2 tokens = 54 possible next states.
    torch.manual_seed(7)
    vocab, steps = 3, 3
    logits = torch.randn(1, 6, vocab) * 1.2
    tokens = torch.tensor([[vocab, 2, vocab, vocab, 0, vocab]])
    masked_pos = [0, 2, 3, 5]
    k = 4 - num_masked_after_step(1, steps, 6, 4)
    assert k == 2
    n = 300_000
    counts = _outcome_counts(*_sample_next(logits, tokens, 1, steps, n, 3))
    total = 0.0
    for pos in itertools.combinations(masked_pos, k):
        for ys in itertools.product(range(vocab), repeat=k):
            o = [-1] * 6
            for i, y in zip(pos, ys):
                o[i] = y
            p = math.exp(_logp_of(tuple(o), logits, tokens, "p1"))
            total += p
            freq = counts.get(tuple(o), 0) / n
            assert abs(freq - p) < 5 * math.sqrt(max(p * (1 - p), 1e-12) / n) + 1e-5, (o, freq, p)
    assert sum(counts.values()) == n
    assert total == pytest.approx(1.0, abs=1e-5)


def test_p2_and_ar_hand_computed():
    # 1 sample, 3 positions, V = 2; logits chosen so log-probs are known in closed form.
    logits = torch.tensor([[[0.0, 0.0], [math.log(3.0), 0.0], [0.0, math.log(4.0)]]])
    masked = torch.tensor([[True, True, True]])
    unmasked = torch.tensor([[False, True, False]])
    tokens = torch.tensor([[1, 0, 1]])
    # p2 = log p^1(0) = log(3/4)
    assert float(step_log_prob(logits, masked, unmasked, tokens, "p2")) == pytest.approx(
        math.log(0.75), abs=1e-6
    )
    # ar = log(1/2) + log(3/4) + log(4/5)
    expect = math.log(0.5) + math.log(0.75) + math.log(0.8)
    assert float(step_log_prob(logits, masked, unmasked, tokens, "ar")) == pytest.approx(
        expect, abs=1e-6
    )
    # p1: theta = 3/4; position 0 has both probs 1/2 < 3/4 -> q = 1; position 2 has 1/5 < 3/4
    # and 4/5 >= 3/4 -> q = 1/5. p1 = log(3/4) + log(1) + log(1/5).
    expect = math.log(0.75) + math.log(0.2)
    assert float(step_log_prob(logits, masked, unmasked, tokens, "p1")) == pytest.approx(
        expect, abs=1e-6
    )


def test_empty_sets_contribute_zero_and_gradients_are_finite():
    logits = torch.randn(3, 5, 7, requires_grad=True)
    masked = torch.tensor([[True] * 5, [False] * 5, [True, True, False, False, False]])
    # row 0: nothing committed (empty U_t); row 1: nothing masked; row 2: all masked committed
    unmasked = torch.tensor([[False] * 5, [False] * 5, [True, True, False, False, False]])
    tokens = torch.randint(0, 7, (3, 5))
    for kind in ("p1", "p2"):
        lp = step_log_prob(logits, masked, unmasked, tokens, kind)
        assert lp[0] == 0 and lp[1] == 0
        lp.sum().backward()
        assert torch.isfinite(logits.grad).all()
        logits.grad = None


def test_p1_empty_below_set_is_floored_not_nan():
    # The committed token is the least likely entry at position 0, so at the remasked
    # position 1 (a copy of it) nothing lies strictly below theta.
    logits = torch.tensor([[[0.0, 1.0, 2.0], [0.0, 1.0, 2.0]]], requires_grad=True)
    lp = step_log_prob(
        logits,
        torch.tensor([[True, True]]),
        torch.tensor([[True, False]]),
        torch.tensor([[0, 0]]),
        "p1",
    )
    assert torch.isfinite(lp).all()
    lp.sum().backward()
    assert torch.isfinite(logits.grad).all()


def test_rollout_old_logp_equals_recomputation():
    torch.manual_seed(0)
    n, length, vocab, steps = 5, 9, 6, 4
    w = torch.randn(vocab + 1, length, vocab)

    def logits_fn(tok):  # a fixed random "policy" that depends on the whole state
        onehot = torch.nn.functional.one_hot(tok, vocab + 1).float()  # [N, L, V+1]
        ctx = onehot.mean(1)  # [N, V+1]
        return torch.einsum("nv,vlk->nlk", ctx, w) + onehot[..., :vocab]

    from maskgrpo_ray.algo.sampling import replay_states

    for kind in ("p1", "p2", "ar"):
        traj = rollout(
            logits_fn,
            torch.full((n, length), vocab),
            vocab,
            num_steps=steps,
            temperature=0.8,
            gumbel_temperature=1.0,
            kind=kind,
            generator=torch.Generator().manual_seed(1),
        )
        assert (traj.final_tokens < vocab).all()
        for t in range(steps):
            st = torch.full((n,), t)
            tok, masked, unmasked = replay_states(traj.final_tokens, traj.unmask_step, st, vocab)
            toks = traj.sampled[:, t] if kind == "ar" else traj.final_tokens
            tau = traj.likelihood_tau[t]  # the step's Gumbel temperature (p1: the marginal)
            lp = step_log_prob(logits_fn(tok) / 0.8, masked, unmasked, toks, kind, gumbel_tau=tau)
            torch.testing.assert_close(lp, traj.old_logp[:, t], rtol=0, atol=1e-5)
        # tau_0 = 1 over 4 steps: tau_t = .75, .375, .094, 0 (Show-o's compounding anneal)
        expect = torch.tensor([0.75, 0.375, 0.09375, 0.0])
        torch.testing.assert_close(traj.likelihood_tau, expect, rtol=0, atol=1e-7)
