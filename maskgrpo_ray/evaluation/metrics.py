"""Evaluation metrics, each behind a small interface, each from local weights only.

Per image (:class:`SampleMetric`, ``(images uint8 [N, H, W, 3], prompts) -> float32 [N]``):

- ``clip_score``: ``100 * max(cos(image, text), 0)`` (the convention of torchmetrics'
  ``CLIPScore``, after Hessel et al. 2021 with ``w = 100``), through our CLIP reward's model
  and preprocessing (``rewards/clip.py``, ``score="cosine"``).
- ``imagereward``: ImageReward's score, through our ImageReward reward (``rewards/imagereward.py``).
- ``pickscore``: PickScore (Kirstain et al. 2023), a Hugging Face ``CLIPModel`` checkpoint:
  ``exp(logit_scale) * cos(image, text)`` as its model card computes it.

Over all images (:class:`FidKid`): FID and KID against a folder of reference images, with
torch-fidelity's own Inception feature extractor, statistics and formulas; the Inception
weights come from a local file (``weights``), never from the network.

The choices (torch-fidelity, PickScore rather than HPSv2) are in docs/dependencies.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, Protocol

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from maskgrpo_ray.rewards.base import RewardWeightsMissingError

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")


class MetricWeightsMissingError(RewardWeightsMissingError):
    """A metric's weights, processor or reference folder is not on this machine."""


