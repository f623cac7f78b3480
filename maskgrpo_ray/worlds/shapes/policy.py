"""The shapes world's policy: a bidirectional masked transformer over the learned patch tokens.

The same interface as Show-o (:class:`~maskgrpo_ray.models.base.MaskedImagePolicy`), Show-o's
sampler and schedules (cosine mask schedule, Gumbel confidence noise, Show-o's guidance
``(1 + w) cond - w uncond``), and Show-o's pre-training objective (:mod:`.pretrain`). Prompts
are word ids (:data:`~maskgrpo_ray.worlds.shapes.scenes.WORDS`); images decode through the
codebook (:mod:`.tokenizer`), which the policy carries as a buffer outside its state dict (it is
part of the world, not a weight: the weight sync and checkpoints never carry it).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from maskgrpo_ray.models.base import LogitsFn, MaskedImagePolicy, cfg_mix
from maskgrpo_ray.worlds.shapes import scenes, tokenizer


@dataclass(frozen=True)
class WorldSpec:
    """The world's canvas and its tokenizer (what the base model and the reward model share)."""

    grid: int = 8  # tokens per side (L = grid * grid)
    patch_px: int = 4  # pixels per token side
    max_codes: int = 512  # the codebook's size limit (k-means above it)
    codebook_renders: int = 20000  # renders the codebook is learned from
    seed: int = 0

    def key(self) -> str:
        blob = json.dumps({**asdict(self), **scenes.DATA_VERSION}, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


@dataclass(frozen=True)
class PolicySpec:
    """Architecture and pre-training recipe of the base policy (plain numbers)."""

    world: WorldSpec = WorldSpec()
    d_model: int = 128
    layers: int = 4
    heads: int = 4
    ff_mult: int = 3
    local_mixing: bool = True
    pretrain_steps: int = 3000
    pretrain_batch: int = 64
    pretrain_lr: float = 2e-3
    noise_prob: float = 0.0
    cond_dropout: float = 0.1
    seed: int = 0

    def cache_key(self) -> str:
        blob = json.dumps({**asdict(self), **scenes.DATA_VERSION}, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


class Block(nn.Module):
    """A pre-norm transformer block over ``[prompt P | image L]``; with ``grid`` set, the image
    tokens also mix with their 3 x 3 neighbours on the token grid (a depthwise convolution), the
    local prior that tells a shape's corner piece where its edge pieces go."""

    def __init__(self, d: int, heads: int, ff: int, grid: int | None) -> None:
        super().__init__()
        self.heads, self.grid = heads, grid
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, ff), nn.GELU(), nn.Linear(ff, d))
        if grid is not None:
            self.norm_local = nn.LayerNorm(d)
            self.local = nn.Conv2d(d, d, 3, padding=1, groups=d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [N, P + L, d]
        n, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(n, t, 3, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        x = x + self.proj(a.transpose(1, 2).reshape(n, t, d))
        if self.grid is not None:
            g = self.grid
            img = self.norm_local(x[:, t - g * g :]).transpose(1, 2).reshape(n, d, g, g)
            mixed = self.local(img).reshape(n, d, g * g).transpose(1, 2)
            x = torch.cat([x[:, : t - g * g], x[:, t - g * g :] + mixed], dim=1)
        return x + self.mlp(self.norm2(x))


class ShapesPolicy(MaskedImagePolicy):
    """Bidirectional transformer over ``[prompt words P | image tokens L]`` -> ``[N, L, V]``."""

    def __init__(self, spec: PolicySpec, codebook: torch.Tensor) -> None:
        super().__init__()
        self.spec = spec
        w = spec.world
        self.codebook_size = int(codebook.shape[0])  # V
        self.num_image_tokens = w.grid * w.grid  # L
        self.image_grid = (w.grid, w.grid)
        self.register_buffer("codebook", codebook.clone(), persistent=False)
        d = spec.d_model
        self.text_embed = nn.Embedding(len(scenes.WORDS), d)
        self.image_embed = nn.Embedding(self.codebook_size + 1, d)  # + mask
        self.pos = nn.Parameter(0.02 * torch.randn(scenes.PROMPT_TOKENS + self.num_image_tokens, d))
        grid = w.grid if spec.local_mixing else None
        self.blocks = nn.ModuleList(
            Block(d, spec.heads, spec.ff_mult * d, grid) for _ in range(spec.layers)
        )
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, self.codebook_size)

    def tokenize(self, prompts: Sequence[str]) -> torch.Tensor:
        ids = []
        vocab = {w: i for i, w in enumerate(scenes.WORDS)}
        for p in prompts:
            words = p.strip().lower().split()
            bad = [w for w in words if w not in vocab or w.startswith("<")]
            if bad or not words or len(words) > scenes.PROMPT_TOKENS:
                raise ValueError(
                    f"prompt {p!r}: the shapes model reads at most {scenes.PROMPT_TOKENS} words "
                    f"of its vocabulary {list(scenes.WORDS[2:])}; unknown: {bad}"
                )
            row = [vocab[w] for w in words]
            ids.append(row + [0] * (scenes.PROMPT_TOKENS - len(row)))
        return torch.tensor(ids, dtype=torch.long, device=self.head.weight.device)

    def null_condition(self, n: int) -> torch.Tensor:
        ids = torch.zeros(n, scenes.PROMPT_TOKENS, dtype=torch.long, device=self.head.weight.device)
        ids[:, 0] = 1  # <null>
        return ids

    def forward(self, image_tokens: torch.Tensor, cond_ids: torch.Tensor) -> torch.Tensor:
        """``image_tokens [N, L]`` (mask = V), ``cond_ids [N, P]`` -> logits ``[N, L, V]`` float32."""
        x = torch.cat([self.text_embed(cond_ids), self.image_embed(image_tokens)], dim=1) + self.pos
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x[:, cond_ids.shape[1] :])).float()

    def conditioned(self, cond_ids: torch.Tensor, guidance_scale: float = 0.0) -> LogitsFn:
        if guidance_scale == 0.0:
            return lambda tokens: self(tokens, cond_ids)
        both = torch.cat([cond_ids, self.null_condition(cond_ids.shape[0])])

        def fn(tokens: torch.Tensor) -> torch.Tensor:
            cond, uncond = self(torch.cat([tokens, tokens]), both).chunk(2)
            return cfg_mix(cond, uncond, guidance_scale)

        return fn

    def decode_images(self, image_tokens: torch.Tensor) -> torch.Tensor:
        codebook: torch.Tensor = self.codebook  # type: ignore[assignment]
        return tokenizer.decode(image_tokens, codebook, self.spec.world.grid)
