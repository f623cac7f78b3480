"""The shapes world's image tokenizer: a codebook of pixel patches learned from the renders.

Each image is cut into ``patch_px x patch_px`` patches on the token grid; a token is the index of
the nearest codebook patch, and decoding pastes the codebook's patches back. The codebook is
learned by k-means over the patches of many random renders (:func:`fit_codebook`), started
from the most frequent distinct patches: when the renders hold no more distinct patches than
``max_codes`` (the world's default, about 270 of them), k-means converges at once to exactly
those patches and the round trip render -> tokens -> pixels is lossless (a test checks it);
with fewer codes it is ordinary k-means and lossy. Objects span 4 to 16 tokens and no token is
an object: a token is a corner, an edge or an inner piece of some shape of some colour, or the
background.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

log = logging.getLogger(__name__)


def to_patches(images: np.ndarray | torch.Tensor, patch_px: int) -> torch.Tensor:
    """uint8 ``[N, H, W, 3]`` -> float ``[N, L, patch_px * patch_px * 3]`` (row-major tokens)."""
    x = torch.as_tensor(images)
    n, h, w, c = x.shape
    g_h, g_w = h // patch_px, w // patch_px
    x = x.view(n, g_h, patch_px, g_w, patch_px, c).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(n, g_h * g_w, patch_px * patch_px * c).float()


def fit_codebook(
    images: np.ndarray, patch_px: int, max_codes: int, iters: int = 20
) -> torch.Tensor:
    """k-means codebook of the renders' patches: uint8 ``[V, patch_px, patch_px, 3]``.

    Started from the ``max_codes`` most frequent distinct patches (the background first); when
    there are no more distinct patches than that, they are the codebook (k-means is then at its
    fixed point with zero error) and ``V`` is their number.
    """
    flat = to_patches(images, patch_px).reshape(-1, patch_px * patch_px * 3)  # [M, D]
    uniq, counts = torch.unique(flat, dim=0, return_counts=True)
    order = torch.argsort(counts, descending=True, stable=True)
    uniq, counts = uniq[order], counts[order]
    if len(uniq) <= max_codes:
        centres = uniq
    else:
        centres = uniq[:max_codes].clone()
        w = counts.float()
        for _ in range(iters):  # Lloyd's iterations over the distinct patches, weighted
            assign = torch.cdist(uniq, centres).argmin(1)
            sums = torch.zeros_like(centres).index_add_(0, assign, uniq * w[:, None])
            mass = torch.zeros(len(centres)).index_add_(0, assign, w)
            moved = mass > 0
            centres[moved] = sums[moved] / mass[moved, None]
        log.warning(
            "shapes tokenizer: %d distinct patches for %d codes: k-means, lossy",
            len(uniq),
            max_codes,
        )
    return centres.round().clamp(0, 255).to(torch.uint8).view(-1, patch_px, patch_px, 3)


def encode(images: np.ndarray | torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """Pixels uint8 ``[N, H, W, 3]`` -> tokens long ``[N, L]`` (nearest codebook patch)."""
    p = codebook.shape[1]
    patches = to_patches(images, p)  # [N, L, D]
    codes = codebook.reshape(len(codebook), -1).float()  # [V, D]
    n, length, d = patches.shape
    flat = patches.reshape(-1, d)
    dist = (flat * flat).sum(1, keepdim=True) - 2 * flat @ codes.T + (codes * codes).sum(1)
    return dist.argmin(1).view(n, length)


def decode(tokens: torch.Tensor, codebook: torch.Tensor, grid: int) -> torch.Tensor:
    """Tokens long ``[N, L]`` -> pixels uint8 ``[N, grid * p, grid * p, 3]``."""
    p = codebook.shape[1]
    n = tokens.shape[0]
    x = codebook.to(tokens.device)[tokens.clamp(0, len(codebook) - 1)]  # [N, L, p, p, 3]
    x = x.view(n, grid, grid, p, p, 3).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(n, grid * p, grid * p, 3)
