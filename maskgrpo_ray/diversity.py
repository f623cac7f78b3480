"""How different a prompt's images are: the diversity that RL on image models tends to trade for
reward, measured the same way in training (each step's groups) and in evaluation (each prompt's
samples).

Two per-sample figures whose mean over a group is the group's diversity (so they average, cluster
and bootstrap like any per-sample score):

* ``diversity/distinct``: 1 for the first occurrence of an image (pixel-exact) in its group, 0 for
  a repeat; a group's mean is its fraction of distinct images (1: all different; ``1/G``: the
  same image ``G`` times).
* ``diversity/pairwise``: the mean distance of a sample to the other members of its group in the
  reward model's embedding space, ``1 - cos`` of the embeddings (a reward component's
  ``embed(images) -> float [N, D]``: CLIP's normalised image features; the toy rules reward's
  palette cells read from the pixels, where ``1 - cos`` is the share of cells that differ); a
  group's mean is its mean pairwise distance. Absent when no reward component embeds.
* ``diversity/nn``: the distance ``1 - cos`` of a sample to its *nearest* other member of the
  group in the same embedding (GARDO's measure, arXiv 2512.24138): 0 for a sample whose image
  (as the reward sees it) another member repeats, large for one that stands apart. A group's
  mean is its mean nearest-neighbour distance. Absent when no reward component embeds.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger(__name__)

DISTINCT = "diversity/distinct"
PAIRWISE = "diversity/pairwise"
NEAREST = "diversity/nn"
EMBEDDED = (PAIRWISE, NEAREST)  # the figures that need the reward's embedding
FIGURES = (DISTINCT, PAIRWISE, NEAREST)

Embed = Callable[[torch.Tensor], torch.Tensor]


def reward_embedding(reward: Any) -> Embed | None:
    """The embedding of the reward's heaviest component that has one (``embed``), else None."""
    if hasattr(reward, "rewards") and hasattr(reward, "weights"):  # CompositeReward
        ranked = sorted(reward.rewards.items(), key=lambda kv: -abs(reward.weights[kv[0]]))
        for _, fn in ranked:
            if callable(getattr(fn, "embed", None)):
                return fn.embed
        return None
    fn = getattr(reward, "embed", None)
    return fn if callable(fn) else None


def distinct_first(images: torch.Tensor, group_size: int) -> torch.Tensor:
    """float ``[N]``: 1 where an image is the first of its (pixel-exact) kind in its group of
    ``group_size`` consecutive images, else 0."""
    n = images.shape[0]
    flat = images.reshape(n, -1)
    out = torch.zeros(n, dtype=torch.float32)
    for start in range(0, n, group_size):
        seen: list[torch.Tensor] = []
        for i in range(start, min(start + group_size, n)):
            if not any(torch.equal(flat[i], s) for s in seen):
                out[i] = 1.0
                seen.append(flat[i])
    return out


def _group_distances(features: torch.Tensor, group_size: int) -> list[torch.Tensor]:
    """Each group's ``1 - cos`` distance matrix ``[k, k]`` (zero diagonal), groups of
    ``group_size`` consecutive rows of ``features`` ``[N, D]`` (the last may be shorter)."""
    f = torch.nn.functional.normalize(features.float(), dim=-1)
    out = []
    for start in range(0, f.shape[0], group_size):
        g = f[start : start + group_size]
        dist = (1.0 - g @ g.T).clamp(min=0.0)  # [k, k], zero diagonal up to round-off
        dist.fill_diagonal_(0.0)
        out.append(dist)
    return out


def mean_pairwise_distance(features: torch.Tensor, group_size: int) -> torch.Tensor:
    """float ``[N]``: each sample's mean ``1 - cos`` to the other members of its group (NaN for
    a group of one)."""
    parts = []
    for dist in _group_distances(features, group_size):
        k = dist.shape[0]
        parts.append(dist.sum(-1) / (k - 1) if k > 1 else torch.full((k,), float("nan")))
    return torch.cat(parts) if parts else torch.zeros(0)


def nearest_neighbour_distance(features: torch.Tensor, group_size: int) -> torch.Tensor:
    """float ``[N]``: each sample's ``1 - cos`` to its nearest other member of its group
    (GARDO's ``d_i``; NaN for a group of one)."""
    parts = []
    for dist in _group_distances(features, group_size):
        k = dist.shape[0]
        if k < 2:
            parts.append(torch.full((k,), float("nan")))
            continue
        others = dist + torch.diag(torch.full((k,), float("inf")))  # a sample is not its own
        parts.append(others.min(dim=-1).values)
    return torch.cat(parts) if parts else torch.zeros(0)


def group_diversity(
    images: torch.Tensor, group_size: int, embed: Embed | None = None
) -> dict[str, torch.Tensor]:
    """``{DISTINCT: [N], PAIRWISE: [N], NEAREST: [N]}`` for ``images`` uint8 ``[N, H, W, 3]``
    laid out in groups of ``group_size``; PAIRWISE and NEAREST only with ``embed``. An embedding that fails is logged and
    left out (diversity is a figure, never a reason to stop a run)."""
    out = {DISTINCT: distinct_first(images, group_size)}
    if embed is not None:
        try:
            with torch.no_grad():
                feats = embed(images).detach().float().cpu()
            out[PAIRWISE] = mean_pairwise_distance(feats, group_size)
            out[NEAREST] = nearest_neighbour_distance(feats, group_size)
        except Exception as err:  # noqa: BLE001
            log.warning("diversity: the reward's embedding failed (%s); pairwise, nn left out", err)
    return out
