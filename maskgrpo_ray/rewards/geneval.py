"""GenEval (Ghosh et al., 2023) in-process: the scorer and the ``geneval`` reward kind.

:class:`GenEvalScorer` judges images against their GenEval metadata lines as the official
evaluator (djghosh13/geneval ``evaluation/evaluate_images.py``) does: its detector
(Mask2Former Swin-S for COCO instances, :mod:`maskgrpo_ray.rewards.geneval_detector`), its
colour classifier (open_clip ViT-L-14/openai zero-shot, :mod:`maskgrpo_ray.rewards.geneval_colour`)
and its rule, exact (:func:`maskgrpo_ray.prompts.geneval_rule.decide`). What is not exact:
the detector: ``detector: official`` is the evaluator's own weights (OpenMMLab's mmdetection
checkpoint, converted by ``maskgrpo geneval convert-detector``:
:mod:`maskgrpo_ray.rewards.geneval_convert`), the reward kind's default
``hf://facebook/mask2former-swin-small-coco-instance`` the same architecture trained by Meta
(Detectron2), which judges some images differently; resizing and rounding differ in small ways
(docs/evaluation.md). The official evaluator stays the number to publish; ``maskgrpo eval``
still writes its folder.

The reward kind ``geneval`` (:class:`GenEvalReward`) reads each image's metadata
(``uses_prompt_metadata``) and gives, per image, with ``terms``:

- ``clauses`` (the default): the share of the line's clauses (includes and excludes) that
  hold. GenEval's ``evaluate`` writes one reason line per failed clause, so the share is
  ``1 - reason lines / clauses``, read off the exact rule. Flow-GRPO (Liu et al., 2025) trains
  on a partial credit of this kind (its reward server's ``score``, the mean of per-clause
  credits), not on 0/1 correctness: a group whose images all fail still ranks the ones that
  got more of the prompt right. (Its credit also wants exact counts and grades a count by its
  distance; ours is GenEval's own rule, clause by clause.)
- ``correct``: GenEval's 0/1 correctness.

Its ``accuracy`` is always the 0/1 correctness: the training loop logs it. The evaluation inside
a run reports GenEval per tag (``eval_accuracy/<tag>``) and as GenEval's overall
(``eval_accuracy/tag_mean``) from ``eval.geneval``'s scorer, a second instance of this class
with its own detector (``official`` by default), not from the reward's
(:mod:`maskgrpo_ray.pipeline.geneval_judge`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from maskgrpo_ray.errors import UserError
from maskgrpo_ray.prompts.geneval_rule import decide
from maskgrpo_ray.prompts.geneval_schema import GENEVAL_CLASSES, TAGS
from maskgrpo_ray.rewards.base import default_device, register_reward
from maskgrpo_ray.rewards.geneval_colour import ColourClassifier, object_crop
from maskgrpo_ray.rewards.geneval_convert import HUB_DETECTRON2, resolve_detector
from maskgrpo_ray.rewards.geneval_detector import (
    TEST_SCALE,
    Mask2FormerDetector,
    check_detector_folder,
)
from maskgrpo_ray.weights.hub_field import SCHEME, HubField

log = logging.getLogger(__name__)

DEFAULT_DETECTOR = HUB_DETECTRON2  # the reward's default; eval.geneval's is `official`
TERMS = ("clauses", "correct")
FIX_META = "use GenEval metadata lines (`maskgrpo prompts make --kind geneval`, docs/evaluation.md)"


class GenEvalInputError(UserError, ValueError):
    """Images or metadata the GenEval scorer cannot judge (one line: the culprit and the fix)."""


def check_geneval_images(images: Any) -> None:
    """Raise :class:`GenEvalInputError` unless ``images`` is a uint8 tensor ``[N, H, W, 3]``."""
    if not isinstance(images, torch.Tensor):
        raise GenEvalInputError(
            f"GenEval scorer: images are a {type(images).__name__}; pass a torch uint8 tensor "
            "[N, H, W, 3] (RGB, channels last)"
        )
    if images.dtype != torch.uint8 or images.dim() != 4 or images.shape[-1] != 3:
        raise GenEvalInputError(
            f"GenEval scorer: images are {images.dtype} {tuple(images.shape)}; pass uint8 "
            "[N, H, W, 3] (RGB, channels last, 0-255), e.g. (x * 255).round().to(torch.uint8)"
            ".permute(0, 2, 3, 1) for a float [N, 3, H, W] in [0, 1]"
        )


def meta_classes(meta: Any, where: str) -> set[str]:
    """The classes a GenEval metadata line names; :class:`GenEvalInputError` (one line) when it
    is not a line the scorer can judge: no ``tag`` or an unknown one, no ``include``, a class
    GenEval's detector does not know."""
    if not isinstance(meta, Mapping):
        raise GenEvalInputError(f"{where}: no GenEval metadata line ({meta!r}); {FIX_META}")
    if "tag" not in meta:
        raise GenEvalInputError(
            f"{where}: the metadata line has no field 'tag' (one of {list(TAGS)}); {FIX_META}"
        )
    clauses = [*meta.get("include", []), *meta.get("exclude", [])]
    if not meta.get("include") or not all(isinstance(c, Mapping) for c in clauses):
        raise GenEvalInputError(
            f"{where}: field 'include' must be a non-empty list of {{class, count}}; {FIX_META}"
        )
    names = {str(c.get("class")) for c in clauses}
    unknown = sorted(names - set(GENEVAL_CLASSES))
    if unknown:
        raise GenEvalInputError(
            f"{where}: class {unknown[0]!r} is not one of GenEval's 80 COCO classes (its "
            "detector finds no other); name a class of geneval_schema.GENEVAL_CLASSES, e.g. "
            "'dog', 'tv remote', 'computer mouse'"
        )
    return names


