"""Gumbel-marginal transition probability: Monte Carlo against Show-o's sampler, the tau -> 0
limit (Eq. 14), an independent float64 integration, exact policy gradients and edge cases."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

import maskgrpo_ray.algo.gumbel_quadrature as quadrature
from maskgrpo_ray.algo.gumbel import gumbel_marginal_log_prob, remask_taus
from maskgrpo_ray.algo.sampling import unmask_step
from maskgrpo_ray.algo.schedule import num_masked_after_step
from maskgrpo_ray.algo.transition import step_log_prob


def _reference_log_prob(logp, masked, unmasked, tokens, tau, h=0.01):
    """Independent float64 value for one row: ``log prod p(y_U) + log int H(m) dF_R(m)``.

    The other side of the integration by parts (``int F_R (-dH)`` is what the library sums),
    in plain (not log-space) float64 with the trapezoid rule on a fixed ``h``-grid spanning every
    location ``log p / tau`` (minus 12, plus 60 units). ``dF_R = F_R sum_j F_j' / F_j``.
    """
    logp = logp.double()
    u = (masked & unmasked).nonzero().squeeze(-1)
    r = (masked & ~unmasked).nonzero().squeeze(-1)
    a = logp[u, tokens[u]]
    locs = torch.cat([a / tau, (logp[r] / tau).flatten()])
    locs = locs[locs > -1e6]
    m = torch.arange(float(locs.min()) - 12, float(locs.max()) + 60, h, dtype=torch.float64)
    big_h = (-torch.expm1(-torch.exp((a / tau)[:, None] - m))).prod(0)  # P(min_U s > m)
    p = logp[r].exp()[:, :, None]  # [R, V, 1]
    e = torch.exp(logp[r][:, :, None] / tau - m)  # [R, V, M]
    f_j = (p * torch.exp(-e)).sum(1)  # [R, M]
    df_j = (p * e * torch.exp(-e)).sum(1)
    df_r = f_j.prod(0) * (df_j / f_j.clamp(min=1e-300)).sum(0)
    return float(a.sum() + torch.log(torch.trapezoid(big_h * df_r, m)))


# -- 1. Monte Carlo against the sampler ------------------------------------------------------

VOCAB = 3
MASKED_POS = [0, 2, 3, 5]


def _mc_case():
    # 6 positions, codebook 3, two already committed; step 1 of S = 3 keeps
    # floor(6 cos(pi/3)) = 2 masked (float32 cosine just under 0.5), so 2 of the 4 commit:
    # 6 position pairs x 3^2 tokens = 54 possible next states.
    torch.manual_seed(7)
    logits = torch.randn(1, 6, VOCAB) * 1.2
    tokens = torch.tensor([[VOCAB, 2, VOCAB, VOCAB, 0, VOCAB]])
    assert num_masked_after_step(1, 3, 6, 4) == 2
    outcomes = []
    for pos in itertools.combinations(MASKED_POS, 2):
        for ys in itertools.product(range(VOCAB), repeat=2):
            o = [-1] * 6
            for i, y in zip(pos, ys):
                o[i] = y
            outcomes.append(tuple(o))
    return logits, tokens, outcomes


def _outcome_log_probs(logits, tokens, outcomes, tau):
    """(marginal, Eq. 14) log-probabilities of each outcome, one row per outcome."""
    n = len(outcomes)
    unmasked = torch.tensor([[x >= 0 for x in o] for o in outcomes])
    toks = torch.tensor([[max(x, 0) for x in o] for o in outcomes])
    masked = (tokens == VOCAB).expand(n, -1)
    lg = logits.expand(n, -1, -1)
    marginal = gumbel_marginal_log_prob(
        torch.log_softmax(lg, -1), masked, unmasked, toks, torch.full((n,), tau)
    )
    return marginal, step_log_prob(lg, masked, unmasked, toks, "p1")


@pytest.mark.parametrize("tau_used", [0.5, 1.0])
def test_marginal_matches_the_sampler_and_eq14_does_not(tau_used):
    logits, tokens, outcomes = _mc_case()
    n = 200_000
    g = torch.Generator().manual_seed(11)
    # unmask_step uses tau * (1 - (t+1)/S) = tau * (1 - 2/3) at t = 1 of S = 3
    out = unmask_step(
        logits.expand(n, -1, -1), tokens.expand(n, -1), 1, 3, 3 * tau_used, generator=g
    )
    assert out.tau == pytest.approx(tau_used, abs=1e-12)
    keys = torch.where(out.unmasked, out.sampled, -1)
    uniq, cnt = torch.unique(keys, dim=0, return_counts=True)
    counts = {tuple(k): c for k, c in zip(uniq.tolist(), cnt.tolist())}
    assert set(counts) <= set(outcomes)
    marginal, p1 = _outcome_log_probs(logits, tokens, outcomes, out.tau)
    probs = marginal.double().exp()
    assert float(probs.sum()) == pytest.approx(1.0, abs=1e-5)  # a law over the 54 states
    freq = torch.tensor([counts.get(o, 0) / n for o in outcomes], dtype=torch.float64)

    def z_scores(p):
        return (freq - p) / torch.sqrt((p * (1 - p)).clamp(min=1e-12) / n)

    z_marginal = z_scores(probs).abs().max()
    # Eq. 14 gives ~0 (its floor) to states the noisy sampler reaches; judge it on the others too
    z_p1 = z_scores(p1.double().exp()).abs()
    z_p1_unfloored = z_p1[p1 > -60].max()
    print(
        f"\ntau={tau_used}: max |z| marginal {z_marginal:.2f}; Eq. 14 (p1) {z_p1.max():.3g}, "
        f"{z_p1_unfloored:.1f} over its {int((p1 > -60).sum())} unfloored states"
    )
    assert z_marginal < 4.5
    assert z_p1_unfloored > 10  # the bound is sharp enough to reject Eq. 14 at this tau


# -- 2. the tau -> 0 limit is Eq. 14 ------------------------------------------------------------


def test_small_tau_is_eq14_and_empty_remask_is_eq15():
    torch.manual_seed(1)
    n, length, vocab = 256, 8, 5
    logits = torch.randn(n, length, vocab) * 2
    masked = torch.rand(n, length) < 0.8
    unmasked = masked & (torch.rand(n, length) < 0.4)
    tokens = torch.randint(0, vocab, (n, length))
    logp = torch.log_softmax(logits, -1)
    # "Distinct confidences": every remasked log-probability is >= 0.05 nats from log theta, so
    # the Gumbel corrections are below exp(-0.05 / 1e-3) = e^-50; and every remasked position
    # has a token below theta (Eq. 14 is not floored).
    tok = logp.gather(-1, tokens[..., None]).squeeze(-1)
    committed, remasked = masked & unmasked, masked & ~unmasked
    log_theta = torch.where(committed, tok, torch.inf).amin(-1)
    gap = torch.where(remasked[..., None], (logp - log_theta[:, None, None]).abs(), torch.inf)
    below = ((logp < log_theta[:, None, None]).any(-1) | ~remasked).all(-1)
    keep = committed.any(-1) & remasked.any(-1) & (gap.amin((1, 2)) > 0.05) & below
    assert int(keep.sum()) >= 30
    p1 = step_log_prob(logits, masked, unmasked, tokens, "p1")
    for tau in (1e-3, 1e-4):  # measured: 4e-6 and 2e-6, float32 ulps of |log P| <= 37
        got = gumbel_marginal_log_prob(logp, masked, unmasked, tokens, torch.full((n,), tau))
        torch.testing.assert_close(got[keep], p1[keep], rtol=0, atol=2e-5)
    # and at tau = 1e-2 the Gumbel corrections (about e^{-0.05/0.01}) are visible
    got = gumbel_marginal_log_prob(logp, masked, unmasked, tokens, torch.full((n,), 1e-2))
    assert float((got - p1)[keep].abs().max()) > 1e-2
    # Empty R (Show-o's last step): exactly sum_U log p(y), i.e. Eq. 15 (= Eq. 14 there).
    got = gumbel_marginal_log_prob(logp, masked, masked, tokens, torch.full((n,), 0.7))
    assert torch.equal(got, step_log_prob(logits, masked, masked, tokens, "p2"))


# -- 3. accuracy against an independent float64 integration -----------------------------------


def _random_case(seed, length, vocab, scale, commit_frac):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(length, vocab, generator=g) * scale
    masked = torch.rand(length, generator=g) < 0.85
    masked[:2] = True
    unmasked = masked & (torch.rand(length, generator=g) < commit_frac)
    unmasked[0], unmasked[1] = True, False
    return logits, masked, unmasked, torch.randint(0, vocab, (length,), generator=g)


def _rare_case():
    # Committed token with p = 0.015 against 8 remasked positions that each put 0.97 on one
    # token: the remasked draws must all be tail tokens (0.03^8 = e^-28) or every Gumbel must
    # lift the committed score 28 units over 8 confident ones (about e^-30): I is about e^-27.5
    # and the integrand is bimodal, 28 units between the modes.
    logits = torch.full((9, 4), math.log(0.01))
    logits[1:, 0] = math.log(0.97)
    logits[0] = torch.log(torch.tensor([0.015, 0.3, 0.3, 0.385]))
    masked = torch.ones(9, dtype=torch.bool)
    unmasked = torch.zeros(9, dtype=torch.bool)
    unmasked[0] = True
    return logits, masked, unmasked, torch.zeros(9, dtype=torch.long)


CASES = [
    (tau, _random_case(s, 10, 6, 1 + s, 0.2 + 0.1 * s))
    for tau in (1.0, 0.5, 0.1, 0.03)
    for s in range(4)
]
CASES += [(0.3, _random_case(9, 32, 64, 2.0, 0.15)), (0.15, _rare_case())]


def test_default_quadrature_matches_independent_float64_integration():
    worst = 0.0
    for tau, (logits, masked, unmasked, tokens) in CASES:
        logp = torch.log_softmax(logits, -1)  # float32, the production dtype
        ref = _reference_log_prob(logp, masked, unmasked, tokens, tau)
        got = gumbel_marginal_log_prob(logp[None], masked[None], unmasked[None], tokens[None], tau)
        got64 = gumbel_marginal_log_prob(
            logp[None].double(), masked[None], unmasked[None], tokens[None], tau
        )
        # float32 resolves log P to about one ulp of |log P|; float64 shows the method's own error
        assert abs(float(got) - ref) < 1e-4 + 2e-7 * abs(ref), (tau, float(got), ref)
        assert abs(float(got64) - ref) < 1e-8 * max(1.0, abs(ref)), (tau, float(got64), ref)
        worst = max(worst, abs(float(got) - ref))
    rare = _reference_log_prob(torch.log_softmax(_rare_case()[0], -1), *_rare_case()[1:], 0.15)
    assert -40 < rare < -25  # the case is as rare as the comment says
    print(f"\nmax |log P error| float32 default over {len(CASES)} cases: {worst:.2e}")


def test_batching_chunking_and_top_k_agree():
    tau, (logits, masked, unmasked, tokens) = CASES[-2]  # L = 32, V = 64
    logp = torch.log_softmax(logits.double(), -1)[None].requires_grad_(True)
    args = (masked[None], unmasked[None], tokens[None], tau)
    full = gumbel_marginal_log_prob(logp, *args)
    (grad,) = torch.autograd.grad(full.sum(), logp)
    old = quadrature._BLOCK_ELEMENTS
    quadrature._BLOCK_ELEMENTS = 64  # one position, a few nodes per block
    try:
        small = gumbel_marginal_log_prob(logp, *args)
        (grad_small,) = torch.autograd.grad(small.sum(), logp)
    finally:
        quadrature._BLOCK_ELEMENTS = old
    torch.testing.assert_close(small, full, rtol=0, atol=1e-12)
    torch.testing.assert_close(grad_small, grad, rtol=0, atol=1e-12)
    # A row's value does not depend on the other rows of the batch.
    batch = [CASES[i][1] for i in (0, 5, 10)]
    lp = torch.stack([torch.log_softmax(c[0].double(), -1) for c in batch])
    together = gumbel_marginal_log_prob(
        lp, *(torch.stack([c[i] for c in batch]) for i in (1, 2, 3)), 0.5
    )
    alone = [
        gumbel_marginal_log_prob(lp[i : i + 1], c[1][None], c[2][None], c[3][None], 0.5)
        for i, c in enumerate(batch)
    ]
    torch.testing.assert_close(together, torch.cat(alone), rtol=0, atol=1e-9)
    # top_k >= V is the exact path. With random (not sampled) committed tokens theta sits deep
    # in the remasked tails, the hard case for the fold: top-k plus two Gauss atoms per
    # half-unit location bin still agrees to 1e-5 (one Jensen atom per bucket was off by 1.6).
    assert torch.equal(gumbel_marginal_log_prob(logp, *args, top_k=64), full)
    for k in (1, 4, 16):
        trunc = gumbel_marginal_log_prob(logp, *args, top_k=k)
        assert abs(float((trunc - full).detach())) < 1e-5, k


# -- 4. gradients --------------------------------------------------------------------------------


def _tabular_gradients(tau, seed=0):
    """Exact score-function gradients on L = 4, V = 3, one commit, against grad E[r].

    Returns {kind: (cosine, norm ratio)} and the marginal's total probability and its
    finite-difference gradient error.
    """
    g = torch.Generator().manual_seed(seed)
    theta = torch.randn(4, 3, generator=g, dtype=torch.float64).requires_grad_(True)
    reward = torch.rand(12, generator=g, dtype=torch.float64)
    outcomes = [(i, y) for i in range(4) for y in range(3)]  # commit y at position i
    masked = torch.ones(12, 4, dtype=torch.bool)
    unmasked = torch.zeros(12, 4, dtype=torch.bool)
    tokens = torch.zeros(12, 4, dtype=torch.long)
    for o, (i, y) in enumerate(outcomes):
        unmasked[o, i], tokens[o, i] = True, y

    def log_probs(th, kind):
        if kind == "marginal":
            lp = torch.log_softmax(th, -1)[None].expand(12, -1, -1)
            return gumbel_marginal_log_prob(lp, masked, unmasked, tokens, tau)
        return step_log_prob(th[None].expand(12, -1, -1), masked, unmasked, tokens, kind)

    def expected_reward(th):
        return (log_probs(th, "marginal").exp() * reward).sum()

    (true_grad,) = torch.autograd.grad(expected_reward(theta), theta)
    probs = log_probs(theta, "marginal").exp().detach()
    coef = probs * (reward - (probs * reward).sum())  # P_true(o) (r(o) - b), b = E[r]
    table = {}
    for kind in ("marginal", "p1", "p2"):
        (est,) = torch.autograd.grad((coef * log_probs(theta, kind)).sum(), theta)
        cos = float(torch.nn.functional.cosine_similarity(est.flatten(), true_grad.flatten(), 0))
        table[kind] = (cos, float(est.norm() / true_grad.norm()))
    # Central differences of E[r] check the marginal's autograd independently.
    eps, fd = 1e-5, torch.zeros_like(theta)
    with torch.no_grad():
        for idx in itertools.product(range(4), range(3)):
            d = torch.zeros_like(theta)
            d[idx] = eps
            fd[idx] = (expected_reward(theta + d) - expected_reward(theta - d)) / (2 * eps)
    fd_err = float((fd - true_grad).abs().max() / true_grad.abs().max())
    return table, float(probs.sum()), fd_err


def test_score_function_of_the_marginal_is_the_policy_gradient():
    rows = []
    for tau in (0.98, 0.5, 0.1):
        table, total, fd_err = _tabular_gradients(tau)
        assert total == pytest.approx(1.0, abs=1e-8)
        assert fd_err < 1e-6
        cos, ratio = table["marginal"]
        assert cos > 1 - 1e-8 and ratio == pytest.approx(1.0, abs=1e-5)
        rows.append((tau, table))
    assert rows[0][1]["p1"][0] < 0.9  # Eq. 14's score function is far off at tau = 0.98
    print("\n| tau | marginal cos / norm ratio | p1 cos / norm ratio | p2 cos / norm ratio |")
    print("|---|---|---|---|")
    for tau, t in rows:
        cells = " | ".join(f"{t[k][0]:.3f} / {t[k][1]:.3f}" for k in ("marginal", "p1", "p2"))
        print(f"| {tau} | {cells} |")


def test_gradcheck_float64():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 4, 3, generator=g, dtype=torch.float64).requires_grad_(True)
    masked = torch.tensor([[True, True, True, False], [True, True, True, True]])
    unmasked = torch.tensor([[True, False, False, False], [False, True, True, False]])
    tokens = torch.tensor([[2, 0, 0, 0], [0, 1, 0, 0]])
    tau = torch.tensor([0.5, 0.2], dtype=torch.float64)
    for top_k in (None, 1):

        def f(lg, top_k=top_k):
            lp = torch.log_softmax(lg, -1)
            return gumbel_marginal_log_prob(lp, masked, unmasked, tokens, tau, top_k=top_k)

        assert torch.autograd.gradcheck(f, (logits,), eps=1e-6, atol=1e-7, rtol=1e-5)
    # The blockwise kernel alone, with exponents past the cap and floored masses.
    logmass = torch.randn(3, 5, generator=g, dtype=torch.float64)
    logmass[0, 0] = -1e4
    loc = torch.randn(3, 5, generator=g, dtype=torch.float64) * 3
    loc[1, 2] = 150.0  # exp(-exp(loc - m)) == 0: capped, zero value and zero gradient
    nodes = torch.randn(3, 4, generator=g, dtype=torch.float64)
    inputs = (logmass.requires_grad_(True), loc.requires_grad_(True), nodes)
    assert torch.autograd.gradcheck(quadrature._LogMixtureCdf.apply, inputs, eps=1e-6, atol=1e-8)


# -- 5. the annealing schedule -------------------------------------------------------------------


def test_remask_taus_match_unmask_step():
    steps, length, vocab, tau0 = 7, 12, 5, 1.3
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, length, vocab, generator=g)
    tokens = torch.full((2, length), vocab)
    used, tau = [], tau0
    for t in range(steps):
        out = unmask_step(logits, tokens, t, steps, tau, generator=g)
        used.append(out.tau)
        tau, tokens = out.tau, out.next_tokens
    assert remask_taus(tau0, steps) == used  # bit for bit
    # tau_t = tau0 prod_{s<=t} (1 - (s+1)/S): 0.98 at step 0 of 50 and 0 at the last step
    taus = remask_taus(1.0, 50)
    assert taus[0] == pytest.approx(0.98) and taus[-1] == 0.0
    assert taus[9] == pytest.approx(math.prod(1 - (s + 1) / 50 for s in range(10)), rel=1e-12)


# -- 6. edge cases ---------------------------------------------------------------------------------


def test_edge_cases_are_finite_with_finite_gradients():
    length, vocab = 5, 4
    logits = torch.randn(8, length, vocab, generator=torch.Generator().manual_seed(5))
    logits[0, 1, :2] = float("-inf")  # p_jk = 0 at a remasked position
    logits[0, 2, 0] = -1e4  # p_jk underflows
    logits[1, 0] = torch.tensor([40.0, 0.0, 0.0, 0.0])  # committed token with p = 1 - 1e-17
    logits[1, 1:] = torch.tensor([40.0, 0.0, 0.0, 0.0])  # remasked with p = 1 on one token
    logits = logits.requires_grad_(True)
    full = torch.ones(8, length, dtype=torch.bool)
    masked = full.clone()
    masked[7] = False  # nothing masked
    unmasked = torch.zeros(8, length, dtype=torch.bool)
    unmasked[0, 0] = unmasked[1, 0] = unmasked[2, 0] = True  # one-element U
    unmasked[3, :4] = True  # one-element R
    unmasked[4] = True  # empty R
    # row 5: empty U
    unmasked[6, 1:3] = True
    tokens = torch.zeros(8, length, dtype=torch.long)
    tokens[0, 0] = 3
    expect_empty_r = torch.log_softmax(logits[4].detach(), -1)[:, 0].sum()
    for tau in (1e-4, 1e-2, 1.0):
        for top_k in (None, 1, 2):
            lp = torch.log_softmax(logits, -1)
            out = gumbel_marginal_log_prob(lp, masked, unmasked, tokens, tau, top_k=top_k)
            (grad,) = torch.autograd.grad(out.sum(), logits)
            out = out.detach()
            assert torch.isfinite(out).all(), (tau, top_k, out)
            assert out[5] == 0 and out[7] == 0
            assert float(out[4]) == pytest.approx(float(expect_empty_r), abs=1e-6)
            assert (out <= 1e-5).all()  # log-probabilities
            assert torch.isfinite(grad).all(), (tau, top_k)
            # Row 1: every token has p = 1 - 1e-17, so all 5 scores are tau * iid Gumbel and the
            # committed one is the largest with probability 1/5, at every tau.
            assert float(out[1]) == pytest.approx(math.log(0.2), abs=1e-5)
    # tau <= 0 on a row with both sets nonempty is refused (Eq. 14 is the tau = 0 law).
    with pytest.raises(ValueError, match="tau must be > 0"):
        gumbel_marginal_log_prob(torch.log_softmax(logits, -1), masked, unmasked, tokens, 0.0)
