"""GenEval's object detector in-process: transformers' Mask2Former with mmdetection's test
procedure, giving per-class boxes, scores and masks in pixels.

The official evaluator (djghosh13/geneval ``evaluation/evaluate_images.py``) runs mmdetection
2.x's ``mask2former_swin-s-p4-w7-224_lsj_8x2_50e_coco`` through ``inference_detector``. What
that does, and what :class:`Mask2FormerDetector` does the same way on transformers' model:

- input (the config's test pipeline): resize keeping the ratio into (1333, 800) (``mmcv``'s
  ``rescale_size``: scale ``min(1333 / long side, 800 / short side)``, sides ``int(x * s +
  0.5)``; bilinear, the result rounded to uint8 as cv2 writes it), pad bottom/right with the
  value 128 to a multiple of 32, then normalise with ImageNet's mean and std in 0-255 (the 2.x
  instance config, ``mask2former_r50_lsj_8x2_50e_coco.py``: ``pad_cfg = dict(img=(128, 128,
  128), ...)`` and ``Pad(size_divisor=32, pad_val=pad_cfg)`` before ``Normalize``);
- output (``MaskFormerFusionHead.instance_postprocess``, ``max_per_image=100``): the class
  softmax without the no-object column over ``queries x classes``, its top 100 pairs; each
  pair's mask logits upsampled (bilinear) to the padded input, cropped to the resized image,
  upsampled to the original image, thresholded at logit 0; the score is the class probability
  times the mean sigmoid over the mask's pixels; the box is the mask's tight box
  (``mask2bbox``: ``[x_first, y_first, x_last + 1, y_last + 1]``).

Boxes come from the masks, as mmdetection's Mask2Former makes them; transformers' own
``post_process_instance_segmentation`` is not used: it resizes every mask to 384 x 384
before thresholding, keeps no padding information and returns no boxes.

What is not the evaluator's: the weights unless the folder is ``official`` (GenEval's own
mmdetection checkpoint converted by ``maskgrpo geneval convert-detector``; the hub's
``facebook/mask2former-swin-small-coco-instance`` is Meta's Detectron2 training of the same
architecture), torch's bilinear resize for cv2's, and float rounding. Only masks of the classes a prompt names are upsampled: the rule
reads no other class, and the top-100 selection is made over all classes first, so the
result for those classes is the same.

The model is built from ``Mask2FormerModel`` and the class head (``class_predictor``), the
inference half of ``Mask2FormerForUniversalSegmentation``, whose constructor also builds the
training loss (and needs scipy); the checkpoint's keys are that class's. Weights load from
safetensors only.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from maskgrpo_ray.errors import UserError
from maskgrpo_ray.rewards.weights import missing

log = logging.getLogger(__name__)

MMDET_MEAN = (123.675, 116.28, 103.53)  # RGB, 0-255 (the config's img_norm_cfg)
MMDET_STD = (58.395, 57.12, 57.375)
TEST_SCALE = (1333, 800)  # (long side limit, short side limit): the test pipeline's img_scale
SIZE_DIVISOR = 32
PAD_VALUE = 128.0  # pixels, before Normalize (the 2.x instance config's pad_cfg img value)
MAX_PER_IMAGE = 100

# COCO label spellings of other releases -> GenEval's (evaluation/object_names.txt)
ALIASES = {
    "motorbike": "motorcycle",
    "aeroplane": "airplane",
    "sofa": "couch",
    "pottedplant": "potted plant",
    "diningtable": "dining table",
    "tvmonitor": "tv",
    "tv monitor": "tv",
    "mouse": "computer mouse",
    "remote": "tv remote",
    "keyboard": "computer keyboard",
    "cellphone": "cell phone",
    "hair dryer": "hair drier",
    "hairdrier": "hair drier",
    "ball": "sports ball",
}


class DetectorLabelsError(UserError, ValueError):
    """A detector whose class names do not cover GenEval's 80 COCO classes."""


