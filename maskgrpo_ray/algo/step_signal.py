"""Which unmasking steps carry the reward's signal: the step-signal measurement's math.

For ``K`` independent probe batches, ``g_{k,t}`` is the gradient of the clipped objective
restricted to unmasking step ``t``'s pairs of batch ``k`` (the first pass: ratio 1, so
``g = -mean_n A_n grad log p_t(n)``). Its figures, from the Gram matrix of the ``K`` gradients
of each step (``[S, K, K]``; :func:`signal_of_grams`):

* ``cos_t``: the mean cosine over the ``K (K - 1) / 2`` pairs of batches, ``|E g|^2 / E|g|^2``
  in expectation: the share of one batch's gradient that points the same way every time;
* its standard error: the jackknife's over the ``K`` batches (leave one batch out, the mean of
  the pairs left), which for a mean over pairs is ``2 (K - 1) / (K - 2)`` times the spread of the
  ``K`` per-batch means (each batch's mean cosine to the others) over ``sqrt(K)``: the pairs
  share batches, so that spread alone understates it (``bench/step_signal.py`` used it before,
  2.2x too small at its ``K = 12``);
* ``norm_t``: the mean ``|g_{k,t}|``.

The same with the advantages shuffled within each group (:func:`shuffle_within_groups`: the
same rewards, no link to the samples) is the *floor*: 0 in expectation, its spread what noise
alone gives. :func:`select_by_signal` is ``train.unmasking_step_selection: auto``'s rule.
Pure tensor math; ``bench/step_signal.py`` and a run's probe (``loop/step_signal_probe.py``) share it.
"""

from __future__ import annotations

import math
import statistics

import torch

EPS = 1e-12  # torch.nn.functional.normalize's: a zero gradient has cosine 0 with everything


def shuffle_within_groups(
    advantages: torch.Tensor, group_size: int, generator: torch.Generator
) -> torch.Tensor:
    """``advantages`` ``[N]`` permuted within each group of ``group_size`` (one ``randperm``
    per group, in group order, from ``generator``): the floor's signal-free advantages."""
    adv = advantages.view(-1, group_size)  # [B, G]
    perm = torch.stack([torch.randperm(group_size, generator=generator) for _ in range(len(adv))])
    return torch.gather(adv, 1, perm).reshape(-1)


def signal_of_grams(grams: torch.Tensor) -> dict[str, list[float]]:
    """``cos``, ``cos_se`` and ``norm`` per step from the Gram matrices ``[S, K, K]`` (float64;
    ``K >= 3``, so that the standard error has a spread to read)."""
    s_steps, k, _ = grams.shape
    if k < 3:
        raise ValueError(f"the step signal needs K >= 3 probe batches, got {k}")
    g = grams.double()
    norms = torch.diagonal(g, dim1=1, dim2=2).clamp(min=0).sqrt()  # [S, K]
    unit = norms.clamp(min=EPS)
    cos = g / (unit[:, :, None] * unit[:, None, :])  # [S, K, K]
    off = ~torch.eye(k, dtype=torch.bool)
    iu = torch.triu_indices(k, k, 1)
    out: dict[str, list[float]] = {"cos": [], "cos_se": [], "norm": []}
    for t in range(s_steps):
        pairs = cos[t, iu[0], iu[1]]
        per_batch = [float(cos[t, i][off[i]].mean()) for i in range(k)]
        out["cos"].append(float(pairs.mean()))
        jack = 2 * (k - 1) / (k - 2)  # leave-one-out pair means: U_(-i) - U = -2/(K-2) (m_i - m)
        out["cos_se"].append(jack * statistics.stdev(per_batch) / math.sqrt(k))
        out["norm"].append(float(norms[t].mean()))
    return out


def passing_steps(
    cos: list[float], cos_se: list[float], floor: list[float], floor_se: list[float], margin: float
) -> list[int]:
    """Steps whose signal stands above the floor: ``cos_t - floor_t > margin * spread_t`` with
    ``spread_t = sqrt(cos_se_t^2 + floor_se_t^2)`` (and above it at all with margin 0)."""
    out = []
    for t, (c, cs, f, fs) in enumerate(zip(cos, cos_se, floor, floor_se, strict=True)):
        if c - f > max(margin * math.hypot(cs, fs), 0.0):
            out.append(t)
    return out


def select_by_signal(
    cos: list[float],
    cos_se: list[float],
    floor: list[float],
    floor_se: list[float],
    cap: int,
    margin: float,
) -> list[int]:
    """``auto``'s selection: the passing steps (:func:`passing_steps`), at most ``cap`` of them
    (those standing highest above their floor, ``cos_t - floor_t``; ties to the later step),
    sorted. Empty when none passes (the caller keeps its last selection)."""
    passing = passing_steps(cos, cos_se, floor, floor_se, margin)
    ranked = sorted(passing, key=lambda t: (cos[t] - floor[t], t), reverse=True)
    return sorted(ranked[:cap])


def top_by_excess(cos: list[float], floor: list[float], cap: int) -> list[int]:
    """The ``cap`` steps standing highest above their floor, passing or not (sorted)."""
    ranked = sorted(range(len(cos)), key=lambda t: (cos[t] - floor[t], t), reverse=True)
    return sorted(ranked[:cap])
