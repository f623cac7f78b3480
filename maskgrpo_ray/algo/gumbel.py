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

import math
from typing import Any, NamedTuple

import torch
from torch.utils.checkpoint import checkpoint

_EXP_CAP = 80.0  # exp(-exp(80)) == 0 in float32 and float64: larger exponents are capped here
_LOGP_FLOOR = -1.0e4  # log-probabilities below this (e.g. -inf) are treated as this
_LEFT_MARGIN = 6.0  # P(min_U s < min_U a/tau - 6) <= |U| exp(-e^6)
_RIGHT_MARGIN = 40.0  # beyond max location + log(|U|+|R|) + 40 lies < e^-25 of the integral
_SEARCH_INTERVALS = 32  # intervals per search level (also the least num_nodes)
_SEARCH_LEVELS = 10
_SEARCH_WIDTH = 2.0  # stop refining the search once intervals are this narrow (score/tau units)
_PRUNE_NATS = 20.0  # drop intervals whose upper bound is below e^-20 of the lower bound on I
_SEARCH_TOP_K = 16  # tokens kept exactly by the search's bounding surrogate
_SEARCH_HEAD = 256  # ranks bucketed by the surrogate; the rest is one bucket
_FINE_WIDTH = 0.3  # quadrature spacing need not be finer (score/tau units; error ~exp(-pi^2/h))
_TAIL_BIN_WIDTH = 0.5  # top_k: widest tail bin in the window (score/tau units)
_TAIL_BINS_MAX = 256
_BLOCK_ELEMENTS = 1 << 20  # elements of one [positions, nodes, atoms] temporary (4 MB float32)
# On a GPU a 4 MB block is one remasked position of Show-o (Q = 128 nodes x V = 8192 atoms), so
# the loops below would launch ~10 kernels per position (~24k positions per 512 px sample):
# launch-bound. 32x larger blocks (128 MB float32 temporaries) give the same values (blocks are
# rows computed independently; tests/test_algo_gumbel_marginal.py checks block-size invariance).
_BLOCK_ELEMENTS_CUDA = 1 << 25


