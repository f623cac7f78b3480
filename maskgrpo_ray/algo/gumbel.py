"""Exact transition probability of Show-o's Gumbel-remasked step (Eq. 14 with the noise integrated).

Show-o's sampler (``sampling.unmask_step``) at a step with Gumbel temperature ``tau > 0`` draws
``x_i ~ p_i`` at every masked position, scores it ``log p_i(x_i) + tau * g_i`` (``g_i`` iid
standard Gumbel), keeps the ``m_t`` lowest scores masked (the set ``R``) and commits the rest
(``U``, tokens ``y_i = x_i``). Divide the scores by ``tau``. For ``i in U`` with ``x_i = y_i``,
``s_i = a_i/tau + g_i`` (``a_i = log p_i(y_i)``) is Gumbel with location ``a_i/tau``. For
``j in R`` the token is integrated out, so ``s_j`` has the mixture CDF
``F_j(m) = sum_k p_jk exp(-exp(log p_jk/tau - m))``. The step realises exactly ``(U, y_U)`` iff
every committed token was drawn and ``min_U s > max_R s``; all draws are independent, so::

    P_tau(U, y_U) = prod_{i in U} p_i(y_i) * I,    I = P(max_R s < M) = int F_R(m) (-H'(m)) dm,
    M = min_U s,  H(m) = P(M > m) = prod_{i in U} (1 - exp(-exp(a_i/tau - m))),  F_R = prod_R F_j.

As ``tau -> 0``, ``M -> min_U a_i/tau`` and ``F_j`` there tends to
``sum_{k: p_jk < theta} p_jk``, the paper's Eq. 14 (``transition.step_log_prob`` kind ``"p1"``).
An empty ``R`` gives ``I = 1``; an empty ``U`` contributes 0 (``step_log_prob``'s convention).

Quadrature, in the variable ``m`` (score/tau units; the Gumbel scale is 1), all in log space
(``log F_j(m) = logsumexp_k(log p_jk - exp(log p_jk/tau - m))``, never ``log(softmax)``):

1. *Find the support (no gradient, float64).* ``F_R`` increases and ``H`` decreases, so over
   ``[c, c']`` the integral lies between ``F_R(c) (H(c) - H(c'))`` and ``F_R(c') (H(c) - H(c'))``
   (Riemann-Stieltjes bounds), and ``I >= F_R(m) H(m)`` for every ``m``. ``F_R`` is bracketed
   cheaply by keeping each remasked position's 16 likeliest tokens and giving each tail rank
   bucket one atom at its lowest location (upper bound) or at its mean ``p^(1/tau)`` (lower
   bound, Jensen). From ``[min_U a/tau - 6, top location + log(|U|+|R|) + 40]`` (outside it lies
   under ``|U| exp(-e^6)``, resp. ``e^-25``, of ``I``), each level cuts the kept region into 32
   intervals and drops those whose upper bound is under ``e^-20`` of the lower bound on ``I``,
   until intervals are 2 units wide: at most ``320 e^-20 = 7e-7`` of ``I`` is dropped in all.
   This follows the integrand wherever it is: at ``min_U a/tau`` usually, far to its right when
   the remasked set holds confident tokens (a rare transition, ``I`` of ``e^-30`` and less),
   on both sides when it is bimodal; at ``tau = 1e-4`` brackets of 1e5 units take ~5 levels.
2. *Sum (with gradient).* The kept intervals are cut into at most ``num_nodes`` equal parts, no
   narrower than 0.3 units, and the integrand is summed at their midpoints (``logsumexp`` of
   log-integrand plus log width). The integrand is analytic in a strip of half-width ~``pi/2``,
   so on a uniform grid over its support this converges like ``exp(-pi^2/h)``: measured
   ``6e-6`` at ``h = 0.5``, ``1e-9`` (the pruning floor) at ``h <= 0.35``. The grid carries no
   gradient, the node values do. ``log F_j`` at the nodes is a custom autograd function over
   blocks of at most ``2^20`` ``[positions, nodes, V]`` elements, recomputed in backward, so it
   keeps only ``[P, V]`` inputs and the ``[P, Q]`` result. Locations are measured from the
   grid's origin (``(log p - origin tau)/tau``), which keeps float32 exponents small.

``top_k`` keeps each remasked position's ``k`` likeliest tokens exactly. The tail tokens located
in the quadrature window (first node - 25 to last node + 6) are binned by location into bins of
at most 0.5 units; each bin becomes the two-point Gauss rule of its location distribution (two
atoms matching its mass and first three moments, error ``O(width^4)``); the tokens below the
window form one more such bin (their CDF terms are 1 to ``e^-25``) and those above are dropped
(below ``exp(-e^6)``).

Measured (``tests/test_algo_gumbel_marginal.py``, ``bench/bench_gumbel_marginal.py``):
Monte Carlo against ``unmask_step`` (200k draws, 54 next states) max ``|z|`` 3.0 at
``tau = 0.5`` and 2.8 at ``tau = 1`` (Eq. 14: over 300 on the states it does not floor).
Against an independent float64 integration of ``int H dF_R`` (18 cases, ``tau`` 1 to 0.03,
``log P`` down to -316, a bimodal rare case): float32 within 2.1e-5 (1e-7 relative, about an
ulp), float64 within 1.5e-8. At ``tau = 1e-3`` and ``1e-4`` it equals Eq. 14 to 4e-6 when the
remasked confidences are 0.05 nats or more from ``theta``. ``top_k`` at Show-o 512 (``L = 1024``,
``V = 8192``, steps 0, 5, 12 of 50) moves ``log P`` by at most 1.5e-5 for ``k`` 64 and 256; with
random committed tokens (``theta`` deep in the tails) by < 1e-5 at ``V = 64`` for ``k >= 1``.
"""

