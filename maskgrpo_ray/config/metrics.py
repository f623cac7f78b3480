"""One evaluation metric as a config names it: ``eval.metrics[i]``, or ``maskgrpo eval --metric
k=v,...``, checked field by field (which kind reads which field, where its weights come from).

Plain pydantic (no torch): a section of the config tree (``config.run.EvalConfig`` holds it),
filed with the config family so the config imports nothing of the evaluation; the evaluation
reads it. The metrics
are :mod:`maskgrpo_ray.evaluation.metrics` (per image) and :mod:`maskgrpo_ray.evaluation.fid`
(FID and KID over a set); the checks of the files a spec names,
:mod:`maskgrpo_ray.evaluation.metric_files`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from maskgrpo_ray.config.base import Strict

RESERVED_NAMES = ("reward", "accuracy", "geneval")
"""Score names the evaluation itself writes (runner): a metric named so would overwrite them."""
_SET_BY_US = ("checkpoint", "model_name", "pretrained", "score", "device", "batch_size", "name")
_FIELD_KINDS = {"model": "clip_score", "processor": "pickscore", "reference_dir": "fid"}
METRICS_DOCS = "docs/dependencies.md#evaluation-metrics"
"""Where the metrics' weights and their sources are documented (named by every error)."""
WHERE_FROM = {
    "clip_score": "an open_clip checkpoint file of the architecture in `model`, e.g. "
    "open_clip_pytorch_model.bin of laion/CLIP-ViT-H-14-laion2B-s32B-b79K with model=ViT-H-14",
    "imagereward": "ImageReward.pt of THUDM/ImageReward",
    "pickscore": "the Hugging Face folder of yuvalkirstain/PickScore_v1 (config.json and "
    "model weights)",
    "fid": "torch-fidelity's Inception weights, weights-inception-2015-12-05-6726825d.pth "
    "(torch-fidelity release v0.2.0)",
}
"""Per metric kind, the file its ``weights`` names and where it comes from."""


class MetricSpec(Strict):
    """One evaluation metric (``eval.metrics[i]``, or ``maskgrpo eval --metric k=v,...``)."""

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
        docs = f"see {METRICS_DOCS}"
        if not self.weights:
            raise ValueError(
                f"metric kind={self.kind}: field 'weights' is {self.weights!r}; every metric "
                f"reads its model from a local path: set weights to {WHERE_FROM[self.kind]} "
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


DEFAULT_GENEVAL_DETECTOR = "official"
HUB_GENEVAL_DETECTOR = "hf://facebook/mask2former-swin-small-coco-instance"


class GenEvalJudgeConfig(Strict):
    """GenEval's scorer for the evaluation of a real model (``eval.geneval``): in the run and in
    ``maskgrpo eval``, when the evaluation prompts carry GenEval metadata (docs/evaluation.md).
    A run whose reward is ``geneval`` judges with it even when unset (its defaults): a judge
    the policy did not train against (docs/evaluation.md, "A held-out judge")."""

    detector: str = Field(
        DEFAULT_GENEVAL_DETECTOR,
        description="the Mask2Former COCO-instance detector: `official` (GenEval's own "
        "weights, OpenMMLab's mmdetection checkpoint, after `maskgrpo geneval convert-detector "
        "PATH.pth`), a local transformers folder (config.json, model.safetensors) or an hf:// "
        f"id resolved before any actor starts ({HUB_GENEVAL_DETECTOR}: Meta's Detectron2 "
        "training of the same architecture, converted by transformers; not GenEval's weights)",
    )
    colour_model: str = Field(
        "ViT-L-14", description="open_clip architecture of the colour classifier (GenEval's)"
    )
    colour_pretrained: str | None = Field(
        "openai",
        description="open_clip tag (looked up in the Hugging Face cache) or a local checkpoint "
        "of colour_model (GenEval's: openai)",
    )
    batch_size: int = Field(8, ge=1, description="images per detector forward pass")
    detector_scale: tuple[int, int] = Field(
        (1333, 800),
        description="the detector's test resize limits [long side, short side] (mmdetection's "
        "test pipeline, GenEval's; smaller only for tests)",
    )

    def reward_args(self) -> dict[str, Any]:
        """The ``geneval`` reward kind's arguments for this scorer (0/1 correctness)."""
        return {**self.model_dump(mode="json"), "terms": "correct"}
