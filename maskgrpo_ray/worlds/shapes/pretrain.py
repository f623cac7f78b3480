"""Pre-training of the shapes world: the tokenizer's codebook and the base policy, cached by spec.

The base policy learns with Show-o's objective: a cosine-scheduled share of a render's image
tokens is masked and the masked ones are predicted with cross-entropy, the prompt replaced by the
null prompt 10% of the time (classifier-free guidance). Its data are random correct scenes of
random prompts (each GenEval tag equally often, every prompt of the grammar: the RL training and
evaluation splits are about which prompts RL sees, as Show-o was pre-trained on far more than any
RL prompt set), with ``noise_prob`` of the captions describing a near miss instead
(:func:`~maskgrpo_ray.worlds.shapes.scenes.corrupt_scene`).

Everything is cached under ``$MASKGRPO_CACHE_DIR`` (``~/.cache/maskgrpo-ray``) by the hash of its
spec, written atomically, so every actor and test loads what one process built.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from maskgrpo_ray.worlds import pretrained
from maskgrpo_ray.worlds.shapes import scenes, tokenizer
from maskgrpo_ray.worlds.shapes.policy import PolicySpec, ShapesPolicy, WorldSpec

log = logging.getLogger(__name__)


def tag_balanced_prompts(rng: np.random.Generator, n: int) -> list[scenes.Prompt]:
    """``n`` prompts of the whole grammar, each GenEval tag equally likely."""
    by_tag: dict[str, list[scenes.Prompt]] = {}
    for p in scenes.all_prompts():
        by_tag.setdefault(p.tag, []).append(p)
    tags = sorted(by_tag)
    out = []
    for t in rng.integers(len(tags), size=n):
        group = by_tag[tags[int(t)]]
        out.append(group[int(rng.integers(len(group)))])
    return out


def render_batch(
    prompts: list[scenes.Prompt], world: WorldSpec, rng: np.random.Generator, noise_prob: float
) -> np.ndarray:
    """A correct random scene per prompt (a near miss with probability ``noise_prob``), in
    pixels: uint8 ``[B, H, W, 3]``."""
    out = []
    for p in prompts:
        objs = scenes.sample_scene(p, world.grid, rng, world.patch_px)
        if noise_prob and rng.random() < noise_prob:
            objs = scenes.corrupt_scene(p, objs, world.grid, rng, world.patch_px)
        out.append(scenes.render(objs, world.grid, world.patch_px))
    return np.stack(out)


def fit_world_codebook(world: WorldSpec) -> torch.Tensor:
    """The codebook learned from ``world.codebook_renders`` random renders."""
    rng = np.random.default_rng(world.seed + 7)
    prompts = tag_balanced_prompts(rng, world.codebook_renders)
    return tokenizer.fit_codebook(
        render_batch(prompts, world, rng, 0.0), world.patch_px, world.max_codes
    )


def load_or_fit_codebook(world: WorldSpec) -> torch.Tensor:
    """The world's codebook uint8 ``[V, p, p, 3]``: shipped for the default world, else cached
    by the world's spec, else learned now (:mod:`maskgrpo_ray.worlds.pretrained`)."""
    found = pretrained.find("shapes-codebook", world.key(), "the shapes codebook")
    if found is not None:
        return found["codebook"]
    path = pretrained.cache_path("shapes-codebook", world.key())
    log.warning(
        "no shipped or cached shapes codebook at %s: learning it from the renders now (once)", path
    )
    codebook = fit_world_codebook(world)
    pretrained.store("shapes-codebook", world.key(), {"codebook": codebook})
    return codebook


def progress(total: int, desc: str) -> Callable[[int, str], None]:
    """A tqdm bar on stderr (``update(n, postfix)``), or nothing under ``MASKGRPO_NO_PROGRESS``."""
    if os.environ.get("MASKGRPO_NO_PROGRESS"):
        return lambda n, postfix: None
    from tqdm import tqdm

    bar = tqdm(total=total, desc=desc, unit="step", leave=False, mininterval=2.0)

    def update(n: int, postfix: str) -> None:
        bar.update(n)
        bar.set_postfix_str(postfix, refresh=False)
        if bar.n >= total:
            bar.close()

    return update


def pretrain(spec: PolicySpec, codebook: torch.Tensor, log_every: int = 500) -> ShapesPolicy:
    """Show-o's masked-token objective on random captioned renders (see the module doc)."""
    torch.manual_seed(spec.seed)
    rng = np.random.default_rng(spec.seed + 1)
    g = torch.Generator().manual_seed(spec.seed + 2)
    model = ShapesPolicy(spec, codebook)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and n != "pos"]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2 or n == "pos"]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}],
        lr=spec.pretrain_lr,
        betas=(0.9, 0.98),
    )
    length, vocab = model.num_image_tokens, model.codebook_size
    warmup = max(1, spec.pretrain_steps // 20)
    bar = progress(spec.pretrain_steps, "pre-training the shapes base model")
    t0 = time.time()
    for step in range(spec.pretrain_steps):
        ramp = min(1.0, (step + 1) / warmup)
        lr = spec.pretrain_lr * ramp * 0.5 * (1 + math.cos(math.pi * step / spec.pretrain_steps))
        for group in opt.param_groups:
            group["lr"] = lr
        prompts = tag_balanced_prompts(rng, spec.pretrain_batch)
        images = render_batch(prompts, spec.world, rng, spec.noise_prob)
        tokens = tokenizer.encode(images, codebook)  # [B, L]
        cond = model.tokenize([p.text for p in prompts])
        drop = torch.rand(len(prompts), generator=g) < spec.cond_dropout
        cond = torch.where(drop[:, None], model.null_condition(len(prompts)), cond)
        ratio = torch.cos(math.pi / 2 * torch.rand(len(prompts), 1, generator=g))  # [B, 1]
        n_mask = (ratio * length).ceil().clamp(1, length)
        rank = torch.rand(len(prompts), length, generator=g).argsort(-1).argsort(-1)
        mask = rank < n_mask  # [B, L]
        logits = model(torch.where(mask, vocab, tokens), cond)
        loss = F.cross_entropy(logits[mask], tokens[mask])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        bar(1, f"loss {loss.item():.3f}")
        if log_every and (step % log_every == 0 or step == spec.pretrain_steps - 1):
            log.info(
                "shapes pre-train step %d/%d loss %.4f (%.0fs)",
                step,
                spec.pretrain_steps,
                loss.item(),
                time.time() - t0,
            )
    model.zero_grad(set_to_none=True)
    return model.eval()


def load_or_pretrain(spec: PolicySpec) -> ShapesPolicy:
    """The pre-trained base policy: shipped for the default spec, else cached by its spec (the
    world's included), else pre-trained now (:mod:`maskgrpo_ray.worlds.pretrained`)."""
    codebook = load_or_fit_codebook(spec.world)
    key = spec.cache_key()
    model = ShapesPolicy(spec, codebook)
    found = pretrained.find("shapes-base", key, "the shapes base model")
    if found is not None:
        model.load_state_dict(found)
        return model.eval()
    path = pretrained.cache_path("shapes-base", key)
    log.warning("no shipped or cached shapes base model at %s: pre-training it now (once)", path)
    model = pretrain(spec, codebook)
    pretrained.store("shapes-base", key, model.state_dict())
    return model