from __future__ import annotations

import torch

from maskgrpo_ray.algo.gumbel_quadrature import (
    LOGP_FLOOR,
    SEARCH_INTERVALS,
    SEARCH_TOP_K,
    Atoms,
    bucketed_atoms,
    log_committed_terms,
    log_remasked_cdf,
    quadrature_grid,
    truncated_atoms,
)


def remask_taus(gumbel_temperature: float, num_steps: int) -> list[float]:
    """Gumbel temperature used at each step ``t = 0..S-1`` by ``sampling.unmask_step``.

    Show-o anneals by compounding: ``tau <- tau * (1 - (t+1)/S)`` before step ``t`` uses it, so
    ``tau_t = tau_0 prod_{s<=t} (1 - (s+1)/S)`` (0 at the last step). Computed with the same
    float operations as the sampler, so the values agree bit for bit.
    """
    taus, tau = [], gumbel_temperature
    for step in range(num_steps):
        tau = tau * (1.0 - (step + 1) / num_steps)
        taus.append(tau)
    return taus


def gather_tokens(logp: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``logp[rows[n], i, tokens[n, i]]``: float ``[N, L]`` from ``logp`` ``[R, L, V]``, rows
    long ``[N]`` and tokens long ``[N, L]`` (clamped into the codebook: entries a caller
    ignores may hold the mask id)."""
    pos = torch.arange(tokens.shape[1], device=logp.device)
    return logp[rows[:, None], pos[None, :], tokens.clamp(0, logp.shape[-1] - 1)]


def _log_integral(
    tok_logp: torch.Tensor,
    committed: torch.Tensor,
    logp_r: torch.Tensor,
    row_r: torch.Tensor,
    tau: torch.Tensor,
    num_nodes: int,
    top_k: int | None,
) -> torch.Tensor:
    """``log I = log int F_R (-dH)`` for rows with both sets nonempty.

    Args:
        tok_logp: ``[N, L]`` log-probability of each position's committed token.
        committed: bool ``[N, L]``, ``U`` (nonempty in every row).
        logp_r: ``[P, V]`` log-probabilities at the remasked positions of all rows.
        row_r: long ``[P]``, the row of each remasked position.
        tau: ``[N]`` Gumbel temperatures (> 0).
        num_nodes, top_k: see :func:`gumbel_marginal_log_prob`.

    Returns:
        ``[N]``.
    """
    vocab = logp_r.shape[-1]
    inv_tau = (1.0 / tau[row_r])[:, None]  # [P, 1]
    truncate = top_k is not None and top_k < vocab
    with torch.no_grad():
        k = min(SEARCH_TOP_K, top_k or vocab)
        mass, mean, low, head = bucketed_atoms(logp_r.detach(), inv_tau, k)
        top_idx = None
        if truncate:
            assert top_k is not None
            top_idx = head[:, :top_k] if top_k <= head.shape[1] else logp_r.topk(top_k)[1]
        del head
        # The search runs in float64: its brackets reach 1e5 units at tau = 1e-4, where float32
        # would misplace interval ends by 1e-2 and leave gaps between the kept intervals.
        a_abs = torch.where(committed, tok_logp, torch.zeros_like(tok_logp)).double()
        a_abs = a_abs / tau.double()[:, None]
        mass, mean, low = mass.double(), mean.double(), low.double()
        origin, nodes, log_w = quadrature_grid(
            a_abs, committed, Atoms(row_r, mass, mean), Atoms(row_r, mass, low), num_nodes
        )
        nodes, log_w = nodes.to(tok_logp.dtype), log_w.to(tok_logp.dtype)
        # Measure locations from the grid's origin: (log p - origin*tau)/tau keeps the exponents
        # near the integrand small, where float32 resolves them (a pure shift of m).
        shift = (origin * tau.double()).to(tok_logp.dtype)  # [N]
    a_rel = (tok_logp - shift[:, None]) / tau[:, None]  # [N, L]
    a_rel = torch.where(committed, a_rel, torch.zeros_like(a_rel))
    loc = (logp_r - shift[row_r][:, None]) * inv_tau  # [P, V]
    if top_idx is not None:
        live = torch.isfinite(log_w)
        first = torch.where(live, nodes, torch.inf).amin(-1)[row_r] - 25.0  # [P]
        last = torch.where(live, nodes, -torch.inf).amax(-1)[row_r] + 6.0
        atoms = Atoms(row_r, *truncated_atoms(logp_r, loc, top_idx, (first, last)))
    else:
        atoms = Atoms(row_r, logp_r, loc)
    log_f = log_remasked_cdf(atoms, nodes) + log_committed_terms(a_rel, committed, nodes)[1]
    return torch.logsumexp(log_f + log_w, -1)  # [N]


def gumbel_marginal_log_prob(
    logp: torch.Tensor,
    masked: torch.Tensor,
    unmasked: torch.Tensor,
    tokens: torch.Tensor,
    tau: torch.Tensor | float,
    *,
    num_nodes: int = 128,
    top_k: int | None = None,
    pair_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Log-probability of Show-o's Gumbel-remasked step, the remasking noise integrated out.

    ``log P_tau = sum_{i in U} log p_i(y_i) + log int F_R(m) (-H'(m)) dm`` (module docstring):
    the exact law of ``(U_t, y_U)`` under ``sampling.unmask_step`` at Gumbel temperature
    ``tau``, and Eq. 14 (``step_log_prob`` kind ``"p1"``) in the limit ``tau -> 0``.

    Args:
        logp: float ``[N, L, V]`` log-softmax of the temperature-applied logits at ``Y_t``; may
            carry gradient (``-inf`` entries are read as ``-1e4``). With ``pair_rows``,
            ``[R, L, V]``, rows that several transitions read.
        masked: bool ``[N, L]``, positions masked before the step.
        unmasked: bool ``[N, L]``, newly committed ``U_t`` (a subset of ``masked``).
        tokens: long ``[N, L]``, the committed token at ``U_t`` positions (others ignored).
        tau: float ``[N]`` (or a number), the step's Gumbel temperature ``tau_t``
            (see :func:`remask_taus`); must be > 0 on rows with both sets nonempty.
        num_nodes: quadrature nodes per row (at least 32).
        top_k: keep only each remasked position's ``top_k`` most likely tokens exactly and fold
            the rest in by location bins (module docstring); ``None`` uses all ``V``.
        pair_rows: long ``[N]``, the row of ``logp`` each transition reads (only its tokens and
            remasked positions are gathered from it); None: row ``n`` for transition ``n``.

    Returns:
        ``[N]`` float32 (float64 for float64 ``logp``). A row with empty ``R`` gives
        ``sum_U log p(y)`` exactly; one with empty ``U`` gives 0.
    """
    if num_nodes < SEARCH_INTERVALS:
        raise ValueError(f"num_nodes must be >= {SEARCH_INTERVALS}, got {num_nodes}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1 or None, got {top_k}")
    n = masked.shape[0]
    dtype = torch.float64 if logp.dtype == torch.float64 else torch.float32
    logp = logp.to(dtype)  # [R, L, V]; clamped at LOGP_FLOOR where read
    rows = pair_rows if pair_rows is not None else torch.arange(n, device=logp.device)
    tau = torch.as_tensor(tau, dtype=dtype, device=logp.device).expand(n)  # [N]
    committed, remasked = masked & unmasked, masked & ~unmasked  # [N, L]
    tok_logp = gather_tokens(logp, rows, tokens).clamp(min=LOGP_FLOOR)  # [N, L]
    log_committed = torch.where(committed, tok_logp, torch.zeros_like(tok_logp)).sum(-1)  # [N]
    active = committed.any(-1) & remasked.any(-1)  # [N]
    if not bool(active.any()):
        return log_committed
    if bool((tau[active] <= 0).any()):
        raise ValueError("tau must be > 0 where both sets are nonempty (use Eq. 14 at tau = 0)")
    r_row, r_pos = (remasked & active[:, None]).nonzero(as_tuple=True)  # [P]
    sub_row = (torch.cumsum(active.long(), 0) - 1)[r_row]  # [P], row within the active rows
    logp_r = logp[rows[r_row], r_pos].clamp(min=LOGP_FLOOR)  # [P, V]
    act = active.nonzero().squeeze(-1)  # [Na]
    log_i = _log_integral(
        tok_logp[act], committed[act], logp_r, sub_row, tau[act], num_nodes, top_k
    )
    return log_committed + torch.zeros_like(log_committed).index_add(0, act, log_i)