class MetricSpec(BaseModel):
    """One evaluation metric (``eval.metrics[i]``, or ``maskgrpo eval --metric``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["clip_score", "imagereward", "pickscore", "fid"] = Field(
        description="clip_score | imagereward | pickscore (per image) | fid (FID and KID over "
        "all images against reference_dir)"
    )
    name: str | None = Field(None, description="label in the report (default: the kind)")
    model: str | None = Field(
        None, description="clip_score: the open_clip architecture, e.g. ViT-L-14"
    )
    weights: str | None = Field(
        None,
        description="a local path: open_clip checkpoint file (clip_score), ImageReward.pt "
        "(imagereward), the PickScore_v1 folder (pickscore), the Inception .pth (fid)",
    )
    processor: str | None = Field(
        None, description="pickscore: the processor/tokenizer folder (default: weights)"
    )
    reference_dir: str | None = Field(
        None, description="fid: a folder of reference images (e.g. MSCOCO val captions' images)"
    )
    kid_subset_size: int = Field(
        1000, ge=2, description="fid: KID subset size (capped at the number of images)"
    )
    batch_size: int = Field(32, ge=1, description="images per forward pass")
    args: dict[str, Any] = Field(
        default_factory=dict,
        description="extra keyword arguments of the underlying model (e.g. imagereward's "
        "tokenizer folder)",
    )

    @model_validator(mode="after")
    def _needs(self) -> MetricSpec:
        fix = "see docs/evaluation.md (metrics)"
        if self.weights is None:
            raise ValueError(
                f"metric kind={self.kind}: field 'weights' is not set; give the local path of "
                f"its weights ({fix})"
            )
        if self.kind == "clip_score" and not self.model:
            raise ValueError(
                "metric kind=clip_score: field 'model' is not set; name the open_clip "
                f"architecture of the weights, e.g. model=ViT-L-14 ({fix})"
            )
        if self.kind == "fid" and not self.reference_dir:
            raise ValueError(
                "metric kind=fid: field 'reference_dir' is not set; give a folder of reference "
                f"images ({fix})"
            )
        return self

    @property
    def label(self) -> str:
        return self.name or self.kind


def check_metric_files(spec: MetricSpec, where: str) -> None:
    """Raise :class:`MetricWeightsMissingError` naming the file, the field (``where`` is the
    spec's place, e.g. ``eval.metrics[0]``) and the fix, unless every path ``spec`` names
    exists; loads nothing."""
    weights = Path(str(spec.weights))
    if spec.kind == "pickscore":
        for field, path in (("weights", weights), ("processor", Path(spec.processor or weights))):
            if not path.is_dir():
                raise MetricWeightsMissingError(
                    f"{where}.{field}: {path} is not a folder; pickscore needs the local "
                    "Hugging Face folders of yuvalkirstain/PickScore_v1 (weights) and of "
                    "laion/CLIP-ViT-H-14-laion2B-s32B-b79K (processor); download them on a "
                    "machine with network access and copy them here"
                )
    elif not weights.is_file():
        raise MetricWeightsMissingError(
            f"{where}.weights: no file {weights}; {spec.kind} needs its weights as a local "
            "file (docs/dependencies.md#evaluation-metrics says where each comes from)"
        )
    if spec.kind == "fid":
        ref = Path(str(spec.reference_dir))
        if not ref.is_dir() or not image_files(ref):
            raise MetricWeightsMissingError(
                f"{where}.reference_dir: {ref} is not a folder of images "
                f"({'/'.join(IMAGE_SUFFIXES)}); point it at the reference set"
            )


class SampleMetric(Protocol):
    """``metric(images uint8 [N, H, W, 3], prompts) -> float32 [N]`` (NaN: failed image)."""

    name: str
    higher_is_better: bool

    def __call__(self, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor: ...


class ClipScore:
    """``100 * max(cos, 0)`` with an open_clip model (our CLIP reward in cosine mode)."""

    higher_is_better = True

    def __init__(self, spec: MetricSpec, device: torch.device) -> None:
        from maskgrpo_ray.rewards.clip import ClipReward

        self.name = spec.label
        self.clip = ClipReward(
            str(spec.model),
            spec.weights,
            score="cosine",
            device=device,
            batch_size=spec.batch_size,
            **spec.args,
        )

    def __call__(self, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        return 100.0 * self.clip(images, prompts).clamp_min(0.0)


class ImageRewardScore:
    """ImageReward's score (our ImageReward reward)."""

    higher_is_better = True

    def __init__(self, spec: MetricSpec, device: torch.device) -> None:
        from maskgrpo_ray.rewards.imagereward import ImageRewardReward

        self.name = spec.label
        self.model = ImageRewardReward(
            spec.weights, device=device, batch_size=spec.batch_size, **spec.args
        )

    def __call__(self, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        return self.model(images, prompts)


class PickScore:
    """PickScore: ``exp(logit_scale) * cos(image, text)`` of a Hugging Face ``CLIPModel``."""

    higher_is_better = True

    def __init__(self, spec: MetricSpec, device: torch.device) -> None:
        from transformers import AutoProcessor, CLIPModel

        self.name, self.device, self.batch_size = spec.label, device, spec.batch_size
        self.processor = AutoProcessor.from_pretrained(spec.processor or spec.weights)
        self.model = CLIPModel.from_pretrained(spec.weights).eval().requires_grad_(False)
        self.model.to(device)

    @torch.inference_mode()
    def __call__(self, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        from PIL import Image

        out = []
        for s in range(0, images.shape[0], self.batch_size):
            pil = [Image.fromarray(a) for a in images[s : s + self.batch_size].cpu().numpy()]
            px = self.processor(images=pil, return_tensors="pt")["pixel_values"]
            tx = self.processor(
                text=list(prompts[s : s + self.batch_size]),
                padding=True,
                truncation=True,
                max_length=77,
                return_tensors="pt",
            )
            img = self.model.get_image_features(pixel_values=px.to(self.device))
            txt = self.model.get_text_features(
                input_ids=tx["input_ids"].to(self.device),
                attention_mask=tx["attention_mask"].to(self.device),
            )
            img = _embeds(img)
            txt = _embeds(txt)
            img = img / img.norm(dim=-1, keepdim=True)
            txt = txt / txt.norm(dim=-1, keepdim=True)
            out.append(self.model.logit_scale.exp() * (img * txt).sum(-1))
        return torch.cat(out).float().cpu()


def _embeds(x: Any) -> torch.Tensor:
    """transformers 5 may return a model output object where 4.x returned the tensor."""
    if isinstance(x, torch.Tensor):
        return x
    return x.pooler_output


def build_sample_metric(spec: MetricSpec, device: torch.device) -> SampleMetric:
    """The per-image metric of ``spec`` (not ``fid``)."""
    makers: dict[str, Any] = {
        "clip_score": ClipScore,
        "imagereward": ImageRewardScore,
        "pickscore": PickScore,
    }
    if spec.kind not in makers:
        raise ValueError(f"metric kind={spec.kind} is not per image")
    return makers[spec.kind](spec, device)


# ----------------------------------------------------------------------------- FID and KID


def image_files(folder: Path) -> list[Path]:
    """The images directly in ``folder`` or below it, sorted."""
    return sorted(p for p in folder.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES)


def load_images(paths: Sequence[Path]) -> torch.Tensor:
    """uint8 ``[N, H, W, 3]`` (all images the same size)."""
    import numpy as np
    from PIL import Image

    return torch.from_numpy(np.stack([np.asarray(Image.open(p).convert("RGB")) for p in paths]))


class FidKid:
    """FID and KID of a set of images against ``reference_dir`` (torch-fidelity's features and
    formulas; Inception weights from ``spec.weights``). Reference features are kept after the
    first call."""

    def __init__(self, spec: MetricSpec, device: torch.device | None = None) -> None:
        from torch_fidelity.feature_extractor_inceptionv3 import FeatureExtractorInceptionV3

        self.spec, self.device = spec, device or torch.device("cpu")
        self.extractor = FeatureExtractorInceptionV3(
            "inception-v3-compat", ["2048"], feature_extractor_weights_path=spec.weights
        ).to(self.device)
        self._reference: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def features(self, images: torch.Tensor) -> torch.Tensor:
        """Inception pool features ``[N, 2048]`` of uint8 ``[N, H, W, 3]`` images."""
        out = []
        for s in range(0, images.shape[0], self.spec.batch_size):
            x = images[s : s + self.spec.batch_size].permute(0, 3, 1, 2).contiguous()
            out.append(self.extractor(x.to(self.device))[0].cpu())
        return torch.cat(out)

    def folder_features(self, folder: Path) -> torch.Tensor:
        key = str(folder)
        if key not in self._reference:
            paths = image_files(folder)
            chunks = [
                self.features(load_images(paths[s : s + 256])) for s in range(0, len(paths), 256)
            ]
            self._reference[key] = torch.cat(chunks)
        return self._reference[key]

    def __call__(
        self, images: torch.Tensor | Path, reference_dir: str | Path | None = None
    ) -> dict[str, float]:
        """``{"fid", "kid_mean", "kid_std", "kid_subset_size"}`` of ``images`` (uint8
        ``[N, H, W, 3]`` or a folder) against ``reference_dir`` (default: the spec's)."""
        from torch_fidelity.metric_fid import fid_features_to_statistics, fid_statistics_to_metric
        from torch_fidelity.metric_kid import kid_features_to_metric

        ref = self.folder_features(Path(str(reference_dir or self.spec.reference_dir)))
        gen = self.folder_features(images) if isinstance(images, Path) else self.features(images)
        fid = fid_statistics_to_metric(
            fid_features_to_statistics(gen), fid_features_to_statistics(ref), verbose=False
        )["frechet_inception_distance"]
        subset = min(self.spec.kid_subset_size, len(gen), len(ref))
        kid = kid_features_to_metric(gen, ref, kid_subset_size=subset, verbose=False)
        return {
            "fid": float(fid),
            "kid_mean": float(kid["kernel_inception_distance_mean"]),
            "kid_std": float(kid["kernel_inception_distance_std"]),
            "kid_subset_size": float(subset),
        }
