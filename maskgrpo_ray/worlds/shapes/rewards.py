"""The shapes world's rewards: the learned contrastive model (``shapes_clip``, the world's
default reward, as CLIP is the paper's) and the judge's rule (``shapes_judge``, the evaluator:
its ``accuracy`` is GenEval's correctness; as a reward it is the second choice, a rule reward).

Both read decoded pixels, never tokens. A prompt outside the world's grammar scores NaN for
``shapes_judge`` (the driver counts and skips it); ``shapes_clip`` scores any prompt of the
world's vocabulary.
"""

from __future__ import annotations

import copy
from collections.abc import Hashable, Sequence
from typing import Any

import torch

from maskgrpo_ray.rewards.base import ModelReward, register_reward
from maskgrpo_ray.worlds.shapes import judge as judging
from maskgrpo_ray.worlds.shapes import scenes
from maskgrpo_ray.worlds.shapes.policy import WorldSpec
from maskgrpo_ray.worlds.shapes.reward_model import RewardModelSpec, load_or_train, score
from maskgrpo_ray.worlds.shapes.reward_refresh import refresh_model

JUDGE_TERMS = ("credit+correct", "credit", "correct")


class ShapesClipReward(ModelReward):
    """The world's contrastive reward model: ``exp(logit_scale) * cos(image, prompt)``
    (``score="cosine"``: ``cos`` alone), float ``[N]``; ``embed`` is its image tower. A
    :class:`~maskgrpo_ray.rewards.base.RefreshableReward` (``reward.refresh``:
    :mod:`maskgrpo_ray.worlds.shapes.reward_refresh`)."""

    def __init__(
        self, spec: RewardModelSpec, score_kind: str = "logits", name: str = "shapes_clip"
    ) -> None:
        if score_kind not in ("logits", "cosine"):
            raise ValueError(
                f"shapes_clip reward: score={score_kind!r} must be 'logits' or 'cosine'"
            )
        self._setup(name, "cpu", 256, "tensor")
        self.model = load_or_train(spec)
        self.score_kind = score_kind
        self._refresh: Any = None  # reward.refresh's section, once start_refresh is called
        self._optimizer: torch.optim.Optimizer | None = None

    def _score(self, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        self._scored += len(prompts)
        out = score(self.model, images.cpu(), list(prompts))
        if self.score_kind == "cosine":
            out = out / self.model.logit_scale.clamp(max=4.6052).exp()
        return out.float()

    def embed(self, images: torch.Tensor) -> torch.Tensor:
        """The reward model's image embedding (unit vectors), float ``[N, dim]``."""
        with torch.no_grad():
            return self.model.encode_image(images.cpu()).float()

    def start_refresh(self, settings: Any) -> None:
        """The model trainable, with its own AdamW (``settings``: ``reward.refresh``)."""
        self._refresh = settings
        self.model.requires_grad_(True)
        self._optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=settings.learning_rate, weight_decay=settings.weight_decay
        )

    def refresh(
        self, images: torch.Tensor, prompts: Sequence[str], seed: Sequence[int]
    ) -> dict[str, float]:
        """Train on reference renders of ``prompts`` against the policy's ``images`` uint8
        ``[N, H, W, 3]`` (:func:`~maskgrpo_ray.worlds.shapes.reward_refresh.refresh_model`)."""
        if self._optimizer is None:
            raise RuntimeError(f"{self.name}: refresh() before start_refresh()")
        return refresh_model(
            self.model, self._optimizer, images.cpu(), list(prompts), seed, self._refresh
        )

    def frozen_copy(self) -> ShapesClipReward:
        """This reward with a copy of its model as it is now, never refreshed."""
        frozen = copy.copy(self)
        frozen.model = copy.deepcopy(self.model).requires_grad_(False).eval()
        frozen._refresh, frozen._optimizer = None, None
        return frozen

    def refresh_state(self) -> dict[str, Any]:
        """The refreshed model's weights and its optimiser's state."""
        if self._optimizer is None:
            raise RuntimeError(f"{self.name}: refresh_state() before start_refresh()")
        return {"model": self.model.state_dict(), "optimizer": self._optimizer.state_dict()}

    def load_refresh_state(self, state: dict[str, Any]) -> None:
        if self._optimizer is None:
            raise RuntimeError(f"{self.name}: load_refresh_state() before start_refresh()")
        self.model.load_state_dict(state["model"])
        self._optimizer.load_state_dict(state["optimizer"])


