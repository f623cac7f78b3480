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
* ``diversity/layouts``: 1 for the first sample of its group whose *detected layout* is new, 0
  for a repeat (``distinct`` on a reward component's ``layouts(images) -> list[Hashable]``
  instead of pixels: the shapes judge's objects, the toy's palette cells); a group's mean is
  its fraction of distinct layouts. Absent when no reward component detects layouts.

The embedding is a reward component's: by default the heaviest (``|weight|``, the first on a tie)
that has ``embed``, the reward's own space, which is the one the policy is pushed on. A
composite built with ``diversity_embedding`` (``reward.diversity_embedding``) measures the figures
in the named component's embedding instead (a fair judge: the shapes world's detector features,
not the reward model's). ``train.diversity`` keeps its own space (``train.diversity.embedding``,
by default the same heaviest rule); where the two differ the composite's ``train_embedding``
names it and the reward computes ``diversity_train/pairwise`` and ``diversity_train/nn`` there too
(:data:`TRAIN_PREFIX`), the figures the advantages read.

Beside them, evaluation reports each prompt's ceiling of ``distinct``
(``diversity/distinct_ceiling``): the expected fraction of distinct images among its ``n``
samples for a policy that is always right and draws uniformly over the prompt's ``M`` correct
images, ``M (1 - (1 - 1/M)^n) / n`` (:func:`expected_distinct_fraction`), for a world that knows
``M`` (the model kind's ``ModelEntry.correct_images``; the toy world's is exact).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch

log = logging.getLogger(__name__)

DISTINCT = "diversity/distinct"
PAIRWISE = "diversity/pairwise"
NEAREST = "diversity/nn"
LAYOUTS = "diversity/layouts"
CEILING = "diversity/distinct_ceiling"
EMBEDDED = (PAIRWISE, NEAREST)  # the figures that need the reward's embedding
FIGURES = (DISTINCT, PAIRWISE, NEAREST, LAYOUTS, CEILING)  # what evaluation summarises
TRAIN_PREFIX = "diversity_train/"  # train.diversity's figures, where its space is not EMBEDDED's

Embed = Callable[[torch.Tensor], torch.Tensor]
Layouts = Callable[[torch.Tensor], Sequence[Hashable]]


def train_figure(measure: str, own_space: bool) -> str:
    """The per-sample figure ``train.diversity`` reads: ``diversity/<measure>``, or
    ``diversity_train/<measure>`` when its embedding is not the reported figures' one."""
    return f"{TRAIN_PREFIX}{measure}" if own_space else f"diversity/{measure}"


def embedding_choice(
    components: Sequence[tuple[str, float, bool]], named: str | None
) -> str | None:
    """The component whose embedding diversity is measured in, from ``(name, weight, embeds)``
    triples in the composition's order: ``named`` when it is one that embeds, else None; with
    ``named`` None the heaviest (``|weight|``, the first on a tie) that embeds, None if none."""
    if named is not None:
        return named if any(n == named and e for n, _, e in components) else None
    ranked = sorted(components, key=lambda c: -abs(c[1]))  # stable: ties keep their order
    return next((n for n, _, e in ranked if e), None)


def _components(reward: Any, method: str) -> list[tuple[str, float, bool, Any]]:
    """``(name, weight, has method, component)`` of a composite (or of a plain reward)."""
    if hasattr(reward, "rewards") and hasattr(reward, "weights"):  # CompositeReward
        items = [(n, reward.weights[n], fn) for n, fn in reward.rewards.items()]
    else:
        items = [(str(getattr(reward, "name", "reward")), 1.0, reward)]
    return [(n, w, callable(getattr(fn, method, None)), fn) for n, w, fn in items]


def reward_embedding(reward: Any, named: str | None = None) -> Embed | None:
    """The ``embed`` of the reward's component ``named`` (None: the heaviest that has one), else
    None (:func:`embedding_choice`)."""
    parts = _components(reward, "embed")
    pick = embedding_choice([(n, w, e) for n, w, e, _ in parts], named)
    return next((fn.embed for n, _, e, fn in parts if n == pick and e), None)


def reward_layouts(reward: Any) -> Layouts | None:
    """The ``layouts`` of the reward's heaviest component that has one (first on a tie), else
    None: ``layouts(images uint8 [N, H, W, 3]) -> N hashable keys``, equal for the same
    detected layout."""
    parts = _components(reward, "layouts")
    pick = embedding_choice([(n, w, e) for n, w, e, _ in parts], None)
    return next((fn.layouts for n, _, e, fn in parts if n == pick and e), None)


