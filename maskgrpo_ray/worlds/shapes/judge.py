"""The shapes world's judge: a detector on decoded pixels and GenEval's rule on what it finds.

Detection (:func:`detect`), exact for the world's renders and strict for anything else:

1. every pixel takes the nearest palette colour (background or one of the world's colours);
2. connected components of one colour (4-neighbours) are the candidate objects;
3. a component is an object of class ``c`` when its bounding box is a square of an object's
   side (``4 s - 2`` pixels for a box of ``s`` tokens: 6, 10 or 14) and its pixels match
   ``c``'s mask at that side but for at most :data:`MAX_WRONG_PX` pixel (a stray pixel
   passes; a wrong token's piece, 4 pixels or more, never does); anything else
   is a malformed object (``class "malformed"``): a blob of the right colour is not a square,
   half a circle is not a circle, a stray piece is no object.

GenEval's rule, the official evaluator's (:func:`maskgrpo_ray.prompts.geneval_rule.decide`:
its thresholds, score order, ``evaluate``), then judges the objects' pixel boxes against a
prompt's metadata (:func:`rule_detections`: the score is the object's mask match, the colour its
palette colour): the includes hold (counts, colours of the ``count`` most confident, relations
between boxes with the evaluator's dead zone) and no exclude is met. Malformed objects match no
class, so they never satisfy an include; like any extra object they fail an image only through an
exclude.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from maskgrpo_ray.prompts.geneval_rule import decide, relative_position
from maskgrpo_ray.worlds.shapes.scenes import (
    CLASSES,
    COLOUR_NAMES,
    PALETTE,
    SIZES,
    box_colours,
    shape_mask,
)

MAX_WRONG_PX = 1
MALFORMED = "malformed"


@dataclass(frozen=True)
class Detection:
    """One detected object: ``cls`` (a class of :data:`CLASSES` or ``"malformed"``), its colour,
    its box ``(top, left, height, width)`` in pixels, and its box centre ``xy`` in token units."""

    cls: str
    colour: str
    box: tuple[int, int, int, int]
    xy: tuple[float, float]
    iou: float


def palette_indices(images: torch.Tensor) -> torch.Tensor:
    """Nearest palette colour of every pixel: uint8 ``[N, H, W, 3]`` -> long ``[N, H, W]``."""
    pal = torch.from_numpy(PALETTE).float()  # [K, 3]
    d = ((images.float()[..., None, :] - pal) ** 2).sum(-1)  # [N, H, W, K]
    return d.argmin(-1)


def components(indices: torch.Tensor) -> torch.Tensor:
    """Connected components of equal non-zero colour (4-neighbours): long ``[N, H, W]``, 0 on
    the background, else the smallest flat pixel index + 1 of the component."""
    n, h, w = indices.shape
    fg = indices > 0
    big = h * w + 1
    init = torch.arange(1, h * w + 1).view(1, h, w).expand(n, h, w)
    labels = torch.where(fg, init, torch.full_like(init, big))
    while True:
        new = labels.clone()
        for dim, step in ((1, 1), (1, -1), (2, 1), (2, -1)):
            shifted_lab = torch.roll(labels, step, dims=dim)
            shifted_idx = torch.roll(indices, step, dims=dim)
            edge = torch.zeros_like(fg)  # the wrapped row or column is no neighbour
            if dim == 1:
                edge[:, 0 if step == 1 else h - 1, :] = True
            else:
                edge[:, :, 0 if step == 1 else w - 1] = True
            same = fg & (shifted_idx == indices) & ~edge
            new = torch.where(same, torch.minimum(new, shifted_lab), new)
        if torch.equal(new, labels):
            return torch.where(fg, labels, torch.zeros_like(labels))
        labels = new


def object_sides(patch_px: int) -> tuple[int, ...]:
    """The pixel sides a well-formed object's box can have: one pixel inside a box of 2-4
    tokens."""
    return tuple(s * patch_px - 2 for s in SIZES)


def classify(mask: np.ndarray, sides: tuple[int, ...]) -> tuple[str, float]:
    """The class of one component's cropped mask (bool ``[h, w]``) and its IoU with that class's
    mask; ``"malformed"`` unless the box is a square of one of ``sides`` and the closest class's
    mask differs in at most :data:`MAX_WRONG_PX` pixels."""
    h, w = mask.shape
    if h != w or h not in sides:
        return MALFORMED, 0.0
    best, best_iou, best_wrong = MALFORMED, 0.0, mask.size
    for cls in CLASSES:
        t = shape_mask(cls, h)
        wrong = int((t != mask).sum())
        if wrong < best_wrong:
            best, best_iou, best_wrong = cls, float((t & mask).sum() / (t | mask).sum()), wrong
    return (best if best_wrong <= MAX_WRONG_PX else MALFORMED), best_iou


def detect(images: torch.Tensor, patch_px: int) -> list[list[Detection]]:
    """The objects of each image uint8 ``[N, H, W, 3]``, sorted by position."""
    idx = palette_indices(images.cpu())
    labels = components(idx).numpy()
    idx_np = idx.numpy()
    sides = object_sides(patch_px)
    out: list[list[Detection]] = []
    for lab, colours in zip(labels, idx_np, strict=True):
        found = []
        for comp in np.unique(lab):
            if comp == 0:
                continue
            rows, cols = np.nonzero(lab == comp)
            top, left = int(rows.min()), int(cols.min())
            h, w = int(rows.max()) - top + 1, int(cols.max()) - left + 1
            crop = lab[top : top + h, left : left + w] == comp
            cls, iou = classify(crop, sides)
            colour = COLOUR_NAMES[int(colours[rows[0], cols[0]]) - 1]
            xy = ((left + w / 2) / patch_px, (top + h / 2) / patch_px)
            found.append(Detection(cls, colour, (top, left, h, w), xy, iou))
        out.append(sorted(found, key=lambda d: (d.box[0], d.box[1])))
    return out


def rule_detections(dets: Sequence[Detection]) -> dict[str, list[tuple[Any, ...]]]:
    """Detections as GenEval's rule reads them: class -> ``(x0, y0, x1, y1, score, colour)``, the
    box in pixels. The score is the match of the object's pixels with its class's mask (the IoU
    :func:`classify` measures: 1.0 for an exact render, about 0.96 with one stray pixel, 0 for a
    malformed object), the detector's own confidence: the evaluator's thresholds keep every
    well-formed object (0.96 > 0.9), and its score order puts damaged objects after exact ones;
    equal scores are ordered as NumPy orders them (the evaluator's ``argsort``) in
    :func:`detect`'s order, deterministic."""
    out: dict[str, list[tuple[Any, ...]]] = {}
    for d in dets:
        top, left, h, w = d.box
        box = (float(left), float(top), float(left + w), float(top + h), d.iou, d.colour)
        out.setdefault(d.cls, []).append(box)
    return out


def clause_credit(boxes: Mapping[str, list[tuple[Any, ...]]], meta: Mapping[str, Any]) -> float:
    """Partial credit in [0, 1]: the share of the metadata's clauses (includes and excludes)
    that hold, each include judged alone on all detections of its class (and colour), a relation
    (GenEval's, :func:`~maskgrpo_ray.prompts.geneval_rule.relative_position`) against every
    object of its target's class and colour. The project's shaping signal, not GenEval's."""
    clauses = list(meta["include"]) + list(meta.get("exclude", []))

    def of(req: Mapping[str, Any]) -> list[tuple[Any, ...]]:
        return [b for b in boxes.get(req["class"], []) if b[5] == req.get("color", b[5])]

    held = 0
    for req in meta["include"]:
        found = of(req)
        ok = len(found) >= req["count"]
        if ok and "position" in req:
            rel, target = req["position"]
            group = of(meta["include"][target])
            ok = bool(group) and all(
                rel in relative_position(o[:5], g[:5]) for o in found for g in group
            )
        held += int(ok)
    held += sum(len(boxes.get(req["class"], [])) < req["count"] for req in meta.get("exclude", []))
    return held / len(clauses)


def judge(
    images: torch.Tensor, metas: Sequence[Mapping[str, Any]], patch_px: int
) -> dict[str, torch.Tensor]:
    """GenEval's rule (the official evaluator's, :func:`decide`) on each image uint8
    ``[N, H, W, 3]`` against its metadata line.

    Returns float ``[N]`` tensors: ``geneval`` (0/1: the image is correct), ``credit`` (the
    share of clauses that hold) and ``malformed`` (the number of malformed objects).
    """
    if images.shape[0] != len(metas):
        raise ValueError(f"{images.shape[0]} images but {len(metas)} metadata lines")
    dets = detect(images, patch_px)
    correct, credit, bad = [], [], []
    for d, meta in zip(dets, metas, strict=True):
        boxes = rule_detections(d)
        correct.append(float(decide(boxes, meta, box_colours)[0]))
        credit.append(clause_credit(boxes, meta))
        bad.append(float(sum(x.cls == MALFORMED for x in d)))
    return {
        "geneval": torch.tensor(correct),
        "credit": torch.tensor(credit),
        "malformed": torch.tensor(bad),
    }


def layout_key(dets: Sequence[Detection]) -> tuple[tuple[Any, ...], ...]:
    """A detected layout as a hashable key (class, colour, box of every object): two images
    with the same key show the same objects at the same places."""
    return tuple((d.cls, d.colour, d.box) for d in dets)


def layout_features(images: torch.Tensor, patch_px: int) -> torch.Tensor:
    """An image embedding that is not the reward model's: the palette colour that covers most of
    each token's patch, one-hot, float ``[N, L * (1 + colours)]`` (``1 - cos`` of two images
    is then the share of tokens whose dominant colour differs)."""
    idx = palette_indices(images.cpu())  # [N, H, W]
    n, h, w = idx.shape
    k = len(PALETTE)
    onehot = torch.nn.functional.one_hot(idx, k).float()  # [N, H, W, K]
    patches = onehot.view(n, h // patch_px, patch_px, w // patch_px, patch_px, k).sum((2, 4))
    return torch.nn.functional.one_hot(patches.argmax(-1), k).flatten(1).float()
