"""Evaluation metrics, each behind a small interface, each from local files only.

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

Over all images (:class:`FidKid`): FID (Heusel et al. 2017) and KID (Binkowski et al. 2018)
against a folder of reference images, with torch-fidelity's own Inception feature extractor
and formulas; its weights come from a local file, never from the network.

Every missing file raises :class:`MetricWeightsMissingError` naming the file, the config field
(``where``, e.g. ``eval.metrics[0]``) and the fix; :func:`check_metric_files` makes the same
checks without loading anything, before any actor starts. Why these packages (torch-fidelity,
PickScore rather than HPSv2) and where each weight file comes from: docs/dependencies.md.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, NoReturn, Protocol

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from maskgrpo_ray.rewards.base import RewardWeightsMissingError, check_reward_inputs

log = logging.getLogger("maskgrpo")

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
RESERVED_NAMES = ("reward", "accuracy", "geneval")
"""Score names the evaluation itself writes (runner): a metric named so would overwrite them."""
_SET_BY_US = ("checkpoint", "model_name", "pretrained", "score", "device", "batch_size", "name")
_FIELD_KINDS = {"model": "clip_score", "processor": "pickscore", "reference_dir": "fid"}
_DOCS = "docs/dependencies.md#evaluation-metrics"
_WHERE_FROM = {
    "clip_score": "an open_clip checkpoint file of the architecture in `model`, e.g. "
    "open_clip_pytorch_model.bin of laion/CLIP-ViT-H-14-laion2B-s32B-b79K with model=ViT-H-14",
    "imagereward": "ImageReward.pt of THUDM/ImageReward",
    "pickscore": "the Hugging Face folder of yuvalkirstain/PickScore_v1 (config.json and "
    "model weights)",
    "fid": "torch-fidelity's Inception weights, weights-inception-2015-12-05-6726825d.pth "
    "(torch-fidelity release v0.2.0)",
}


class MetricWeightsMissingError(RewardWeightsMissingError):
    """A metric's weights, processor or reference images are not on this machine
    (a ``FileNotFoundError``)."""


class MetricSpec(BaseModel):
    """One evaluation metric (``eval.metrics[i]``, or ``maskgrpo eval --metric k=v,...``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["clip_score", "imagereward", "pickscore", "fid"] = Field(
        description="clip_score | imagereward | pickscore (per image) | fid (FID and KID over "
        "all images against reference_dir)"
    )
    name: str | None = Field(None, description="label in the report (default: the kind)")
    model: str | None = Field(
        None, description="clip_score: the open_clip architecture of weights, e.g. ViT-L-14"
    )
    weights: str | None = Field(
        None,
        description="a local path: open_clip checkpoint file (clip_score), ImageReward.pt "
        "(imagereward), the PickScore_v1 folder (pickscore), the Inception .pth (fid)",
    )
    processor: str | None = Field(
        None,
        description="pickscore: the processor/tokenizer folder, i.e. that of "
        "laion/CLIP-ViT-H-14-laion2B-s32B-b79K (default: weights)",
    )
    reference_dir: str | None = Field(
        None, description="fid: a folder of reference images (searched recursively)"
    )
    kid_subset_size: int = Field(
        1000, ge=2, description="fid: images per KID subset (capped at the number of images)"
    )
    batch_size: int = Field(32, ge=1, description="images per forward pass")
    args: dict[str, Any] = Field(
        default_factory=dict,
        description="clip_score/imagereward: extra keyword arguments of the reward class, "
        "e.g. imagereward's tokenizer folder {tokenizer: /models/bert-base-uncased}",
    )

    @model_validator(mode="after")
    def _check(self) -> MetricSpec:
        docs = f"see {_DOCS}"
        if not self.weights:
            raise ValueError(
                f"metric kind={self.kind}: field 'weights' is {self.weights!r}; every metric "
                f"reads its model from a local path: set weights to {_WHERE_FROM[self.kind]} "
                f"({docs})"
            )
        if self.kind == "clip_score" and not self.model:
            raise ValueError(
                f"metric kind=clip_score: field 'model' is {self.model!r}; name the open_clip "
                f"architecture of the weights, e.g. model=ViT-L-14 ({docs})"
            )
        if self.kind == "fid" and not self.reference_dir:
            raise ValueError(
                f"metric kind=fid: field 'reference_dir' is {self.reference_dir!r}; FID and KID "
                "compare against a folder of reference images: set reference_dir to one"
            )
        for field, kind in _FIELD_KINDS.items():
            if getattr(self, field) is not None and self.kind != kind:
                raise ValueError(
                    f"metric kind={self.kind}: field {field!r} = {getattr(self, field)!r} is only "
                    f"read by kind={kind}; remove it"
                )
        if self.args and self.kind not in ("clip_score", "imagereward"):
            raise ValueError(
                f"metric kind={self.kind}: field 'args' = {self.args!r} is only read by "
                "clip_score and imagereward; remove it"
            )
        if clash := sorted(set(self.args) & set(_SET_BY_US)):
            raise ValueError(
                f"metric kind={self.kind}: args {clash} are set from the spec's own fields "
                "(weights, batch_size, name) or fixed by the metric; remove them from args"
            )
        if self.name is not None and (
            not self.name.strip() or "/" in self.name or self.name in RESERVED_NAMES
        ):
            raise ValueError(
                f"metric kind={self.kind}: field 'name' = {self.name!r} must be non-empty, "
                f"without '/', and not one of {list(RESERVED_NAMES)} (the evaluation's own "
                "scores); choose another label"
            )
        return self

    @property
    def label(self) -> str:
        """The metric's name in the report: ``name``, else ``kind``."""
        return self.name or self.kind


# ----------------------------------------------------------------------------- file checks


def _missing(where: str, field: str, path: Path | str, problem: str, fix: str) -> NoReturn:
    raise MetricWeightsMissingError(f"{where}.{field}: {path} {problem}; {fix} (see {_DOCS})")


def check_metric_files(spec: MetricSpec, where: str | None = None) -> None:
    """Check that every path ``spec`` names is here; loads no model.

    Args:
        spec: the metric.
        where: the spec's place in the config for messages, e.g. ``"eval.metrics[0]"``
            (default: ``"metric '<label>'"``).

    Raises:
        MetricWeightsMissingError: naming the file, the field (``<where>.weights`` ...) and
            the fix.
        ValueError: ``model`` is not an open_clip architecture (clip_score).
    """
    where = where or f"metric {spec.label!r}"
    fix = f"copy {_WHERE_FROM[spec.kind]} here and point the field at it"
    weights = Path(str(spec.weights))
    if spec.kind == "pickscore":
        _check_pickscore_folders(spec, where)
    elif not weights.is_file():
        _missing(where, "weights", weights, "is not a file", fix)
    if spec.kind == "clip_score":
        import open_clip

        model = str(spec.model)
        if not model.startswith(("local-dir:", "hf-hub:")) and model not in open_clip.list_models():
            raise ValueError(
                f"{where}.model: {model!r} is not an open_clip architecture; name the one the "
                "weights were trained with, e.g. ViT-L-14 or ViT-H-14 (open_clip.list_models())"
            )
    if spec.kind == "imagereward":
        _check_imagereward_tokenizer(spec, where)
    if spec.kind == "fid":
        ref = Path(str(spec.reference_dir))
        if not ref.is_dir():
            _missing(
                where, "reference_dir", ref, "is not a folder", "point it at the reference images"
            )
        if not image_files(ref):
            _missing(
                where,
                "reference_dir",
                ref,
                f"holds no images ({'/'.join(IMAGE_SUFFIXES)}, searched recursively)",
                "fill it with the reference set (e.g. MSCOCO val images)",
            )


def _check_pickscore_folders(spec: MetricSpec, where: str) -> None:
    """PickScore_v1's model folder (config and weights) and its processor folder."""
    weights = Path(str(spec.weights))
    fix = "copy the whole Hugging Face folder of yuvalkirstain/PickScore_v1 here"
    if not (weights / "config.json").is_file():
        _missing(where, "weights", weights / "config.json", "is not a file", fix)
    if not any((weights / f).is_file() for f in _HF_WEIGHT_FILES):
        _missing(where, "weights", weights, f"holds none of {list(_HF_WEIGHT_FILES)}", fix)
    field, proc = ("processor", Path(spec.processor)) if spec.processor else ("weights", weights)
    for needed in _PROCESSOR_FILES:  # one of each group
        if not any((proc / f).is_file() for f in needed):
            fix = (
                "set processor to a local copy of laion/CLIP-ViT-H-14-laion2B-s32B-b79K "
                "(PickScore's processor)"
            )
            _missing(where, field, proc, f"holds none of {list(needed)}", fix)


# the hub's folders have preprocessor_config.json, transformers 5 saves processor_config.json
_PROCESSOR_FILES = (
    ("preprocessor_config.json", "processor_config.json"),
    ("tokenizer.json", "vocab.json"),
)
_HF_WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def _check_imagereward_tokenizer(spec: MetricSpec, where: str) -> None:
    """ImageReward's BERT tokenizer: ``args.tokenizer`` (a folder or a cached repo id)."""
    from maskgrpo_ray.rewards.base import find_in_hf_cache
    from maskgrpo_ray.rewards.imagereward import TOKENIZER

    tokenizer = str(spec.args.get("tokenizer", TOKENIZER))
    found = (
        (Path(tokenizer) / "vocab.txt").is_file()
        if os.path.isdir(tokenizer)
        else find_in_hf_cache(tokenizer, "vocab.txt", spec.args.get("cache_dir")) is not None
    )
    if not found:
        fix = "set args.tokenizer to a local copy of bert-base-uncased (vocab.txt)"
        _missing(where, "args.tokenizer", tokenizer, "has no vocab.txt (folder or HF cache)", fix)


# ----------------------------------------------------------------------------- per image


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
        ValueError: ``spec.kind`` is ``fid`` (a set metric: :class:`FidKid`).
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


# ----------------------------------------------------------------------------- FID and KID


def image_files(folder: Path) -> list[Path]:
    """The images in ``folder`` and its subfolders (``IMAGE_SUFFIXES``), sorted by path."""
    return sorted(p for p in folder.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES)


class FidKid:
    """FID and KID of a set of images against a folder of reference images.

    torch-fidelity's ``calculate_metrics(fid=True, kid=True)`` on two folders, on our images:
    its Inception-v3 (``inception-v3-compat``, 2048-d pool features of uint8 images, resized by
    the extractor to 299 px), its FID (TTUR's formula, statistics in float64) and its KID
    (100 subsets, polynomial kernel, ``rng_seed`` 2020, images in sorted path order). Folder
    features are kept in memory, keyed by the folder and its files' sizes and times, so the
    reference set is read once per instance.

    Args:
        spec: a ``kind="fid"`` metric; ``spec.weights`` is the Inception state dict file.
        device: where Inception runs (default: CPU).
        where: the spec's place in the config for messages (:func:`check_metric_files`).

    Raises:
        MetricWeightsMissingError: the weights file or the reference images are not here.
        ValueError: the weights file is not torch-fidelity's Inception state dict.
    """

    def __init__(
        self, spec: MetricSpec, device: torch.device | None = None, where: str | None = None
    ) -> None:
        from torch_fidelity.feature_extractor_inceptionv3 import FeatureExtractorInceptionV3

        if spec.kind != "fid":
            raise ValueError(f"FidKid needs a kind=fid metric, got kind={spec.kind}")
        self.where = where or f"metric {spec.label!r}"
        check_metric_files(spec, self.where)
        self.spec, self.device = spec, device or torch.device("cpu")
        try:
            self.extractor = FeatureExtractorInceptionV3(
                "inception-v3-compat", ["2048"], feature_extractor_weights_path=spec.weights
            ).to(self.device)
        except (RuntimeError, KeyError, TypeError, AttributeError, OSError) as err:
            raise ValueError(
                f"{self.where}.weights: {spec.weights} is not torch-fidelity's Inception state "
                f"dict ({type(err).__name__}: {str(err)[:200]}); use "
                f"weights-inception-2015-12-05-6726825d.pth (see {_DOCS})"
            ) from err
        self._folders: dict[str, tuple[tuple[tuple[str, int, int], ...], torch.Tensor]] = {}

    @torch.no_grad()
    def features(self, images: torch.Tensor) -> torch.Tensor:
        """Inception pool features float32 ``[N, 2048]`` (CPU) of uint8 ``[N, H, W, 3]``."""
        out = [torch.zeros(0, 2048)]
        for s in range(0, images.shape[0], self.spec.batch_size):
            x = images[s : s + self.spec.batch_size].permute(0, 3, 1, 2).contiguous()  # [n,3,H,W]
            out.append(self.extractor(x.to(self.device))[0].float().cpu())  # [n, 2048]
        return torch.cat(out)

    def folder_features(self, folder: Path) -> torch.Tensor:
        """Features ``[N, 2048]`` of a folder's images in sorted path order (RGB-converted;
        images of different sizes go through the extractor in separate batches)."""
        import numpy as np
        from PIL import Image

        paths = image_files(folder)
        files = tuple((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in paths)
        cached = self._folders.get(str(folder.resolve()))
        if cached is not None and cached[0] == files:
            return cached[1]
        chunks, bs = [torch.zeros(0, 2048)], self.spec.batch_size
        for s in range(0, len(paths), bs):
            arrays = [np.asarray(Image.open(p).convert("RGB")) for p in paths[s : s + bs]]
            for run in same_shape_runs(arrays):
                chunks.append(self.features(torch.from_numpy(np.stack(run))))  # [n, 2048]
        feats = torch.cat(chunks)  # [R, 2048]
        self._folders[str(folder.resolve())] = (files, feats)
        return feats

    def __call__(
        self, images: torch.Tensor | str | Path, reference_dir: str | Path | None = None
    ) -> dict[str, float]:
        """FID and KID of ``images`` (uint8 ``[N, H, W, 3]``, or a folder of images) against
        ``reference_dir`` (default: ``spec.reference_dir``).

        Returns:
            ``fid``; ``kid_mean`` and ``kid_std`` over the KID subsets; ``kid_subset_size``,
            the subset size used: ``spec.kid_subset_size`` capped at the smaller image count.
        """
        from torch_fidelity.metric_fid import fid_features_to_statistics, fid_statistics_to_metric
        from torch_fidelity.metric_kid import kid_features_to_metric

        ref_dir = Path(str(reference_dir or self.spec.reference_dir))
        if not image_files(ref_dir):
            _missing(self.where, "reference_dir", ref_dir, "holds no images", "fill it")
        ref = self.folder_features(ref_dir)  # [R, 2048]
        if isinstance(images, torch.Tensor):
            if images.dtype != torch.uint8 or images.dim() != 4 or images.shape[-1] != 3:
                raise ValueError(
                    f"FID/KID images must be uint8 [N, H, W, 3], got {images.dtype} "
                    f"{tuple(images.shape)}"
                )
            gen = self.features(images)  # [N, 2048]
        else:
            gen = self.folder_features(Path(images))
        if min(len(gen), len(ref)) < 2:
            raise ValueError(
                f"FID/KID need at least 2 images on each side: {len(gen)} images, {len(ref)} "
                f"reference images in {ref_dir}"
            )
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


def same_shape_runs(arrays: Sequence[Any]) -> list[list[Any]]:
    """Split ``arrays`` into consecutive runs of equal ``.shape`` (order kept)."""
    runs: list[list[Any]] = []
    for a in arrays:
        if runs and runs[-1][0].shape == a.shape:
            runs[-1].append(a)
        else:
            runs.append([a])
    return runs