@dataclass(frozen=True)
class Judgement:
    """GenEval's answer on one image: ``correct``, the evaluator's ``reason`` text, and the share
    of the metadata's clauses that hold (``1 - reason lines / clauses``)."""

    correct: bool
    reason: str
    clauses: float


def clause_share(reason: str, meta: Mapping[str, Any]) -> float:
    """``1 - failed / clauses``: GenEval's ``evaluate`` writes exactly one reason line per
    failed include clause (count, colour or position: the first failure ends the clause) and
    per failed exclude clause."""
    n = len(meta.get("include", [])) + len(meta.get("exclude", []))
    failed = len([line for line in reason.split("\n") if line.strip()])
    return 1.0 - failed / n


class GenEvalScorer:
    """GenEval's judgement of images, in-process (see the module docstring).

    Args:
        detector: a local transformers Mask2Former folder (config.json + model.safetensors),
            or ``official`` (GenEval's own weights, converted: ``maskgrpo geneval
            convert-detector``); ``hf://`` ids are resolved by the driver before
            (:mod:`maskgrpo_ray.weights.hub`).
        colour_model, colour_pretrained: the open_clip colour classifier (``ViT-L-14`` /
            ``openai``: the evaluator's), as the CLIP reward's ``model_name``/``pretrained``.
        device: where both models run (None: CUDA if present, else CPU).
        batch_size: images per detector forward pass (and crops per colour pass).
        detector_scale: the detector's test resize ``[long, short]`` (the evaluator's
            [1333, 800]).
        cache_dir: Hugging Face cache folder for the colour weights.
    """

    def __init__(
        self,
        detector: str,
        colour_model: str = "ViT-L-14",
        colour_pretrained: str | None = "openai",
        *,
        device: str | torch.device | None = None,
        batch_size: int = 8,
        detector_scale: Sequence[int] = TEST_SCALE,
        cache_dir: str | None = None,
    ) -> None:
        if str(detector).startswith(SCHEME):
            raise GenEvalInputError(
                f"GenEval scorer: detector {detector!r} is a hub id; `maskgrpo` resolves it to a "
                "local folder before any actor starts; in Python pass the local folder (e.g. "
                "`hf download facebook/mask2former-swin-small-coco-instance --local-dir DIR`)"
            )
        detector = resolve_detector(detector)
        self.device = default_device(device)
        scale = (int(detector_scale[0]), int(detector_scale[1]))
        self.detector = Mask2FormerDetector(
            detector, GENEVAL_CLASSES, self.device, batch_size=batch_size, scale=scale
        )
        self.colours = ColourClassifier(
            colour_model, colour_pretrained, self.device, batch_size=2 * batch_size,
            cache_dir=cache_dir,
        )  # fmt: skip

    def judge(self, images: torch.Tensor, metas: Sequence[Mapping[str, Any]]) -> list[Judgement]:
        """GenEval's :class:`Judgement` of each image of uint8 ``[N, H, W, 3]`` against its
        metadata line (``metas[i]``).

        Raises:
            GenEvalInputError: images of another shape or dtype, a metadata count that is not
                ``N``, a line without ``tag`` or naming a class GenEval does not know.
        """
        check_geneval_images(images)
        if len(metas) != images.shape[0]:
            raise GenEvalInputError(
                f"GenEval scorer: {images.shape[0]} images but {len(metas)} metadata lines; "
                "pass one line per image"
            )
        wanted = [meta_classes(m, f"metadata[{i}]") for i, m in enumerate(metas)]
        found = self.detector.detect(images, wanted)  # [N] Instances
        out = []
        for i, (meta, inst) in enumerate(zip(metas, found, strict=True)):
            out.append(self._one(images[i], meta, inst, wanted[i]))
        return out

    def _one(self, image: torch.Tensor, meta: Mapping[str, Any], inst: Any, wanted: set[str]):
        from PIL import Image

        pil = Image.fromarray(image.cpu().numpy())
        boxes = inst.boxes.numpy().astype(np.float32)  # [k, 5]
        detections: dict[str, list[tuple[Any, ...]]] = {c: [] for c in wanted}
        for k, label in enumerate(inst.labels.tolist()):
            name = self.detector.names[label]
            detections[name].append((*boxes[k], inst.masks[k].numpy()))

        def colour_fn(classname: str, objs: list[tuple[Any, ...]]) -> list[str]:
            crops = [object_crop(pil, obj[:4], obj[5]) for obj in objs]
            return self.colours.classify(crops, classname)

        correct, reason = decide(detections, meta, colour_fn)
        return Judgement(bool(correct), reason, clause_share(reason, meta))


