"""The quadrature behind :func:`maskgrpo_ray.algo.gumbel.gumbel_marginal_log_prob`.

The pieces of the integral ``I = int F_R(m) (-H'(m)) dm`` that ``gumbel.py``'s docstring derives
and bounds, all in log space: the Gumbel survival and hazard terms of the committed set
(:func:`log_committed_terms`, ``log H`` and ``log(-H')``), the remasked positions' mixture CDF
``log F_R`` over blocks of ``[positions, nodes, atoms]`` with a recomputing backward
(:func:`log_remasked_cdf`), the atoms that stand for each remasked position's tokens (exact,
rank-bucketed bounds for the search, or top-``k`` plus Gauss-binned tails), and the search for the
integrand's support that places the nodes (:func:`quadrature_grid`). Pure tensor math.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch.utils.checkpoint import checkpoint

_EXP_CAP = 80.0  # exp(-exp(80)) == 0 in float32 and float64: larger exponents are capped here
LOGP_FLOOR = -1.0e4  # log-probabilities below this (e.g. -inf) are treated as this
_LEFT_MARGIN = 6.0  # P(min_U s < min_U a/tau - 6) <= |U| exp(-e^6)
_RIGHT_MARGIN = 40.0  # beyond max location + log(|U|+|R|) + 40 lies < e^-25 of the integral
SEARCH_INTERVALS = 32  # intervals per search level (also the least num_nodes)
_SEARCH_LEVELS = 10
_SEARCH_WIDTH = 2.0  # stop refining the search once intervals are this narrow (score/tau units)
_PRUNE_NATS = 20.0  # drop intervals whose upper bound is below e^-20 of the lower bound on I
SEARCH_TOP_K = 16  # tokens kept exactly by the search's bounding surrogate
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


class Atoms(NamedTuple):
    """Each remasked position's score/tau distribution as a mixture of Gumbel atoms."""

    row: torch.Tensor  # [P] long, row of each remasked position
    logmass: torch.Tensor  # [P, K] log mass of each atom
    loc: torch.Tensor  # [P, K] location of each atom, log p / tau for a single token


def bucketed_atoms(
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
    logmass = torch.where(keep, logmass, torch.full_like(logmass, 2 * LOGP_FLOOR))
    locs = torch.where(keep, locs, torch.zeros_like(locs))
    cols = torch.cat([torch.arange(bins), torch.arange(slots, slots + bins)]).to(logp.device)
    return logmass[:, cols].to(logp.dtype), locs[:, cols].to(logp.dtype)


def truncated_atoms(
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


def log_remasked_cdf(atoms: Atoms, nodes: torch.Tensor) -> torch.Tensor:
    """``log F_R(m) = sum_{j in R} log F_j(m)`` at ``nodes [N, Q]``; returns ``[N, Q]``."""
    per_pos = _LogMixtureCdf.apply(atoms.logmass, atoms.loc, nodes[atoms.row].contiguous())
    return nodes.new_zeros(nodes.shape).index_add(0, atoms.row, per_pos)  # [N, Q]


def log_committed_terms(
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
    lower: Atoms,
    upper: Atoms,
) -> torch.Tensor:
    """Intervals ``[left, left + width]`` that may hold more than ``e^-20`` of ``I``; ``[N, C]``."""
    c = left.shape[1]
    right = left + width[:, None]
    log_h = log_committed_terms(a_scaled, committed, torch.cat([left, right], -1))[0]
    h_left, h_right = log_h[:, :c], log_h[:, c:]
    log_dh = h_left + _log1mexp((h_right - h_left).clamp(max=0.0))  # log(H(c) - H(c'))
    f_left = log_remasked_cdf(lower, left)
    upper_bound = log_remasked_cdf(upper, right) + log_dh  # [N, C]
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


def quadrature_grid(
    a_scaled: torch.Tensor,
    committed: torch.Tensor,
    lower: Atoms,
    upper: Atoms,
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
    c = SEARCH_INTERVALS
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
