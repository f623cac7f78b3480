"""The shapes world's reward model: a small contrastive image-text model, as CLIP is to Show-o.

The paper rewards Show-o with CLIP and judges it with GenEval's detector: the reward is not the
judge. This world does the same. Its CLIP is trained here, once, on the world's renders and
prompts (zero-shot with respect to the policy: it never sees a generated image):

* the image tower cuts the image into its token patches (a 4 x 4 convolution of stride 4, with
  each patch's place as two extra channels), two 3 x 3 convolutions on the token grid, and a
  linear map of the whole grid to the ``dim``-dimensional embedding (places matter: "left of");
* the text tower embeds the prompt's words and their places, runs two small transformer layers
  and averages the words;
* the loss is CLIP's symmetric InfoNCE with a learned temperature over a batch of distinct
  prompts, with hard negatives on both sides as compositional CLIP training does: each prompt
  also meets a near-miss render (one thing wrong that its tag tests, or one of its objects
  malformed), and each render a near-miss prompt of the same tag; a share of the pairs
  (``clutter``) get stray pieces on both sides, so that what decides is the objects, not the
  leftovers around them.

The reward (:class:`~maskgrpo_ray.worlds.shapes.rewards.ShapesClipReward`) is its score of an
image against its prompt, ``exp(logit_scale) * cos`` like the project's CLIP reward. How far the
reward agrees with the judge is measured, not assumed (:func:`agreement`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from maskgrpo_ray.worlds.shapes import scenes
from maskgrpo_ray.worlds.shapes.policy import WorldSpec

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RewardModelSpec:
    """The reward model's size and training recipe (plain numbers)."""

    world: WorldSpec = WorldSpec()
    dim: int = 128
    width: int = 64
    steps: int = 3000
    batch: int = 96
    lr: float = 2e-3
    clutter: float = 0.5  # share of training pairs with stray pieces added (add_clutter)
    seed: int = 0

    def cache_key(self) -> str:
        blob = json.dumps({**asdict(self), **scenes.DATA_VERSION}, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


class ShapesClip(nn.Module):
    """The two towers: ``encode_image(uint8 [N, H, W, 3])`` and ``encode_text(ids [N, P])``,
    both to unit vectors ``[N, dim]``."""

    def __init__(self, spec: RewardModelSpec) -> None:
        super().__init__()
        self.spec = spec
        w, d, g = spec.width, spec.dim, spec.world.grid
        p = spec.world.patch_px
        self.patchify = nn.Conv2d(3, w, kernel_size=p, stride=p)
        self.conv1 = nn.Conv2d(w + 2, w, 3, padding=1)
        self.conv2 = nn.Conv2d(w, w, 3, padding=1)
        self.image_proj = nn.Linear(w * g * g, d)
        coords = (torch.arange(g).float() + 0.5) / g * 2 - 1
        yy, xx = torch.meshgrid(coords, coords, indexing="ij")
        self.register_buffer("coords", torch.stack([xx, yy])[None], persistent=False)  # [1,2,g,g]
        self.words = nn.Embedding(len(scenes.WORDS), w)
        self.word_pos = nn.Parameter(0.02 * torch.randn(scenes.PROMPT_TOKENS, w))
        layer = nn.TransformerEncoderLayer(w, 4, 2 * w, dropout=0.0, batch_first=True)
        self.text = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.text_proj = nn.Linear(w, d)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(10.0)))

    def encode_image(self, images: torch.Tensor) -> torch.Tensor:
        x = images.permute(0, 3, 1, 2).float() / 127.5 - 1.0  # [N, 3, H, W]
        x = F.gelu(self.patchify(x))  # [N, w, g, g]
        coords: torch.Tensor = self.coords  # type: ignore[assignment]
        x = torch.cat([x, coords.expand(x.shape[0], -1, -1, -1)], dim=1)
        x = F.gelu(self.conv1(x))
        x = F.gelu(self.conv2(x)) + x
        return F.normalize(self.image_proj(x.flatten(1)), dim=-1)

    def encode_text(self, ids: torch.Tensor) -> torch.Tensor:
        pad = ids == 0  # [N, P]
        x = self.text(self.words(ids) + self.word_pos, src_key_padding_mask=pad)
        keep = (~pad).float()[..., None]
        x = (x * keep).sum(1) / keep.sum(1).clamp(min=1.0)
        return F.normalize(self.text_proj(x), dim=-1)


def word_ids(texts: list[str]) -> torch.Tensor:
    """Prompts -> word ids ``long [N, P]`` (0-padded); ValueError naming an unknown word."""
    vocab = {w: i for i, w in enumerate(scenes.WORDS)}
    rows = []
    for t in texts:
        words = t.strip().lower().split()
        bad = [w for w in words if w not in vocab or w.startswith("<")]
        if bad or not words or len(words) > scenes.PROMPT_TOKENS:
            raise ValueError(
                f"prompt {t!r}: the shapes reward model reads at most {scenes.PROMPT_TOKENS} "
                f"words of {list(scenes.WORDS[2:])}; unknown: {bad}"
            )
        rows.append([vocab[w] for w in words] + [0] * (scenes.PROMPT_TOKENS - len(words)))
    return torch.tensor(rows, dtype=torch.long)