def first_of_kind(keys: Sequence[Hashable], group_size: int) -> torch.Tensor:
    """float ``[N]``: 1 where ``keys[i]`` is the first of its value in its group of
    ``group_size`` consecutive keys, else 0."""
    out = torch.zeros(len(keys), dtype=torch.float32)
    for start in range(0, len(keys), group_size):
        seen: set[Hashable] = set()
        for i in range(start, min(start + group_size, len(keys))):
            if keys[i] not in seen:
                out[i] = 1.0
                seen.add(keys[i])
    return out


def distinct_first(images: torch.Tensor, group_size: int) -> torch.Tensor:
    """float ``[N]``: 1 where an image is the first of its (pixel-exact) kind in its group of
    ``group_size`` consecutive images, else 0."""
    flat = images.reshape(images.shape[0], -1).cpu().numpy()
    return first_of_kind([row.tobytes() for row in flat], group_size)


def expected_distinct_fraction(m: int, n: int) -> float:
    """The expected fraction of distinct values among ``n`` uniform draws from ``m`` values:
    ``m (1 - (1 - 1/m)^n) / n`` (each value is missed by all ``n`` draws with probability
    ``(1 - 1/m)^n``)."""
    if m < 1 or n < 1:
        raise ValueError(f"need m >= 1 values and n >= 1 draws, got m={m}, n={n}")
    return m * (1.0 - (1.0 - 1.0 / m) ** n) / n


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


def embedded_figures(
    images: torch.Tensor, group_size: int, embed: Embed, prefix: str = "diversity/"
) -> dict[str, torch.Tensor]:
    """``{prefix + "pairwise": [N], prefix + "nn": [N]}`` in ``embed``'s space; ``{}`` (logged)
    when the embedding fails (diversity is a figure, never a reason to stop a run)."""
    try:
        with torch.no_grad():
            feats = embed(images).detach().float().cpu()
        return {
            f"{prefix}pairwise": mean_pairwise_distance(feats, group_size),
            f"{prefix}nn": nearest_neighbour_distance(feats, group_size),
        }
    except Exception as err:  # noqa: BLE001
        log.warning("diversity: the embedding failed (%s); %spairwise, nn left out", err, prefix)
        return {}


def group_diversity(
    images: torch.Tensor,
    group_size: int,
    embed: Embed | None = None,
    layouts: Layouts | None = None,
) -> dict[str, torch.Tensor]:
    """``{DISTINCT, PAIRWISE, NEAREST, LAYOUTS: [N]}`` for ``images`` uint8 ``[N, H, W, 3]`` laid
    out in groups of ``group_size``; PAIRWISE and NEAREST only with ``embed``, LAYOUTS only with
    ``layouts``. A figure whose embedding or detector fails is logged and left out."""
    out = {DISTINCT: distinct_first(images, group_size)}
    if embed is not None:
        out.update(embedded_figures(images, group_size, embed))
    if layouts is not None:
        try:
            keys = list(layouts(images))
            if len(keys) != images.shape[0]:
                raise ValueError(f"{len(keys)} layouts for {images.shape[0]} images")
            out[LAYOUTS] = first_of_kind(keys, group_size)
        except Exception as err:  # noqa: BLE001
            log.warning("diversity: the layout detector failed (%s); layouts left out", err)
    return out


def reward_diversity(reward: Any, images: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    """Every per-sample figure of ``images`` for ``reward``: :func:`group_diversity` in the
    embedding its composite names (``diversity_embedding``; None: the heaviest that embeds) and
    with its layouts, plus ``diversity_train/*`` in ``train_embedding`` when the composite names
    one (``train.diversity``'s own space, set only where it differs)."""
    named = getattr(reward, "diversity_embedding", None)
    out = group_diversity(
        images, group_size, reward_embedding(reward, named), reward_layouts(reward)
    )
    train = getattr(reward, "train_embedding", None)
    if train is not None:
        embed = reward_embedding(reward, train)
        if embed is None:
            raise ValueError(f"train_embedding={train!r} is no component with an embedding")
        out.update(embedded_figures(images, group_size, embed, TRAIN_PREFIX))
    return out
