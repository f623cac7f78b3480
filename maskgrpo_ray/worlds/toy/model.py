"""The toy world's policy: a small bidirectional masked transformer over a palette grid.

It stands in for Show-o in the embedded default: the same interface (``MaskedImagePolicy``),
the same masked-token pre-training objective (Show-o's: mask a cosine-scheduled share of the
image tokens, cross-entropy on the masked ones, 10% condition dropout for guidance), a palette
decoder to RGB pixels instead of MAGVIT-v2, and captions from ``maskgrpo_ray.worlds.toy.world``.
Pre-training data is deliberately noisy (a share of the scenes miscount, misplace or add a dot)
so the base model leaves clear room for RL to improve.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from maskgrpo_ray.config import ToyModelConfig
from maskgrpo_ray.models.base import LogitsFn, MaskedImagePolicy, cfg_mix
from maskgrpo_ray.models.registry import (
    GenEvalScorer,
    ModelEntry,
    register_model,
    register_prompt_set,
)
from maskgrpo_ray.worlds import pretrained
from maskgrpo_ray.worlds.toy import world as toyworld

if TYPE_CHECKING:
    from maskgrpo_ray.config import Config, ModelConfig

log = logging.getLogger(__name__)


_SECTION = ToyModelConfig()  # the defaults of the settings that model.toy sets: kept there once


@dataclass(frozen=True)
class ToyModelSpec:
    """Architecture and pre-training recipe of the toy policy (all plain numbers); the fields
    that ``model.toy`` sets default to that section's defaults (:class:`ToyModelConfig`)."""

    grid: int = _SECTION.grid
    cell_px: int = _SECTION.cell_px
    d_model: int = _SECTION.d_model
    layers: int = _SECTION.layers
    heads: int = _SECTION.heads
    ff_mult: int = 2
    pretrain_steps: int = _SECTION.pretrain_steps
    pretrain_batch: int = _SECTION.pretrain_batch
    pretrain_lr: float = _SECTION.pretrain_lr
    noise_prob: float = _SECTION.noise_prob
    cond_dropout: float = 0.1
    seed: int = 0

    def cache_key(self) -> str:
        blob = json.dumps(asdict(self), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


class _Block(nn.Module):
    def __init__(self, d: int, heads: int, ff: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, ff), nn.GELU(), nn.Linear(ff, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [N, T, d]
        n, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(n, t, 3, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        x = x + self.proj(a.transpose(1, 2).reshape(n, t, d))
        return x + self.mlp(self.norm2(x))


class ToyPolicy(MaskedImagePolicy):
    """Bidirectional transformer over ``[caption tokens P | image tokens L]`` -> ``[N, L, V]``."""

    def __init__(self, spec: ToyModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.codebook_size = len(toyworld.PALETTE)  # V
        self.num_image_tokens = spec.grid * spec.grid  # L
        self.image_grid = (spec.grid, spec.grid)
        d = spec.d_model
        self.text_embed = nn.Embedding(len(toyworld.WORDS), d)
        self.image_embed = nn.Embedding(self.codebook_size + 1, d)  # + mask
        self.pos = nn.Parameter(torch.randn(toyworld.CAPTION_TOKENS + self.num_image_tokens, d))
        self.blocks = nn.ModuleList(
            _Block(d, spec.heads, spec.ff_mult * d) for _ in range(spec.layers)
        )
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, self.codebook_size)

    def tokenize(self, prompts: Sequence[str]) -> torch.Tensor:
        ids = []
        for p in prompts:
            words = p.strip().lower().split()
            bad = [w for w in words if w not in toyworld.WORDS[2:]]
            if bad or not words or len(words) > toyworld.CAPTION_TOKENS:
                raise ValueError(
                    f"prompt {p!r}: the toy model reads at most {toyworld.CAPTION_TOKENS} words "
                    f"from {toyworld.WORDS[2:]}; unknown: {bad}"
                )
            row = [toyworld.WORDS.index(w) for w in words]
            ids.append(row + [0] * (toyworld.CAPTION_TOKENS - len(row)))
        return torch.tensor(ids, dtype=torch.long, device=self.head.weight.device)

    def null_condition(self, n: int) -> torch.Tensor:
        ids = torch.zeros(
            n, toyworld.CAPTION_TOKENS, dtype=torch.long, device=self.head.weight.device
        )
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
        return toyworld.decode_palette(image_tokens, self.spec.grid, self.spec.cell_px)


def synthetic_batch(
    captions: Sequence[toyworld.Caption],
    batch: int,
    grid: int,
    noise_prob: float,
    g: torch.Generator,
) -> tuple[list[str], torch.Tensor]:
    """Captioned scenes for pre-training: ``(prompts [B], scenes long [B, L])``."""
    idx = torch.randint(len(captions), (batch,), generator=g).tolist()
    prompts, scenes = [], []
    for i in idx:
        cap = captions[i]
        corrupt = None
        if torch.rand(1, generator=g).item() < noise_prob:
            corrupt = ("count", "place", "extra")[int(torch.randint(3, (1,), generator=g))]
        prompts.append(cap.text)
        scenes.append(toyworld.render_scene(cap, grid, g, corrupt).view(-1))
    return prompts, torch.stack(scenes)


def pretrain(spec: ToyModelSpec, log_every: int = 200) -> ToyPolicy:
    """Show-o's masked-token objective on noisy synthetic captioned scenes (all 96 captions)."""
    torch.manual_seed(spec.seed)
    g = torch.Generator().manual_seed(spec.seed + 1)
    model = ToyPolicy(spec)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.pretrain_lr, weight_decay=0.01)
    caps = toyworld.all_captions()
    length, vocab = model.num_image_tokens, model.codebook_size
    t0 = time.time()
    for step in range(spec.pretrain_steps):
        lr = spec.pretrain_lr * 0.5 * (1 + math.cos(math.pi * step / spec.pretrain_steps))
        for group in opt.param_groups:
            group["lr"] = lr
        prompts, scenes = synthetic_batch(caps, spec.pretrain_batch, spec.grid, spec.noise_prob, g)
        cond = model.tokenize(prompts)
        drop = torch.rand(len(prompts), generator=g) < spec.cond_dropout
        cond = torch.where(drop[:, None], model.null_condition(len(prompts)), cond)
        ratio = torch.cos(math.pi / 2 * torch.rand(len(prompts), 1, generator=g))  # [B, 1]
        n_mask = (ratio * length).ceil().clamp(1, length)
        rank = torch.rand(len(prompts), length, generator=g).argsort(-1).argsort(-1)
        mask = rank < n_mask  # [B, L]
        logits = model(torch.where(mask, vocab, scenes), cond)
        loss = F.cross_entropy(logits[mask], scenes[mask])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if log_every and (step % log_every == 0 or step == spec.pretrain_steps - 1):
            log.info(
                "toy pre-train step %d/%d loss %.4f (%.0fs)",
                step,
                spec.pretrain_steps,
                loss.item(),
                time.time() - t0,
            )
    model.zero_grad(set_to_none=True)  # no pre-training gradient stays on the base
    return model.eval()


def load_or_pretrain(spec: ToyModelSpec) -> ToyPolicy:
    """The pre-trained toy base model: shipped with the package for the default spec, else
    cached by its spec so the demo and tests reuse it, else pre-trained now
    (:mod:`maskgrpo_ray.worlds.pretrained`)."""
    key = spec.cache_key()
    model = ToyPolicy(spec)
    found = pretrained.find("toy-base", key, "the toy base model")
    if found is not None:
        model.load_state_dict(found)
        return model.eval()
    path = pretrained.cache_path("toy-base", key)
    log.warning("no shipped or cached toy base model at %s: pre-training it now (once)", path)
    model = pretrain(spec)
    pretrained.store("toy-base", key, model.state_dict())
    return model


def spec_from_config(t: ToyModelConfig) -> ToyModelSpec:
    """The ``model.toy`` config section as a :class:`ToyModelSpec` (every field of the section
    is a field of the spec, by the same name; the rest keep the spec's defaults)."""
    return ToyModelSpec(**t.model_dump())


def _build(model: ModelConfig, device: torch.device) -> ToyPolicy:
    return load_or_pretrain(spec_from_config(model.toy)).to(device)


def _prepare(model: ModelConfig) -> None:
    load_or_pretrain(spec_from_config(model.toy))  # cached: actors load it, none pre-trains


def _check(cfg: Config) -> None:
    steps, tokens = cfg.rollout.unmasking_steps, cfg.model.toy.grid**2
    if steps > tokens:
        raise ValueError(
            f"rollout.unmasking_steps={steps} exceeds the toy image's {tokens} tokens: every "
            "step must commit at least one token; lower rollout.unmasking_steps"
        )


def _reward_defaults(model: ModelConfig, reward_kind: str) -> dict[str, int]:
    toy_kinds = ("toy_rules", "toy_geneval")
    return {"grid": model.toy.grid} if reward_kind in toy_kinds else {}  # the image's grid


def _geneval_rule(model: ModelConfig) -> GenEvalScorer:
    grid = model.toy.grid  # GenEval's rule on the decoded palette cells: exact detection
    return lambda images, metas: toyworld.score_toy(images, metas, grid)


def _correct_images(model: ModelConfig) -> Callable[[str], int | None]:
    grid = model.toy.grid

    def count(prompt: str) -> int | None:  # None: a prompt outside the grammar
        try:
            return toyworld.correct_layouts(toyworld.Caption.parse(prompt), grid)
        except ValueError:
            return None

    return count


def toy_prompts(split: str) -> list[str]:
    """The toy grammar's captions: the train split, or the held-out eval split."""
    train, held_out = toyworld.split_captions()
    return [c.text for c in (train if split == "train" else held_out)]


def toy_prompt_metadata(text: str) -> dict[str, object]:
    """A toy caption's GenEval metadata line (:meth:`toyworld.Caption.geneval_metadata`)."""
    return toyworld.Caption.parse(text).geneval_metadata()


register_model(
    "toy",
    ModelEntry(
        build=_build,
        config_section=ToyModelConfig,
        check=_check,
        prepare=_prepare,
        reward_defaults=_reward_defaults,
        geneval_rule=_geneval_rule,
        correct_images=_correct_images,
    ),
)
register_prompt_set("toy", toy_prompts, metadata=toy_prompt_metadata)