def _norm(name: str) -> str:
    return " ".join(name.lower().replace("_", " ").replace("-", " ").split())


def geneval_label_map(id2label: dict[int, str], classes: Sequence[str]) -> dict[int, str]:
    """The detector's label ids -> GenEval's class names (``classes``), through the spellings
    of :data:`ALIASES`; labels that are none of ``classes`` (a panoptic model's stuff) are left
    out.

    Raises:
        DetectorLabelsError: some of ``classes`` has no label (one line, naming them).
    """
    known = {_norm(c): c for c in classes}
    out: dict[int, str] = {}
    for i, label in id2label.items():
        name = _norm(str(label))
        name = known.get(name) or known.get(_norm(ALIASES.get(name, "")), "")
        if name:
            out[int(i)] = name
    lost = [c for c in classes if c not in out.values()]
    if lost:
        raise DetectorLabelsError(
            f"GenEval detector: its config's id2label has no label for {lost} of GenEval's "
            f"{len(classes)} COCO classes; use a COCO instance model "
            "(facebook/mask2former-swin-small-coco-instance) or add the spelling to "
            "geneval_detector.ALIASES"
        )
    return out


# ----------------------------------------------------------------------------- the procedure


def resized_size(h: int, w: int, scale: tuple[int, int] = TEST_SCALE) -> tuple[int, int]:
    """mmcv's ``rescale_size`` with ``keep_ratio``: ``(h', w')`` inside ``scale``."""
    s = min(max(scale) / max(h, w), min(scale) / min(h, w))
    return int(h * s + 0.5), int(w * s + 0.5)