@register_reward("shapes_clip", embeds=True, refreshes=True)
def build_shapes_clip(
    grid: int = 8,
    patch_px: int = 4,
    max_codes: int = 512,
    codebook_renders: int = 20000,
    seed: int = 0,
    dim: int = 128,
    width: int = 64,
    steps: int = 3000,
    batch: int = 96,
    lr: float = 2e-3,
    clutter: float = 0.5,
    score: str = "logits",
    name: str = "shapes_clip",
    model_seed: int | None = None,
) -> ShapesClipReward:
    """Factory: the world's settings (``model.shapes``'s, which the model kind passes as
    defaults), ``score`` (``logits`` or ``cosine``) and ``model_seed``: the seed the reward
    model is trained with (None: the world's ``seed``, the default model); another seed is
    another model of the same recipe, trained once and cached by its spec (the members of a
    ``reward.ensemble``, docs/monitors.md)."""
    world = WorldSpec(grid, patch_px, max_codes, codebook_renders, seed)
    spec = RewardModelSpec(
        world=world,
        dim=dim,
        width=width,
        steps=steps,
        batch=batch,
        lr=lr,
        clutter=clutter,
        seed=seed if model_seed is None else model_seed,
    )
    return ShapesClipReward(spec, score, name)


class ShapesJudgeReward:
    """GenEval's rule on the detector's objects, per image: ``credit`` (the share of the
    prompt's clauses that hold) + ``correct`` (1 when all hold) by default, in [0, 2];
    ``accuracy`` is ``correct`` (the world's GenEval proxy); ``embed`` the token-level colour
    layout (:func:`~maskgrpo_ray.worlds.shapes.judge.layout_features`), an embedding that is
    not the reward model's; ``layouts`` the detector's layout of each image
    (``diversity/layouts``)."""

    name = "shapes_judge"

    def __init__(self, patch_px: int = 4, terms: str = "credit+correct") -> None:
        if terms not in JUDGE_TERMS:
            raise ValueError(f"shapes_judge reward: terms={terms!r} must be one of {JUDGE_TERMS}")
        self.patch_px, self.terms = patch_px, terms

    def _judge(self, images: torch.Tensor, prompts: Sequence[str]) -> dict[str, torch.Tensor]:
        metas, ok = [], []
        for p in prompts:
            try:
                metas.append(scenes.parse(p).metadata())
                ok.append(True)
            except ValueError:
                metas.append({"include": [{"class": "none", "count": 1}]})
                ok.append(False)
        out = judging.judge(images, metas, self.patch_px)
        bad = ~torch.tensor(ok)
        return {k: torch.where(bad, torch.nan, v) for k, v in out.items()}

    def __call__(self, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        j = self._judge(images, prompts)
        if self.terms == "credit":
            return j["credit"]
        if self.terms == "correct":
            return j["geneval"]
        return j["credit"] + j["geneval"]

    def accuracy(self, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        return self._judge(images, prompts)["geneval"]

    def embed(self, images: torch.Tensor) -> torch.Tensor:
        return judging.layout_features(images, self.patch_px)

    def malformed_share(self, images: torch.Tensor) -> torch.Tensor:
        """Per image, float ``[N]``: the share of the objects the detector finds that are
        malformed (not a square, circle or triangle of a drawn size); NaN where it finds none
        (the monitors' ``image/malformed``)."""
        shares = []
        for dets in judging.detect(images, self.patch_px):
            bad = sum(d.cls == judging.MALFORMED for d in dets)
            shares.append(bad / len(dets) if dets else float("nan"))
        return torch.tensor(shares, dtype=torch.float32)

    def layouts(self, images: torch.Tensor) -> list[Hashable]:
        """The detected layout of each image (the class, colour and box of every object the
        detector finds: :func:`~maskgrpo_ray.worlds.shapes.judge.layout_key`), ``N`` keys:
        ``diversity/layouts`` counts the distinct ones of a group."""
        return [judging.layout_key(d) for d in judging.detect(images, self.patch_px)]


@register_reward("shapes_judge", embeds=True)
def build_shapes_judge(
    grid: int = 8, patch_px: int = 4, terms: str = "credit+correct", name: str = "shapes_judge"
) -> ShapesJudgeReward:
    """Factory: ``patch_px`` from the world (``grid`` is accepted for the world's defaults);
    ``terms``: ``credit+correct``, ``credit`` or ``correct``."""
    del grid
    r = ShapesJudgeReward(patch_px, terms)
    r.name = name
    return r
