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
    (PickScore_v1's model card), with its processor's resizing, cropping and tokenizer, in
    float32 (:class:`maskgrpo_ray.rewards.pickscore.PickScoreModel`, which the ``pickscore``
    reward kind runs too)."""

    higher_is_better = True

    def __init__(self, spec: MetricSpec, device: torch.device) -> None:
        from maskgrpo_ray.rewards.pickscore import PickScoreModel

        self.name = spec.label
        self.scorer = PickScoreModel(
            str(spec.weights), spec.processor, device, torch.float32, spec.batch_size
        )

    def __call__(self, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        check_reward_inputs(images, prompts)
        return self.scorer(images, prompts)  # [N]


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