# ----------------------------------------------------------------------------- the reward kind


def check_files(
    detector: str = DEFAULT_DETECTOR,
    colour_model: str = "ViT-L-14",
    colour_pretrained: str | None = "openai",
    cache_dir: str | None = None,
    **_: Any,
) -> None:
    """The files a :class:`GenEvalReward` with these arguments reads are here (a hub id is
    checked by the hub resolution instead); nothing is built."""
    from maskgrpo_ray.rewards.clip import resolve_clip_weights

    if not str(detector).startswith(SCHEME):
        check_detector_folder(resolve_detector(detector))
    resolve_clip_weights(colour_model, colour_pretrained, cache_dir)


HUB_DETECTOR = HubField("detector", allow_patterns=("*.json", "*.safetensors"))
"""``detector: hf://facebook/mask2former-swin-small-coco-instance`` is fetched by the driver
(config and safetensors only: a pickle is never loaded)."""


@register_reward("geneval", takes_device=True, check_files=check_files, hub_fields=(HUB_DETECTOR,))
class GenEvalReward:
    """GenEval's rule as a reward: ``reward(images, prompts, metas) -> float32 [N]``.

    Args:
        detector, colour_model, colour_pretrained, batch_size, detector_scale, cache_dir:
            the scorer's (:class:`GenEvalScorer`).
        terms: ``clauses`` (share of the clauses that hold) or ``correct`` (0/1).
        device: where the models run (the reward actor's GPU share, ``reward.num_gpus_per_actor``).
        name: key of this reward in the composite report.

    A prompt whose metadata the scorer cannot judge (none, no ``tag``, a class GenEval does not
    know) gets NaN on its images, with a warning: the run counts them (``reward_failures/<name>/
    nonfinite``) and skips their groups; the other prompts of the batch are scored.
    """

    uses_prompt_metadata = True

    def __init__(
        self,
        detector: str = DEFAULT_DETECTOR,
        colour_model: str = "ViT-L-14",
        colour_pretrained: str | None = "openai",
        *,
        terms: str = "clauses",
        device: str | torch.device | None = None,
        batch_size: int = 8,
        detector_scale: Sequence[int] = TEST_SCALE,
        cache_dir: str | None = None,
        name: str = "geneval",
    ) -> None:
        if terms not in TERMS:
            raise GenEvalInputError(f"geneval reward: terms={terms!r}; use one of {list(TERMS)}")
        self.name, self.terms = name, terms
        self.scorer = GenEvalScorer(
            detector,
            colour_model,
            colour_pretrained,
            device=device,
            batch_size=batch_size,
            detector_scale=detector_scale,
            cache_dir=cache_dir,
        )
        self._last: tuple[Any, list[str], list[Judgement | None]] | None = None
        self._scored = self._unjudged = 0

    def judgements(
        self, images: torch.Tensor, prompts: Sequence[str], metas: Sequence[Any] | None
    ) -> list[Judgement | None]:
        """Per image its :class:`Judgement`, None where its metadata cannot be judged (logged);
        the last batch's answer is kept, so ``__call__`` and ``accuracy`` on the same images
        run the models once."""
        if self._last is not None and self._last[0] is images and self._last[1] == list(prompts):
            return self._last[2]
        check_geneval_images(images)
        metas = list(metas) if metas is not None else [None] * len(prompts)
        ok: list[int] = []
        for i, (prompt, meta) in enumerate(zip(prompts, metas, strict=True)):
            try:
                meta_classes(meta, f"geneval reward, prompt {prompt!r}")
                ok.append(i)
            except GenEvalInputError as err:
                if not self._unjudged:
                    log.warning("%s (its images get NaN, counted and skipped)", err)
                self._unjudged += 1
        out: list[Judgement | None] = [None] * len(prompts)
        if ok:
            judged = self.scorer.judge(images[ok], [metas[i] for i in ok])
            for i, j in zip(ok, judged, strict=True):
                out[i] = j
        self._scored += len(ok)
        self._last = (images, list(prompts), out)
        return out

    def __call__(
        self, images: torch.Tensor, prompts: Sequence[str], metas: Sequence[Any] | None = None
    ) -> torch.Tensor:
        """float32 ``[N]``: the share of clauses that hold (``terms: clauses``) or 0/1."""
        judged = self.judgements(images, prompts, metas)
        key = "clauses" if self.terms == "clauses" else "correct"
        return torch.tensor(
            [math.nan if j is None else float(getattr(j, key)) for j in judged],
            dtype=torch.float32,
        )

    def accuracy(
        self, images: torch.Tensor, prompts: Sequence[str], metas: Sequence[Any] | None = None
    ) -> torch.Tensor:
        """float32 ``[N]``: GenEval's 0/1 correctness (NaN where unjudged)."""
        judged = self.judgements(images, prompts, metas)
        return torch.tensor(
            [math.nan if j is None else float(j.correct) for j in judged], dtype=torch.float32
        )

    def stats(self) -> dict[str, float]:
        """Cumulative counters: images judged, images whose metadata could not be judged."""
        return {"images_judged": float(self._scored), "images_unjudged": float(self._unjudged)}