def malform(
    indices: np.ndarray, objs: list[scenes.Obj], patch_px: int, rng: np.random.Generator
) -> np.ndarray:
    """The render's palette indices ``[H, W]`` with one object malformed: one token of its box
    blanked, filled solid with its colour, or taken from another shape at the same place (drawn
    again until at least 4 pixels change: a solid inner token filled solid is no change, and
    the detector lets one stray pixel pass)."""
    grid = indices.shape[0] // patch_px
    while True:
        out = indices.copy()
        o = objs[int(rng.integers(len(objs)))]
        r = (o.row + int(rng.integers(o.size))) * patch_px
        c = (o.col + int(rng.integers(o.size))) * patch_px
        kind = int(rng.integers(3))
        if kind == 0:
            out[r : r + patch_px, c : c + patch_px] = 0
        elif kind == 1:
            out[r : r + patch_px, c : c + patch_px] = 1 + scenes.COLOUR_NAMES.index(o.colour)
        else:
            other = str(rng.choice([k for k in scenes.CLASSES if k != o.cls]))
            src = scenes.render_indices(
                [scenes.Obj(other, o.colour, o.row, o.col, o.size)], grid, patch_px
            )
            out[r : r + patch_px, c : c + patch_px] = src[r : r + patch_px, c : c + patch_px]
        if (out != indices).sum() >= 4:
            return out


def add_clutter(indices: np.ndarray, patch_px: int, rng: np.random.Generator) -> np.ndarray:
    """The render's palette indices ``[H, W]`` with 1-3 stray pieces: background tokens that
    get one token's patch of some shape of some colour (the leftovers a sampler leaves; a stray
    piece is no object, so a correct image stays correct)."""
    out = indices.copy()
    grid = indices.shape[0] // patch_px
    empty = [
        (r, c)
        for r in range(grid)
        for c in range(grid)
        if not out[r * patch_px : (r + 1) * patch_px, c * patch_px : (c + 1) * patch_px].any()
    ]
    for k in rng.permutation(len(empty))[: int(rng.integers(1, 4))]:
        r, c = empty[int(k)]
        size = int(rng.choice(scenes.SIZES))
        top, left = max(0, r - int(rng.integers(size))), max(0, c - int(rng.integers(size)))
        top, left = min(top, grid - size), min(left, grid - size)
        piece = scenes.Obj(
            str(rng.choice(scenes.CLASSES)), str(rng.choice(scenes.COLOUR_NAMES)), top, left, size
        )
        src = scenes.render_indices([piece], grid, patch_px)
        out[r * patch_px : (r + 1) * patch_px, c * patch_px : (c + 1) * patch_px] = src[
            r * patch_px : (r + 1) * patch_px, c * patch_px : (c + 1) * patch_px
        ]
    return out


def _near_miss_prompt(
    prompt: scenes.Prompt, objs: list[scenes.Obj], rng: np.random.Generator, patch_px: int
) -> scenes.Prompt:
    """A prompt of the same tag that the scene does not satisfy (any other prompt if none)."""
    same = [p for p in scenes.all_prompts() if p.tag == prompt.tag and p != prompt]
    for _ in range(20):
        cand = same[int(rng.integers(len(same)))]
        if not scenes.is_correct(cand, objs, patch_px):
            return cand
    others = [p for p in scenes.all_prompts() if not scenes.is_correct(p, objs, patch_px)]
    return others[int(rng.integers(len(others)))]


def training_batch(
    spec: RewardModelSpec, rng: np.random.Generator
) -> tuple[torch.Tensor, torch.Tensor, list[str], list[str]]:
    """``(images, near-miss images, prompts, near-miss prompts)``: ``batch`` distinct prompts
    (each tag equally likely), a correct render of each, a wrong render of each (half with one
    semantic change, half with a malformed object), and a same-tag prompt each render fails."""
    w = spec.world
    by_tag: dict[str, list[scenes.Prompt]] = {}
    for p in scenes.all_prompts():
        by_tag.setdefault(p.tag, []).append(p)
    tags = sorted(by_tag)
    chosen: dict[str, scenes.Prompt] = {}
    while len(chosen) < spec.batch:
        group = by_tag[tags[int(rng.integers(len(tags)))]]
        p = group[int(rng.integers(len(group)))]
        chosen.setdefault(p.text, p)
    pos, neg, neg_texts = [], [], []
    for p in chosen.values():
        objs = scenes.sample_scene(p, w.grid, rng, w.patch_px)
        idx = scenes.render_indices(objs, w.grid, w.patch_px)
        pos.append(scenes.PALETTE[idx])
        if rng.random() < 0.5:
            bad = scenes.render_indices(
                scenes.corrupt_scene(p, objs, w.grid, rng, w.patch_px), w.grid, w.patch_px
            )
        else:
            bad = malform(idx, objs, w.patch_px, rng)
        neg.append(scenes.PALETTE[bad])
        neg_texts.append(_near_miss_prompt(p, objs, rng, w.patch_px).text)
    images = torch.from_numpy(np.stack(pos))
    negatives = torch.from_numpy(np.stack(neg))
    return images, negatives, list(chosen), neg_texts