def _block_elements(device: torch.device) -> int:
    return _BLOCK_ELEMENTS_CUDA if device.type == "cuda" else _BLOCK_ELEMENTS


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


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(x))`` for ``x <= 0`` (Maechler's two branches; -inf at 0)."""
    near = x > -math.log(2.0)
    a = torch.log(-torch.expm1(x.clamp(min=-math.log(2.0))))
    b = torch.log1p(-torch.exp(x.clamp(max=-math.log(2.0))))
    return torch.where(near, a, b)


def _log_gumbel_sf(z: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(-exp(z)))``: log P(s > m) for s Gumbel with location ``m + z``."""
    small = z < -15.0
    zs = z.clamp(max=-15.0)
    series = zs - 0.5 * torch.exp(zs)  # log y - y/2 + O(y^2), y = e^z < 3e-7
    main = _log1mexp(-torch.exp(z.clamp(min=-15.0, max=_EXP_CAP)))
    return torch.where(small, series, main)


def _log_gumbel_hazard(z: torch.Tensor) -> torch.Tensor:
    """Log hazard ``log(density / survival) = -log(expm1(y) / y)``, ``y = e^z``, ``z = loc - m``."""
    small = z < -7.0
    ys = torch.exp(z.clamp(max=-7.0))
    series = -(0.5 * ys + ys * ys / 24.0)  # log(expm1(y)/y) = y/2 + y^2/24 - O(y^4)
    zm = z.clamp(min=-7.0, max=_EXP_CAP)
    ym = torch.exp(zm)
    main = zm - ym - _log1mexp(-ym)
    return torch.where(small, series, main)


class _LogMixtureCdf(torch.autograd.Function):
    """``out[p, q] = logsumexp_k(logmass[p, k] - exp(loc[p, k] - nodes[p, q]))``, blockwise.

    Forward keeps only the ``[P, Q]`` result; backward recomputes each block, so memory stays at
    one ``[block, Q, K]`` temporary. Exponents are capped at ``_EXP_CAP`` (the capped terms are
    exactly 0 in the sum), which keeps values and gradients finite. ``nodes`` gets no gradient.
    """

    @staticmethod
    def forward(ctx: Any, logmass: torch.Tensor, loc: torch.Tensor, nodes: torch.Tensor) -> Any:
        out = logmass.new_empty(nodes.shape)  # [P, Q]
        for s in _blocks(logmass.shape[0], nodes.shape[1] * logmass.shape[1], logmass.device):
            z = (loc[s, None, :] - nodes[s, :, None]).clamp_(max=_EXP_CAP)  # [c, Q, K]
            t = z.exp_().neg_().add_(logmass[s, None, :])  # log p_k - exp(loc_k - m)
            out[s] = torch.logsumexp(t, dim=-1)
        ctx.save_for_backward(logmass, loc, nodes, out)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> Any:
        logmass, loc, nodes, out = ctx.saved_tensors
        grad_mass, grad_loc = torch.zeros_like(logmass), torch.zeros_like(loc)
        for s in _blocks(logmass.shape[0], nodes.shape[1] * logmass.shape[1], logmass.device):
            z = loc[s, None, :] - nodes[s, :, None]  # [c, Q, K]
            live = z < _EXP_CAP
            e = z.clamp_(max=_EXP_CAP).exp_()
            w = (logmass[s, None, :] - e - out[s, :, None]).exp_()  # softmax over k
            w.mul_(grad_out[s, :, None])
            grad_mass[s] = w.sum(1)
            grad_loc[s] = -(w.mul_(e).mul_(live)).sum(1)
        return grad_mass, grad_loc, None


def _blocks(rows: int, per_row: int, device: torch.device) -> list[slice]:
    size = max(1, _block_elements(device) // max(per_row, 1))
    return [slice(i, min(i + size, rows)) for i in range(0, rows, size)]


class _Atoms(NamedTuple):
    """Each remasked position's score/tau distribution as a mixture of Gumbel atoms."""

    row: torch.Tensor  # [P] long, row of each remasked position
    logmass: torch.Tensor  # [P, K] log mass of each atom
    loc: torch.Tensor  # [P, K] location of each atom, log p / tau for a single token


def _bucketed_atoms(
    logp_r: torch.Tensor, inv_tau: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The search's bounding surrogate: top-``k`` tokens plus one atom per rank bucket.

    Args:
        logp_r: ``[P, V]`` log-probabilities (no gradient).
        inv_tau: ``[P, 1]`` ``1/tau``.
        k: tokens kept exactly; ranks ``[k, 256)`` are cut into buckets ``[k 2^b, k 2^{b+1})``
            and the rest is one more bucket (``topk``, not a full sort).

    Returns:
        ``logmass, loc_mean, loc_low``, each ``[P, K]``, and the ``[P, 256]`` (or ``[P, V]``)
        indices of the largest tokens, in order. A bucket's atom at ``log(sum p w / sum p)``,
        ``w = p^{1/tau}``, makes its CDF term a lower bound (Jensen); at the bucket's lowest
        location, an upper bound.
    """
    vocab = logp_r.shape[-1]
    head = min(vocab, _SEARCH_HEAD)
    srt, idx = logp_r.topk(head, dim=-1)  # [P, head], descending
    top = srt[:, :k] * inv_tau
    mass, mean, low = [srt[:, :k]], [top], [top]

    def bucket(seg: torch.Tensor, seg_loc: torch.Tensor, lowest: torch.Tensor) -> None:
        log_t = torch.logsumexp(seg, -1, keepdim=True)
        mass.append(log_t)
        mean.append(torch.logsumexp(seg + seg_loc, -1, keepdim=True) - log_t)
        low.append(lowest)

    start = k
    while start < head:
        seg = srt[:, start : min(2 * start, head)]  # [P, bucket]
        bucket(seg, seg * inv_tau, seg[:, -1:] * inv_tau)
        start = 2 * start
    if head < vocab:
        rest = logp_r.scatter(1, idx, float("-inf"))  # [P, V], ranks >= head
        bucket(rest, rest * inv_tau, logp_r.amin(-1, keepdim=True) * inv_tau)
    return torch.cat(mass, -1), torch.cat(mean, -1), torch.cat(low, -1), idx


def _gauss_bin_atoms(
    logp: torch.Tensor, loc: torch.Tensor, slot: torch.Tensor, bins: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two atoms per bin: the two-point Gauss rule of the bin's location distribution.

    Args:
        logp: ``[B, V]`` log-probabilities; ``loc``: ``[B, V]`` their locations.
        slot: long ``[B, V]``, each token's bin in ``[0, bins)``; larger values are dropped.
        bins: number of bins kept.

    Returns:
        ``logmass, loc``, each ``[B, 2 * bins]``. Within a bin (mass ``T``, location mean
        ``mu``, standard deviation ``sd``, skewness ``g``) the atoms sit at ``mu + sd x`` for
        the roots ``x`` of ``x^2 - g x - 1``, with masses ``T x_other / (x_other - x)``: they
        match the bin's mass and its first three location moments, so a bin of width ``d``
        is off by ``O(d^4)``. Sums are in float64 (``scatter_add`` adds sequentially).
    """
    x, b = logp.double(), loc.double()
    slots = bins + 2  # the dropped tokens' slots stay in range, then are cut off
    slot = slot.clamp(max=slots - 1)
    xd = x.detach()
    top = xd.new_full((x.shape[0], slots), float("-inf")).scatter_reduce(1, slot, xd, "amax")
    nonempty = torch.isfinite(top)
    top = torch.where(nonempty, top, torch.zeros_like(top))
    q = torch.exp(x - top.gather(1, slot))  # [B, V], the largest in each bin is 1

    def total(v: torch.Tensor) -> torch.Tensor:
        return v.new_zeros(top.shape).scatter_add(1, slot, v)

    mass = torch.where(nonempty, total(q), torch.ones_like(top))  # [B, bins + 2]
    mean = total(q * b) / mass
    d = b - mean.gather(1, slot)
    var = (total(q * d * d) / mass).clamp(min=1e-20)
    skew = total(q * d * d * d) / mass / var**1.5
    r = torch.sqrt(skew * skew + 4.0)  # roots x = (g -+ r)/2 = -2/(r + g), 2/(r - g)
    big = r + skew.abs()  # r + |g|; then r - |g| = 4 / big, without cancellation
    r_minus = torch.where(skew >= 0, 4.0 / big, big)  # r - g
    r_plus = torch.where(skew >= 0, big, 4.0 / big)  # r + g
    log_m = torch.log(mass) + top
    logmass = torch.cat([log_m - torch.log(r_minus), log_m - torch.log(r_plus)], -1)
    logmass = logmass + math.log(2.0) - torch.log(r).repeat(1, 2)
    sd = var.sqrt()
    locs = torch.cat([mean - sd * 2.0 / r_plus, mean + sd * 2.0 / r_minus], -1)
    keep = nonempty.repeat(1, 2)
    logmass = torch.where(keep, logmass, torch.full_like(logmass, 2 * _LOGP_FLOOR))
    locs = torch.where(keep, locs, torch.zeros_like(locs))
    cols = torch.cat([torch.arange(bins), torch.arange(slots, slots + bins)]).to(logp.device)
    return logmass[:, cols].to(logp.dtype), locs[:, cols].to(logp.dtype)


def _truncated_atoms(
    logp_r: torch.Tensor,
    loc: torch.Tensor,
    top_idx: torch.Tensor,
    window: tuple[torch.Tensor, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``k`` tokens exactly; the tail folded into location bins across the quadrature window.

    Args:
        logp_r: ``[P, V]`` log-probabilities; ``loc``: ``[P, V]`` their locations
            (``log p / tau`` less the row's origin).
        top_idx: long ``[P, k]``, the tokens kept exactly.
        window: ``[P]`` lower and upper ends. Tail tokens in it go into bins at most
            ``_TAIL_BIN_WIDTH`` wide, two Gauss atoms each; those below it (CDF terms 1 to
            ``e^-25`` at every node) into one more bin; those above it (CDF terms below
            ``exp(-e^6)``) are dropped.

    Returns:
        ``logmass, loc``, each ``[P, k + 2 (bins + 1)]``.
    """
    lo, hi = window
    bins = min(_TAIL_BINS_MAX, max(1, math.ceil(float((hi - lo).max()) / _TAIL_BIN_WIDTH)))
    width = ((hi - lo) / bins)[:, None]  # [P, 1]
    slot = ((loc.detach() - lo[:, None]) / width).floor().clamp(-1, bins).long() + 1
    slot = slot.scatter(1, top_idx, bins + 2)  # kept tokens: dropped like those above
    masses, locs = [logp_r.gather(-1, top_idx)], [loc.gather(-1, top_idx)]
    step = max(1, _block_elements(logp_r.device) // logp_r.shape[1])
    grad = torch.is_grad_enabled() and (logp_r.requires_grad or loc.requires_grad)
    for s in range(0, logp_r.shape[0], step):  # float64 [block, V] temporaries, recomputed
        blk = (logp_r[s : s + step], loc[s : s + step], slot[s : s + step], bins + 1)
        m, w = (
            checkpoint(_gauss_bin_atoms, *blk, use_reentrant=False)
            if grad
            else _gauss_bin_atoms(*blk)
        )
        masses.append(m)
        locs.append(w)
    return torch.cat([masses[0], torch.cat(masses[1:])], -1), torch.cat(
        [locs[0], torch.cat(locs[1:])], -1
    )


def _log_remasked_cdf(atoms: _Atoms, nodes: torch.Tensor) -> torch.Tensor:
    """``log F_R(m) = sum_{j in R} log F_j(m)`` at ``nodes [N, Q]``; returns ``[N, Q]``."""
    per_pos = _LogMixtureCdf.apply(atoms.logmass, atoms.loc, nodes[atoms.row].contiguous())
    return nodes.new_zeros(nodes.shape).index_add(0, atoms.row, per_pos)  # [N, Q]


def _log_committed_terms(
    a_scaled: torch.Tensor, committed: torch.Tensor, nodes: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``log H(m)`` and ``log(-H'(m))`` at ``nodes [N, Q]``.

    ``-H' = H * sum_i hazard_i`` with ``a_scaled [N, L]`` the committed locations ``a_i/tau``
    (``committed [N, L]`` marks them; every row has one).
    """
    z = a_scaled[:, None, :] - nodes[:, :, None]  # [N, Q, L]
    c = committed[:, None, :]
    log_h = torch.where(c, _log_gumbel_sf(z), torch.zeros_like(z)).sum(-1)  # [N, Q]
    haz = torch.where(c, _log_gumbel_hazard(z), torch.full_like(z, float("-inf")))
    return log_h, log_h + torch.logsumexp(haz, -1)


def _prune(
    left: torch.Tensor,
    width: torch.Tensor,
    valid: torch.Tensor,
    a_scaled: torch.Tensor,
    committed: torch.Tensor,
    lower: _Atoms,
    upper: _Atoms,
) -> torch.Tensor:
    """Intervals ``[left, left + width]`` that may hold more than ``e^-20`` of ``I``; ``[N, C]``."""
    c = left.shape[1]
    right = left + width[:, None]
    log_h = _log_committed_terms(a_scaled, committed, torch.cat([left, right], -1))[0]
    h_left, h_right = log_h[:, :c], log_h[:, c:]
    log_dh = h_left + _log1mexp((h_right - h_left).clamp(max=0.0))  # log(H(c) - H(c'))
    f_left = _log_remasked_cdf(lower, left)
    upper_bound = _log_remasked_cdf(upper, right) + log_dh  # [N, C]
    ninf = torch.full_like(left, float("-inf"))
    lower_sum = torch.logsumexp(torch.where(valid, f_left + log_dh, ninf), -1)
    lower_pt = torch.where(valid, f_left + h_left, ninf).amax(-1)  # I >= F_R(m) H(m)
    bound = torch.maximum(lower_sum, lower_pt)  # [N]
    masked_ub = torch.where(valid, upper_bound, ninf)
    keep = valid & (masked_ub >= bound[:, None] - _PRUNE_NATS)
    return keep.scatter(1, masked_ub.argmax(-1, keepdim=True), True)


def _split(
    left: torch.Tensor,
    width: torch.Tensor,
    keep: torch.Tensor,
    budget: int,
    cap: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Cut each kept interval into ``min(budget // kept, cap)`` equal parts, kept ones first.

    Returns left ends ``[N, budget]``, the common width ``[N]`` and a validity mask.
    """
    n, c = left.shape
    count = keep.sum(-1).clamp(min=1)  # [N]
    parts = (budget // count).clamp(min=1)
    if cap is not None:
        parts = torch.minimum(parts, cap.clamp(min=1))
    order = torch.argsort((~keep).to(torch.int32), dim=-1, stable=True)  # [N, C]
    t = torch.arange(budget, device=left.device)[None, :]
    which, sub = t // parts[:, None], t % parts[:, None]  # [N, budget]
    valid = which < count[:, None]
    src = order.gather(-1, which.clamp(max=c - 1))
    new_width = width / parts
    return left.gather(-1, src) + sub * new_width[:, None], new_width, valid


def _quadrature_grid(
    a_scaled: torch.Tensor,
    committed: torch.Tensor,
    lower: _Atoms,
    upper: _Atoms,
    num_nodes: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Search for the integrand's support (no gradient).

    Returns the origin ``[N]`` (left end of the first kept interval), the midpoint nodes measured
    from it ``[N, Q]`` and their log weights ``[N, Q]`` (``-inf`` for padding).
    """
    big = torch.finfo(a_scaled.dtype).max
    lo = torch.where(committed, a_scaled, big).amin(-1) - _LEFT_MARGIN  # [N]
    top = torch.full_like(lo, -big).scatter_reduce(0, upper.row, upper.loc[:, 0], "amax")
    count = committed.sum(-1) + torch.bincount(upper.row, minlength=lo.shape[0])  # |U| + |R|
    hi = torch.maximum(torch.where(committed, a_scaled, -big).amax(-1), top)
    hi = hi + count.to(lo.dtype).log() + _RIGHT_MARGIN
    c = _SEARCH_INTERVALS
    width = (hi - lo) / c  # [N]
    left = lo[:, None] + width[:, None] * torch.arange(c, device=lo.device, dtype=lo.dtype)
    valid = torch.ones_like(left, dtype=torch.bool)
    for level in range(_SEARCH_LEVELS):
        keep = _prune(left, width, valid, a_scaled, committed, lower, upper)
        if level == _SEARCH_LEVELS - 1 or bool((width <= _SEARCH_WIDTH).all()):
            break
        cap = torch.ceil(width / _SEARCH_WIDTH).long()
        left, width, valid = _split(left, width, keep, c, cap)
    cap = torch.ceil(width / _FINE_WIDTH).long()
    left, width, valid = _split(left, width, keep, num_nodes, cap)
    used = int(valid.sum(-1).max())  # valid nodes come first: drop the all-padding columns
    origin = left[:, 0]
    nodes = (left - origin[:, None] + 0.5 * width[:, None])[:, :used]
    log_w = torch.where(valid, width.log()[:, None], float("-inf"))[:, :used]
    return origin, nodes, log_w


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
        k = min(_SEARCH_TOP_K, top_k or vocab)
        mass, mean, low, head = _bucketed_atoms(logp_r.detach(), inv_tau, k)
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
        origin, nodes, log_w = _quadrature_grid(
            a_abs, committed, _Atoms(row_r, mass, mean), _Atoms(row_r, mass, low), num_nodes
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
        atoms = _Atoms(row_r, *_truncated_atoms(logp_r, loc, top_idx, (first, last)))
    else:
        atoms = _Atoms(row_r, logp_r, loc)
    log_f = _log_remasked_cdf(atoms, nodes) + _log_committed_terms(a_rel, committed, nodes)[1]
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
) -> torch.Tensor:
    """Log-probability of Show-o's Gumbel-remasked step, the remasking noise integrated out.

    ``log P_tau = sum_{i in U} log p_i(y_i) + log int F_R(m) (-H'(m)) dm`` (module docstring):
    the exact law of ``(U_t, y_U)`` under ``sampling.unmask_step`` at Gumbel temperature
    ``tau``, and Eq. 14 (``step_log_prob`` kind ``"p1"``) in the limit ``tau -> 0``.

    Args:
        logp: float ``[N, L, V]`` log-softmax of the temperature-applied logits at ``Y_t``; may
            carry gradient (``-inf`` entries are read as ``-1e4``).
        masked: bool ``[N, L]``, positions masked before the step.
        unmasked: bool ``[N, L]``, newly committed ``U_t`` (a subset of ``masked``).
        tokens: long ``[N, L]``, the committed token at ``U_t`` positions (others ignored).
        tau: float ``[N]`` (or a number), the step's Gumbel temperature ``tau_t``
            (see :func:`remask_taus`); must be > 0 on rows with both sets nonempty.
        num_nodes: quadrature nodes per row (at least 32).
        top_k: keep only each remasked position's ``top_k`` most likely tokens exactly and fold
            the rest in by location bins (module docstring); ``None`` uses all ``V``.

    Returns:
        ``[N]`` float32 (float64 for float64 ``logp``). A row with empty ``R`` gives
        ``sum_U log p(y)`` exactly; one with empty ``U`` gives 0.
    """
    if num_nodes < _SEARCH_INTERVALS:
        raise ValueError(f"num_nodes must be >= {_SEARCH_INTERVALS}, got {num_nodes}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1 or None, got {top_k}")
    n, _, vocab = logp.shape
    dtype = torch.float64 if logp.dtype == torch.float64 else torch.float32
    logp = logp.to(dtype).clamp(min=_LOGP_FLOOR)  # [N, L, V]
    tau = torch.as_tensor(tau, dtype=dtype, device=logp.device).expand(n)  # [N]
    committed, remasked = masked & unmasked, masked & ~unmasked  # [N, L]
    tok_logp = logp.gather(-1, tokens.clamp(0, vocab - 1).unsqueeze(-1)).squeeze(-1)  # [N, L]
    log_committed = torch.where(committed, tok_logp, torch.zeros_like(tok_logp)).sum(-1)  # [N]
    active = committed.any(-1) & remasked.any(-1)  # [N]
    if not bool(active.any()):
        return log_committed
    if bool((tau[active] <= 0).any()):
        raise ValueError("tau must be > 0 where both sets are nonempty (use Eq. 14 at tau = 0)")
    rows = active.nonzero().squeeze(-1)  # [Na]
    r_row, r_pos = (remasked & active[:, None]).nonzero(as_tuple=True)  # [P]
    sub_row = (torch.cumsum(active.long(), 0) - 1)[r_row]  # [P], row within the active rows
    log_i = _log_integral(
        tok_logp[rows], committed[rows], logp[r_row, r_pos], sub_row, tau[rows], num_nodes, top_k
    )
    return log_committed + torch.zeros_like(log_committed).index_add(0, rows, log_i)
