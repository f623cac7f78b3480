"""The files evaluation metrics read, checked before any model loads: weights, processor and
tokenizer folders, reference images.

Every missing file raises :class:`MetricWeightsMissingError` naming the file, the config field
(``where``, e.g. ``eval.metrics[0]``) and the fix; :func:`check_metric_files` makes every check
of a :class:`~maskgrpo_ray.config.metrics.MetricSpec` without loading anything, before
any actor starts. Where each file comes from: docs/dependencies.md.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NoReturn

from maskgrpo_ray.config.metrics import METRICS_DOCS, WHERE_FROM, MetricSpec
from maskgrpo_ray.rewards.weights import RewardWeightsMissingError

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")


class MetricWeightsMissingError(RewardWeightsMissingError):
    """A metric's weights, processor or reference images are not on this machine
    (a ``FileNotFoundError``)."""


def image_files(folder: Path) -> list[Path]:
    """The images in ``folder`` and its subfolders (``IMAGE_SUFFIXES``), sorted by path."""
    return sorted(p for p in folder.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES)


def missing_file(where: str, field: str, path: Path | str, problem: str, fix: str) -> NoReturn:
    """Raise :class:`MetricWeightsMissingError`: ``<where>.<field>: <path> <problem>; <fix>``."""
    raise MetricWeightsMissingError(
        f"{where}.{field}: {path} {problem}; {fix} (see {METRICS_DOCS})"
    )


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
    fix = f"copy {WHERE_FROM[spec.kind]} here and point the field at it"
    weights = Path(str(spec.weights))
    if spec.kind == "pickscore":
        _check_pickscore_folders(spec, where)
    elif not weights.is_file():
        missing_file(where, "weights", weights, "is not a file", fix)
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
        from maskgrpo_ray.extras import check

        check("torch_fidelity", f"{where} (kind=fid)")
        ref = Path(str(spec.reference_dir))
        if not ref.is_dir():
            missing_file(
                where, "reference_dir", ref, "is not a folder", "point it at the reference images"
            )
        if not image_files(ref):
            missing_file(
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
        missing_file(where, "weights", weights / "config.json", "is not a file", fix)
    if not any((weights / f).is_file() for f in _HF_WEIGHT_FILES):
        missing_file(where, "weights", weights, f"holds none of {list(_HF_WEIGHT_FILES)}", fix)
    field, proc = ("processor", Path(spec.processor)) if spec.processor else ("weights", weights)
    for needed in _PROCESSOR_FILES:  # one of each group
        if not any((proc / f).is_file() for f in needed):
            fix = (
                "set processor to a local copy of laion/CLIP-ViT-H-14-laion2B-s32B-b79K "
                "(PickScore's processor)"
            )
            missing_file(where, field, proc, f"holds none of {list(needed)}", fix)


# the hub's folders have preprocessor_config.json, transformers 5 saves processor_config.json
_PROCESSOR_FILES = (
    ("preprocessor_config.json", "processor_config.json"),
    ("tokenizer.json", "vocab.json"),
)
_HF_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")  # never a pickle


def _check_imagereward_tokenizer(spec: MetricSpec, where: str) -> None:
    """ImageReward's BERT tokenizer: ``args.tokenizer`` (a folder or a cached repo id)."""
    from maskgrpo_ray.rewards.imagereward import TOKENIZER
    from maskgrpo_ray.rewards.weights import find_in_hf_cache

    tokenizer = str(spec.args.get("tokenizer", TOKENIZER))
    found = (
        (Path(tokenizer) / "vocab.txt").is_file()
        if os.path.isdir(tokenizer)
        else find_in_hf_cache(tokenizer, "vocab.txt", spec.args.get("cache_dir")) is not None
    )
    if not found:
        fix = "set args.tokenizer to a local copy of bert-base-uncased (vocab.txt)"
        missing_file(
            where, "args.tokenizer", tokenizer, "has no vocab.txt (folder or HF cache)", fix
        )