def contrastive_loss(
    model: ShapesClip,
    images: torch.Tensor,
    negatives: torch.Tensor,
    texts: list[str],
    neg_texts: list[str],
) -> torch.Tensor:
    """Symmetric InfoNCE with hard negatives on both sides (see the module doc)."""
    img = model.encode_image(torch.cat([images, negatives]))  # [2B, d]
    txt = model.encode_text(word_ids(texts + neg_texts))  # [2B, d]
    b = len(texts)
    scale = model.logit_scale.clamp(max=math.log(100.0)).exp()
    target = torch.arange(b)
    i2t = scale * img[:b] @ txt.T  # [B, 2B]: each render against every prompt and near miss
    t2i = scale * txt[:b] @ img.T  # [B, 2B]: each prompt against every render and near miss
    return 0.5 * (F.cross_entropy(i2t, target) + F.cross_entropy(t2i, target))


def train_reward_model(spec: RewardModelSpec) -> ShapesClip:
    """Train the contrastive model on the world's renders (progress bar on stderr)."""
    from maskgrpo_ray.worlds.shapes.pretrain import progress

    torch.manual_seed(spec.seed)
    rng = np.random.default_rng(spec.seed + 11)
    model = ShapesClip(spec)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.01)
    warmup = max(1, spec.steps // 20)
    bar = progress(spec.steps, "training the shapes reward model")
    for step in range(spec.steps):
        ramp = min(1.0, (step + 1) / warmup)
        lr = spec.lr * ramp * 0.5 * (1 + math.cos(math.pi * step / spec.steps))
        for group in opt.param_groups:
            group["lr"] = lr
        loss = contrastive_loss(model, *training_batch(spec, rng))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        bar(1, f"loss {loss.item():.3f}")
        if step % 500 == 0 or step == spec.steps - 1:
            log.info("shapes reward model step %d/%d loss %.4f", step, spec.steps, loss.item())
    return model.eval().requires_grad_(False)


def load_or_train(spec: RewardModelSpec) -> ShapesClip:
    """The trained reward model: shipped for the default spec, else cached by its spec, else
    trained now (:mod:`maskgrpo_ray.worlds.pretrained`)."""
    from maskgrpo_ray.worlds import pretrained

    key = spec.cache_key()
    model = ShapesClip(spec)
    found = pretrained.find("shapes-reward", key, "the shapes reward model")
    if found is not None:
        model.load_state_dict(found)
        return model.eval().requires_grad_(False)
    path = pretrained.cache_path("shapes-reward", key)
    log.warning("no shipped or cached shapes reward model at %s: training it now (once)", path)
    model = train_reward_model(spec)
    pretrained.store("shapes-reward", key, model.state_dict())
    return model


@torch.no_grad()
def score(model: ShapesClip, images: torch.Tensor, texts: list[str]) -> torch.Tensor:
    """``exp(logit_scale) * cos(image, prompt)`` per image: float ``[N]``."""
    unique = list(dict.fromkeys(texts))
    where = torch.tensor([unique.index(t) for t in texts])
    txt = model.encode_text(word_ids(unique))[where]
    img = model.encode_image(images)
    return model.logit_scale.clamp(max=math.log(100.0)).exp() * (img * txt).sum(-1)


@torch.no_grad()
def agreement(model: ShapesClip, n: int = 512, seed: int = 1234) -> dict[str, float]:
    """How often the reward ranks a correct render above a wrong one of the same prompt, for
    near misses (one thing wrong that the tag tests) and malformed objects: each ``n`` pairs."""
    spec = model.spec
    w = spec.world
    rng = np.random.default_rng(seed)
    prompts = scenes.all_prompts()
    out: dict[str, float] = {}
    for kind in ("near_miss", "malformed"):
        good, bad, texts = [], [], []
        for _ in range(n):
            p = prompts[int(rng.integers(len(prompts)))]
            objs = scenes.sample_scene(p, w.grid, rng, w.patch_px)
            idx = scenes.render_indices(objs, w.grid, w.patch_px)
            if kind == "near_miss":
                wrong = scenes.render_indices(
                    scenes.corrupt_scene(p, objs, w.grid, rng, w.patch_px), w.grid, w.patch_px
                )
            else:
                wrong = malform(idx, objs, w.patch_px, rng)
            good.append(scenes.PALETTE[idx])
            bad.append(scenes.PALETTE[wrong])
            texts.append(p.text)
        s_good = score(model, torch.from_numpy(np.stack(good)), texts)
        s_bad = score(model, torch.from_numpy(np.stack(bad)), texts)
        out[kind] = float((s_good > s_bad).float().mean())
    return out
