"""GenEval (Ghosh et al., 2023): the folder layout its official evaluator reads, its rule, and a
GenEval-style rule scorer for the toy world.

The official evaluator (``evaluation/evaluate_images.py`` of djghosh13/geneval) walks
``IMAGEDIR/<digits>/``: it ``json.load``s ``metadata.jsonl`` (one object: the prompt's metadata
line) and scores every ``samples/<digits>.png``. Its generation script names the folders
``f"{index:05}"`` (the line number of the metadata file) and the samples ``f"{j:05}.png"``;
:func:`write_geneval_prompt` writes exactly that, so the official evaluator scores our images
unchanged. Its summary reports per-tag accuracy and, as overall, the mean of the tag scores.

The metadata schema (tags, relations, the check of a line) is
:mod:`maskgrpo_ray.geneval_schema`. The rule (:func:`evaluate_objects`, after the official
``evaluate``): every include clause holds (at least ``count`` objects; ``color`` on ``count``
of them; every one of them in ``relation`` to every object of the target include) and no
exclude clause is met.

The toy scorer (:func:`score_toy`) applies that rule to the toy world's decoded pixels, where
detection is exact: each non-black cell is one ``"dot"`` with its palette colour and position.
The toy's own ``region`` key (all of the include's dots in a canvas half) adds its captions'
"on the left"; with the exclude that ``Caption.geneval_metadata`` writes, the rule equals the
toy reward's correctness (a test checks it).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from maskgrpo_ray import toyworld
from maskgrpo_ray.geneval_schema import check_metadata

# ----------------------------------------------------------------------------- folder layout


def sample_folder(root: Path, prompt_index: int) -> Path:
    """``root/<prompt_index:05d>``: one prompt's folder in the evaluator's layout."""
    return root / f"{prompt_index:05d}"


def write_geneval_prompt(
    root: Path, prompt_index: int, meta: Mapping[str, Any], images: torch.Tensor
) -> list[Path]:
    """Write one prompt's ``metadata.jsonl`` and its ``samples/<j:05d>.png`` from ``images``
    ``uint8 [S, H, W, 3]``; returns the sample paths."""
    from PIL import Image

    folder = sample_folder(root, prompt_index)
    (folder / "samples").mkdir(parents=True, exist_ok=True)
    (folder / "metadata.jsonl").write_text(json.dumps(dict(meta)) + "\n")
    paths = []
    for j, img in enumerate(images):
        path = folder / "samples" / f"{j:05d}.png"
        Image.fromarray(img.cpu().numpy()).save(path)
        paths.append(path)
    return paths


def check_geneval_folder(root: Path, prompts: int, samples_per_prompt: int) -> list[str]:
    """What the official evaluator would find wrong, as messages (empty: it reads the folder
    as ``prompts`` prompts of ``samples_per_prompt`` images, each with valid metadata)."""
    problems = []
    folders = sorted(p for p in root.iterdir() if p.is_dir() and p.name.isdigit())
    if len(folders) != prompts:
        problems.append(f"{root}: {len(folders)} prompt folders, expected {prompts}")
    for folder in folders:
        try:
            meta = json.loads((folder / "metadata.jsonl").read_text())
            check_metadata(meta, str(folder / "metadata.jsonl"))
        except (OSError, ValueError) as err:
            problems.append(f"{folder}: {err}")
        samples = [
            p
            for p in (folder / "samples").glob("*")
            if p.is_file() and re.match(r"\d+\.png", p.name)
        ]
        if len(samples) != samples_per_prompt:
            problems.append(
                f"{folder}/samples: {len(samples)} images, expected {samples_per_prompt}"
            )
    return problems


# ----------------------------------------------------------------------------- the rule


def relations(a: tuple[float, float], b: tuple[float, float]) -> set[str]:
    """Where ``a`` is relative to ``b`` (centres ``(x, y)``, y down), as the official
    ``relative_position`` with exact boxes: a direction counts when the unit offset's component
    passes 0.5."""
    dx, dy = a[0] - b[0], a[1] - b[1]
    norm = (dx * dx + dy * dy) ** 0.5
    if norm == 0:
        return set()
    dx, dy = dx / norm, dy / norm
    out = set()
    if dx < -0.5:
        out.add("left of")
    if dx > 0.5:
        out.add("right of")
    if dy < -0.5:
        out.add("above")
    if dy > 0.5:
        out.add("below")
    return out


Obj = dict[str, Any]  # {"color": str, "xy": (x, y), "region": set of halves it lies in}


def evaluate_objects(objects: Mapping[str, list[Obj]], meta: Mapping[str, Any]) -> bool:
    """GenEval's rule on detected ``objects`` (class -> objects): includes with AND, excludes
    with OR. With exact detection, a colour clause counts the objects of that colour."""
    matched: list[list[Obj] | None] = []
    correct = True
    for req in meta["include"]:
        found = objects.get(req["class"], [])
        if "color" in req:
            found = [o for o in found if o["color"] == req["color"]]
        ok = len(found) >= req["count"]
        if ok and "region" in req:
            ok = all(req["region"] in o["region"] for o in found)
        if ok and "position" in req:
            relation, target = req["position"]
            group = matched[target]
            ok = group is not None and all(
                relation in relations(o["xy"], t["xy"]) for o in found for t in group
            )
        matched.append(found if ok else None)
        correct = correct and ok
    for req in meta.get("exclude", []):
        if len(objects.get(req["class"], [])) >= req["count"]:
            correct = False
    return correct


def toy_objects(cells: torch.Tensor) -> dict[str, list[Obj]]:
    """The dots of one toy image ``long [g, g]`` (palette cells) as detected objects."""
    g = cells.shape[0]
    regions = {p: toyworld.region_mask(p, g) for p in toyworld.POSITIONS}
    dots = []
    for r, c in (cells != 0).nonzero().tolist():
        dots.append(
            {
                "color": toyworld.COLOUR_NAMES[int(cells[r, c]) - 1],
                "xy": (c + 0.5, r + 0.5),
                "region": {p for p, m in regions.items() if m[r, c]},
            }
        )
    return {"dot": dots}


def score_toy(
    images: torch.Tensor, metas: Sequence[Mapping[str, Any]], grid: int
) -> dict[str, torch.Tensor]:
    """``geneval`` ``[N]`` (0/1): GenEval's rule on toy images ``uint8 [N, H, W, 3]``, one
    metadata object per image."""
    if images.shape[0] != len(metas):
        raise ValueError(f"{images.shape[0]} images but {len(metas)} metadata lines")
    cells = toyworld.pixels_to_cells(images.cpu(), grid)
    correct = [float(evaluate_objects(toy_objects(c), m)) for c, m in zip(cells, metas)]
    return {"geneval": torch.tensor(correct, dtype=torch.float32)}
