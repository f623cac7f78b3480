"""Per-image evaluation metrics, each behind a small interface, each from local files only.

Per image (:class:`SampleMetric`, ``(images uint8 [N, H, W, 3], prompts) -> float32 [N]``):

- ``clip_score``: ``100 * max(cos(image, text), 0)``, the convention of torchmetrics'
  ``CLIPScore`` (Hessel et al. 2021, CLIPScore with ``w = 100`` instead of 2.5), through our CLIP
  reward's model (``rewards/clip.py`` with ``score="cosine"``).
- ``imagereward``: ImageReward's score (Xu et al. 2023), through our ImageReward reward.
- ``pickscore``: PickScore (Kirstain et al. 2023), a Hugging Face ``CLIPModel`` checkpoint:
  ``exp(logit_scale) * cos(image, text)``, as its model card computes it.

The metrics run the models as their authors did: float32, and each model's own PIL transform
(``preprocess="pil"``; ``MetricSpec.args`` may override it). The training rewards use bf16 on
CUDA and batched tensor resizing instead, which is faster and changes only ranks within a group
marginally; a reported figure should not depend on that.

Over all images, FID and KID: :mod:`maskgrpo_ray.evaluation.fid`. A metric is named by a
:class:`~maskgrpo_ray.config.metrics.MetricSpec`; its files are checked first
(:func:`~maskgrpo_ray.evaluation.metric_files.check_metric_files`: a missing one raises
``MetricWeightsMissingError`` naming the file, the config field and the fix). Why these
packages (torch-fidelity, PickScore rather than HPSv2) and where each weight file comes from:
docs/dependencies.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from maskgrpo_ray.config.metrics import MetricSpec
from maskgrpo_ray.evaluation.metric_files import check_metric_files
from maskgrpo_ray.rewards.base import check_reward_inputs


class SampleMetric(Protocol):
    """``metric(images uint8 [N, H, W, 3] CPU, prompts: N str) -> float32 [N]`` on the CPU
    (NaN: the metric failed on that image)."""

    name: str
    higher_is_better: bool

    def __call__(self, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor: ...


def _in_float32(scorer: Any) -> None:
    """Our reward classes pick bf16 on CUDA (``model``, ``dtype``); a metric runs in float32."""
    scorer.model.float()
    scorer.dtype = torch.float32


class ClipScore:
    """CLIP score ``100 * max(cos(image, text), 0)`` [N] with an open_clip model."""

    higher_is_better = True

    def __init__(self, spec: MetricSpec, device: torch.device) -> None:
        from maskgrpo_ray.rewards.clip import ClipReward

        self.name = spec.label
        kwargs = {"preprocess": "pil", **spec.args}
        self.clip = ClipReward(
            str(spec.model),
            spec.weights,
            score="cosine",
            device=device,
            batch_size=spec.batch_size,
            name=spec.label,
            **kwargs,
        )
        _in_float32(self.clip)

    def __call__(self, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        return 100.0 * self.clip(images, prompts).clamp_min(0.0)  # [N]


class ImageRewardScore:
    """ImageReward's score [N] (our ImageReward reward, float32, the package's PIL transform)."""

    higher_is_better = True

    def __init__(self, spec: MetricSpec, device: torch.device) -> None:
        from maskgrpo_ray.rewards.imagereward import ImageRewardReward

        self.name = spec.label
        kwargs = {"preprocess": "pil", **spec.args}
        self.model = ImageRewardReward(
            spec.weights, device=device, batch_size=spec.batch_size, name=spec.label, **kwargs
        )
        _in_float32(self.model)

    def __call__(self, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        return self.model(images, prompts)  # [N]


class PickScore:
    """PickScore ``exp(logit_scale) * cos(image, text)`` [N] of a Hugging Face ``CLIPModel``
    (PickScore_v1's model card), with its processor's resizing, cropping and tokenizer."""

    higher_is_better = True

    def __init__(self, spec: MetricSpec, device: torch.device) -> None:
        from transformers import AutoProcessor, CLIPModel

        self.name, self.device, self.batch_size = spec.label, device, spec.batch_size
        folder = str(spec.weights)
        self.processor = AutoProcessor.from_pretrained(
            spec.processor or folder, local_files_only=True
        )
        model = CLIPModel.from_pretrained(folder, local_files_only=True)
        self.model = model.eval().requires_grad_(False).to(device, torch.float32)

    def _unit(self, feats: Any) -> torch.Tensor:
        # transformers 5 returns an output object whose pooler_output is the projection
        x = feats if isinstance(feats, torch.Tensor) else feats.pooler_output
        return x.float() / x.float().norm(dim=-1, keepdim=True)

    @torch.inference_mode()
    def __call__(self, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        from PIL import Image

        check_reward_inputs(images, prompts)
        position = {p: i for i, p in enumerate(dict.fromkeys(prompts))}
        unique = list(position)
        index = torch.tensor([position[p] for p in prompts], dtype=torch.long)  # [N]
        text = []
        for s in range(0, len(unique), self.batch_size):
            tokens = self.processor(
                text=unique[s : s + self.batch_size],
                padding=True,
                truncation=True,
                max_length=77,
                return_tensors="pt",
            ).to(self.device)
            text.append(self._unit(self.model.get_text_features(**tokens)))  # [p, D]
        txt = torch.cat(text) if text else torch.zeros(0)  # [P, D]
        out = []
        for s in range(0, images.shape[0], self.batch_size):
            pil = [Image.fromarray(a) for a in images[s : s + self.batch_size].numpy()]
            px = self.processor(images=pil, return_tensors="pt")["pixel_values"]
            img = self._unit(self.model.get_image_features(pixel_values=px.to(self.device)))
            out.append((img * txt[index[s : s + self.batch_size].to(self.device)]).sum(-1))
        scale = self.model.logit_scale.float().exp()
        return (scale * torch.cat(out)).cpu() if out else torch.zeros(0)  # [N]


def build_sample_metric(
    spec: MetricSpec, device: torch.device, where: str | None = None
) -> SampleMetric:
    """The per-image metric of ``spec`` on ``device``, after :func:`check_metric_files`.

    Raises:
        MetricWeightsMissingError: a file ``spec`` names is not here.
        ValueError: ``spec.kind`` is ``fid`` (a set metric:
            :class:`~maskgrpo_ray.evaluation.fid.FidKid`).
    """
    makers: dict[str, Any] = {
        "clip_score": ClipScore,
        "imagereward": ImageRewardScore,
        "pickscore": PickScore,
    }
    if spec.kind not in makers:
        raise ValueError(f"metric kind={spec.kind} scores a set of images: use FidKid")
    check_metric_files(spec, where)
    return makers[spec.kind](spec, device)
