"""The shapes reward model's online refresh (``reward.refresh``): Adv-GRPO's adversarial reward
(arXiv 2511.20256: the reward model "supervised using reference images as positive samples" and
updated along with the generator) on the world's contrastive model.

Per refresh, each prompt ``u`` of the step gets ``R`` reference renders (correct scenes drawn by
the world's renderer, :func:`~maskgrpo_ray.worlds.shapes.scenes.sample_scene`, as the model's
pre-training batches are), and each of them must outscore the policy's ``G_u`` samples of ``u``
under the reward's own score ``s(x, u) = exp(logit_scale) * cos(image(x), text(u))``: an InfoNCE
over the candidates {reference, samples} with the reference the target,

    L_adv = - mean_{u, r} log softmax_j [s(ref_{u,r}, u), s(x_{u,1}, u), ..., s(x_{u,G_u}, u)]_0

(the image-side term of :func:`~maskgrpo_ray.worlds.shapes.reward_model.contrastive_loss` with
the policy's samples as the hard image negatives). Mixed in, with ``replay_weight``, is the
model's own pre-training loss on a fresh batch of the grammar (correct renders, near misses,
malformed objects, near-miss prompts): the adversarial term alone sees only the step's prompts
and the policy's current mistakes, and nothing in it keeps the model ranking a near miss below a
correct render on every other prompt, which is what makes it a reward of the grammar.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from maskgrpo_ray.worlds.shapes import scenes
from maskgrpo_ray.worlds.shapes.reward_model import (
    ShapesClip,
    contrastive_loss,
    training_batch,
    word_ids,
)


def reference_renders(
    texts: Sequence[str], per_prompt: int, model: ShapesClip, rng: np.random.Generator
) -> torch.Tensor:
    """``per_prompt`` correct renders of each prompt, uint8 ``[U, R, H, W, 3]`` (the world's
    renderer: :func:`scenes.sample_scene`, :func:`scenes.render_indices`, :data:`scenes.PALETTE`)."""
    w = model.spec.world
    out = []
    for t in texts:
        p = scenes.parse(t)
        for _ in range(per_prompt):
            idx = scenes.render_indices(
                scenes.sample_scene(p, w.grid, rng, w.patch_px), w.grid, w.patch_px
            )
            out.append(scenes.PALETTE[idx])
    h, wd = out[0].shape[:2]
    return torch.from_numpy(np.stack(out)).view(len(texts), per_prompt, h, wd, 3)


def _scores(
    model: ShapesClip,
    refs: torch.Tensor,
    images: torch.Tensor,
    groups: torch.Tensor,
    texts: list[str],
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reward's scores of the references ``[U, R]`` and of each prompt's samples
    ``[U, Gmax]`` (``groups [U, Gmax]``: sample indices, -1 for padding: score -inf there)."""
    u, r = refs.shape[:2]
    scale = model.logit_scale.clamp(max=math.log(100.0)).exp()
    txt = model.encode_text(word_ids(texts))  # [U, d]
    ref = model.encode_image(refs.flatten(0, 1)).view(u, r, -1)  # [U, R, d]
    smp = model.encode_image(images)[groups.clamp(min=0)]  # [U, Gmax, d]
    s_ref = scale * (ref * txt[:, None]).sum(-1)  # [U, R]
    s_smp = scale * (smp * txt[:, None]).sum(-1)  # [U, Gmax]
    return s_ref, s_smp.masked_fill(groups < 0, float("-inf"))


def adversarial_loss(s_ref: torch.Tensor, s_smp: torch.Tensor) -> torch.Tensor:
    """``L_adv`` (module doc) of the scores ``s_ref [U, R]`` and ``s_smp [U, Gmax]`` (-inf:
    padding): each reference the target among itself and its prompt's samples."""
    u, r = s_ref.shape
    logits = torch.cat([s_ref[..., None], s_smp[:, None].expand(u, r, -1)], dim=-1)  # [U,R,1+G]
    target = torch.zeros(u * r, dtype=torch.long)
    return F.cross_entropy(logits.flatten(0, 1), target)


def margin(s_ref: torch.Tensor, s_smp: torch.Tensor) -> float:
    """Mean over prompts of (mean reference score - mean sample score)."""
    valid = torch.isfinite(s_smp)
    smp = torch.where(valid, s_smp, 0.0).sum(-1) / valid.sum(-1)  # [U]
    return float((s_ref.mean(-1) - smp).mean())


def _groups(prompts: Sequence[str]) -> tuple[list[str], torch.Tensor, int]:
    """The distinct prompts of the grammar among ``prompts`` (first-seen order), their sample
    indices ``long [U, Gmax]`` (-1: padding), and how many samples had a prompt outside it."""
    rows: dict[str, list[int]] = {}
    skipped = 0
    for i, t in enumerate(prompts):
        try:
            key = scenes.parse(t).text
        except ValueError:
            skipped += 1
            continue
        rows.setdefault(key, []).append(i)
    width = max((len(v) for v in rows.values()), default=0)
    idx = [v + [-1] * (width - len(v)) for v in rows.values()]
    return list(rows), torch.tensor(idx, dtype=torch.long).view(len(rows), width), skipped


def refresh_model(
    model: ShapesClip,
    opt: torch.optim.Optimizer,
    images: torch.Tensor,
    prompts: Sequence[str],
    seed: Sequence[int],
    settings: Any,
) -> dict[str, float]:
    """``settings.updates`` AdamW steps of ``L_adv + replay_weight * L_replay`` (module doc) on
    the policy's ``images`` uint8 ``[N, H, W, 3]`` of ``prompts`` (N str), the references and
    replay batches drawn from ``seed`` (deterministic given the inputs, the seed and the
    model's and optimiser's state). Returns the refresh's figures: the losses (mean over the
    updates), the margin (:func:`margin`) before and after, prompts used and skipped."""
    t0 = time.perf_counter()
    texts, groups, skipped = _groups(prompts)
    figures = {"prompts": float(len(texts)), "skipped_samples": float(skipped)}
    if not texts:
        return figures
    rng = np.random.default_rng([int(s) for s in seed])
    refs = reference_renders(texts, settings.renders_per_prompt, model, rng)
    replay_spec = dataclasses.replace(model.spec, batch=settings.replay_prompts)
    model.train()
    sums = {"adversarial_loss": 0.0, "replay_loss": 0.0, "loss": 0.0}
    for k in range(settings.updates):
        s_ref, s_smp = _scores(model, refs, images, groups, texts)
        if k == 0:
            figures["margin_before"] = margin(s_ref.detach(), s_smp.detach())
        adv = adversarial_loss(s_ref, s_smp)
        loss = adv
        if settings.replay_weight > 0:
            replay = contrastive_loss(model, *training_batch(replay_spec, rng))
            loss = adv + settings.replay_weight * replay
            sums["replay_loss"] += replay.item()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sums["adversarial_loss"] += adv.item()
        sums["loss"] += loss.item()
    model.eval()
    with torch.no_grad():
        figures["margin"] = margin(*_scores(model, refs, images, groups, texts))
    figures.update({k: v / settings.updates for k, v in sums.items()})
    figures["seconds"] = time.perf_counter() - t0
    return figures