def detector_input(
    images: torch.Tensor, scale: tuple[int, int] = TEST_SCALE
) -> tuple[torch.Tensor, tuple[int, int]]:
    """uint8 ``[N, H, W, 3]`` -> (normalised float ``[N, 3, Hp, Wp]`` padded to
    :data:`SIZE_DIVISOR`, the resized ``(h, w)`` before padding). The padding is
    :data:`PAD_VALUE` in pixels, normalised with the image (mmdetection 2.x pads before it
    normalises)."""
    n, h, w, _ = images.shape
    rh, rw = resized_size(h, w, scale)
    x = images.permute(0, 3, 1, 2).float()  # [N, 3, H, W]
    if (rh, rw) != (h, w):
        x = F.interpolate(x, size=(rh, rw), mode="bilinear", align_corners=False)
        x = x.round().clamp(0, 255)  # cv2 writes uint8
    ph = -(-rh // SIZE_DIVISOR) * SIZE_DIVISOR
    pw = -(-rw // SIZE_DIVISOR) * SIZE_DIVISOR
    x = F.pad(x, (0, pw - rw, 0, ph - rh), value=PAD_VALUE)
    mean = x.new_tensor(MMDET_MEAN).view(1, 3, 1, 1)
    std = x.new_tensor(MMDET_STD).view(1, 3, 1, 1)
    return (x - mean) / std, (rh, rw)


def mask_boxes(masks: torch.Tensor) -> torch.Tensor:
    """mmdet's ``mask2bbox``: bool ``[k, H, W]`` -> float ``[k, 4]`` ``(x0, y0, x1, y1)``, the
    first and one past the last column and row a mask covers; zeros for an empty mask."""
    k, h, w = masks.shape
    if k == 0:
        return torch.zeros(0, 4)
    cols = masks.any(dim=1)  # [k, W]
    rows = masks.any(dim=2)  # [k, H]
    x0 = cols.float().argmax(dim=1)
    x1 = w - cols.flip(1).float().argmax(dim=1)
    y0 = rows.float().argmax(dim=1)
    y1 = h - rows.flip(1).float().argmax(dim=1)
    boxes = torch.stack([x0, y0, x1, y1], dim=1).float()
    return torch.where(cols.any(dim=1, keepdim=True), boxes, torch.zeros_like(boxes))


@dataclass(frozen=True)
class Instances:
    """One image's detections: ``boxes`` float ``[k, 5]`` ``(x0, y0, x1, y1, score)`` in the
    image's pixels, ``labels`` long ``[k]`` (the detector's ids), ``masks`` bool ``[k, H, W]``."""

    boxes: torch.Tensor
    labels: torch.Tensor
    masks: torch.Tensor


def instances(
    class_logits: torch.Tensor,
    mask_logits: torch.Tensor,
    padded: tuple[int, int],
    resized: tuple[int, int],
    original: tuple[int, int],
    keep: torch.Tensor | None = None,
    max_per_image: int = MAX_PER_IMAGE,
) -> Instances:
    """mmdet's ``instance_postprocess`` on one image's ``class_logits`` ``[Q, C + 1]`` and
    ``mask_logits`` ``[Q, h, w]`` (at a stride of the ``padded`` input); ``keep`` bool ``[C]``:
    the labels whose masks are computed (None: all). See the module docstring."""
    q, c = class_logits.shape[0], class_logits.shape[1] - 1
    scores = class_logits.float().softmax(-1)[:, :-1]  # [Q, C]
    top, index = scores.flatten().topk(min(max_per_image, q * c), sorted=False)
    labels, query = index % c, index // c
    if keep is not None:
        chosen = keep.to(labels.device)[labels]
        top, labels, query = top[chosen], labels[chosen], query[chosen]
    h, w = original
    if labels.numel() == 0:
        return Instances(torch.zeros(0, 5), labels.cpu(), torch.zeros(0, h, w, dtype=torch.bool))
    m = mask_logits[query].float()[None]  # [1, k, h4, w4]
    m = F.interpolate(m, size=padded, mode="bilinear", align_corners=False)
    m = m[:, :, : resized[0], : resized[1]]
    m = F.interpolate(m, size=original, mode="bilinear", align_corners=False)[0]  # [k, H, W]
    binary = m > 0
    mask_score = (m.sigmoid() * binary).flatten(1).sum(1) / (binary.flatten(1).sum(1) + 1e-6)
    boxes = torch.cat([mask_boxes(binary), (top * mask_score)[:, None]], dim=1)
    return Instances(boxes.cpu(), labels.cpu(), binary.cpu())


# ----------------------------------------------------------------------------- the model


class _Mask2Former(nn.Module):
    """The inference half of ``Mask2FormerForUniversalSegmentation`` (same parameter names)."""

    def __init__(self, config: Any) -> None:
        from transformers import Mask2FormerModel

        super().__init__()
        self.model = Mask2FormerModel(config)
        self.class_predictor = nn.Linear(config.hidden_dim, config.num_labels + 1)

    def forward(self, pixel_values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[N, 3, Hp, Wp]`` -> class logits ``[N, Q, C + 1]``, mask logits ``[N, Q, h, w]``
        of the last decoder layer (``Mask2FormerForUniversalSegmentation``'s final outputs)."""
        pixel = self.model.pixel_level_module(pixel_values=pixel_values)
        out = self.model.transformer_module(
            multi_scale_features=pixel.decoder_hidden_states,
            mask_features=pixel.decoder_last_hidden_state,
            output_hidden_states=True,
        )
        last = out.intermediate_hidden_states[-1].transpose(0, 1)  # [N, Q, D]
        return self.class_predictor(last), out.masks_queries_logits[-1]


WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")
PICKLES = ("pytorch_model.bin", "pytorch_model.bin.index.json")
HOW = (
    "  - `detector: official` is GenEval's own checkpoint after `maskgrpo geneval "
    "convert-detector PATH.pth`; or point `detector` at a local copy of facebook/mask2former-"
    "swin-small-coco-instance (config.json and model.safetensors; Meta's Detectron2 training), "
    "or at hf://facebook/mask2former-swin-small-coco-instance with MASKGRPO_ALLOW_DOWNLOADS=1 "
    "where the hub is reachable."
)


def check_detector_folder(folder: str | Path) -> None:
    """``folder`` holds a transformers Mask2Former (``config.json``) with safetensors weights.

    Raises:
        RewardWeightsMissingError: a file is missing, or the weights are only pickles.
    """
    where = Path(str(folder))
    what = "GenEval detector (Mask2Former)"
    if not (where / "config.json").is_file():
        raise missing(what, "config.json", [str(where)], HOW)
    if not any((where / f).is_file() for f in WEIGHT_FILES):
        pickled = [f for f in PICKLES if (where / f).is_file()]
        how = HOW
        if pickled:
            how = (
                f"  - {where} holds only {pickled} (a pickle, which this project never loads); "
                "use the repository's safetensors files (model.safetensors)"
            )
        raise missing(what, " or ".join(WEIGHT_FILES), [str(where)], how)


def _state_dict(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        state: dict[str, torch.Tensor] = {}
        for shard in shards:
            state.update(load_file(str(folder / shard)))
        return state
    return load_file(str(folder / "model.safetensors"))


SWIN = "model.pixel_level_module.encoder."
# transformers 4.x's Swin keys -> 5.x's (transformers' conversion_mapping.py, "swin" and
# "SwinBackbone"): the hub's facebook/mask2former-* checkpoints were written by 4.x
LEGACY_SWIN = (
    (".attention.self.relative_position_bias_table", ".attention.relative_position_bias.relative_position_bias_table"),  # noqa: E501
    (".attention.self.query.", ".attention.q_proj."),
    (".attention.self.key.", ".attention.k_proj."),
    (".attention.self.value.", ".attention.v_proj."),
    (".attention.output.dense.", ".attention.o_proj."),
    (".intermediate.dense.", ".mlp.fc1."),
    (".output.dense.", ".mlp.fc2."),
)  # fmt: skip


def current_layout(state: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    """Rename, in place, a checkpoint of transformers 4.x's layout (``encoder.embeddings``,
    ``encoder.encoder.layers...attention.self.query``) to the installed 5.x model's
    (``encoder.swin...attention.q_proj``), drop its ``relative_position_index`` buffers (5.x
    computes them) and fill ``swin.layernorm`` (new in 5.x, never read by the backbone) as an
    identity norm. Returns whether it was the old layout."""
    old = [k for k in state if k.startswith((SWIN + "embeddings.", SWIN + "encoder."))]
    if not old:
        return False
    for key in old:
        value = state.pop(key)
        if key.endswith("relative_position_index"):
            continue
        new = SWIN + "swin." + key[len(SWIN) :]
        for a, b in LEGACY_SWIN:
            new = new.replace(a, b)
        state[new] = value
    for key, value in want.items():
        if key.startswith(SWIN + "swin.layernorm.") and key not in state:
            state[key] = (
                torch.ones_like(value) if key.endswith("weight") else torch.zeros_like(value)
            )
    return True


class Mask2FormerDetector:
    """Mask2Former for COCO instance segmentation, run as mmdetection's test procedure.

    Args:
        folder: a transformers Mask2Former folder (``config.json`` + ``model.safetensors``).
        classes: GenEval's class names (its ``object_names.txt``); the model's labels are
            mapped onto them (:func:`geneval_label_map`).
        device: where it runs; float32 everywhere (mmdetection's test is float32).
        batch_size: images per forward pass.
        scale: the test resize limits ``(long, short)``; (1333, 800) is the evaluator's (tests
            use a smaller one on tiny images).
    """

    def __init__(
        self,
        folder: str | Path,
        classes: Sequence[str],
        device: torch.device,
        batch_size: int = 8,
        scale: tuple[int, int] = TEST_SCALE,
    ) -> None:
        from transformers import Mask2FormerConfig

        check_detector_folder(folder)
        folder = Path(str(folder))
        config = Mask2FormerConfig.from_pretrained(str(folder), local_files_only=True)
        id2label: dict[int, str] = {int(k): str(v) for k, v in (config.id2label or {}).items()}
        self.names = geneval_label_map(id2label, classes)  # label id -> class
        self.ids = {name: i for i, name in self.names.items()}
        self.num_labels = len(id2label)
        net = _Mask2Former(config)
        state = {k: v for k, v in _state_dict(folder).items() if not k.startswith("criterion.")}
        if current_layout(state, net.state_dict()):
            log.info("GenEval detector %s: transformers 4.x key layout, renamed to 5.x's", folder)
        missing_keys, unexpected = net.load_state_dict(state, strict=False)
        if missing_keys or unexpected:
            raise UserError(
                f"GenEval detector {folder}: the checkpoint does not fit Mask2Former's "
                f"inference model (missing {missing_keys[:3]}, unexpected {unexpected[:3]}); "
                "use a Mask2FormerForUniversalSegmentation checkpoint"
            )
        self.net = net.eval().requires_grad_(False).to(device, torch.float32)
        self.device, self.batch_size, self.scale = device, batch_size, tuple(scale)

    def keep_mask(self, classes: set[str]) -> torch.Tensor:
        """bool ``[C]``: the labels of ``classes`` (GenEval names)."""
        keep = torch.zeros(self.num_labels, dtype=torch.bool)
        keep[[self.ids[c] for c in classes]] = True
        return keep

    @torch.inference_mode()
    def detect(self, images: torch.Tensor, wanted: Sequence[set[str]]) -> list[Instances]:
        """Per image of uint8 ``[N, H, W, 3]``, its :class:`Instances` of the classes
        ``wanted[i]`` (GenEval names), every score before any threshold."""
        out: list[Instances] = []
        h, w = images.shape[1:3]
        for s in range(0, images.shape[0], self.batch_size):
            chunk = images[s : s + self.batch_size].to(self.device)
            pixels, resized = detector_input(chunk, self.scale)  # type: ignore[arg-type]
            class_logits, mask_logits = self.net(pixels)
            padded = (pixels.shape[2], pixels.shape[3])
            for k in range(chunk.shape[0]):
                keep = self.keep_mask(wanted[s + k])
                out.append(
                    instances(class_logits[k], mask_logits[k], padded, resized, (h, w), keep=keep)
                )
        return out


def save_tiny_random_mask2former(folder: str | Path, labels: Sequence[str], seed: int = 0) -> str:
    """A tiny random Mask2Former (the real classes: a 4-stage Swin of width 16, one encoder and
    two decoder layers, 12 queries) with ``labels`` as its classes, saved as transformers saves
    ``Mask2FormerForUniversalSegmentation`` (config.json, model.safetensors). Its class head is
    scaled up so that some queries are confident (a random head gives every class ~1/C).
    Returns the folder."""
    from safetensors.torch import save_file
    from transformers import Mask2FormerConfig, SwinConfig

    swin = SwinConfig(  # type: ignore[call-arg]
        embed_dim=16,
        depths=[1, 1, 1, 1],
        num_heads=[1, 1, 2, 2],
        window_size=4,
        drop_path_rate=0.0,
        out_features=["stage1", "stage2", "stage3", "stage4"],
    )
    config = Mask2FormerConfig(  # type: ignore[call-arg]
        backbone_config=swin,
        num_queries=12,
        hidden_dim=32,
        feature_size=32,
        mask_feature_size=32,
        encoder_layers=1,
        decoder_layers=2,
        dim_feedforward=64,
        encoder_feedforward_dim=64,
        num_attention_heads=2,
        num_labels=len(labels),
        id2label=dict(enumerate(labels)),
        label2id={n: i for i, n in enumerate(labels)},
    )
    torch.manual_seed(seed)
    net = _Mask2Former(config)
    with torch.no_grad():
        nn.init.normal_(net.class_predictor.weight, std=8.0 / config.hidden_dim**0.5)
    out = Path(str(folder))
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(out))
    state = {k: v.contiguous() for k, v in net.state_dict().items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return str(out)
