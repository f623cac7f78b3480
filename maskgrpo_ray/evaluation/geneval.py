"""GenEval (Ghosh et al., 2023): the folder layout its official evaluator reads, its rule, and a
GenEval-style rule scorer for the toy world.

The official evaluator (``evaluation/evaluate_images.py`` of djghosh13/geneval) walks
``IMAGEDIR/<digits>/``: it ``json.load``s ``metadata.jsonl`` (one object: the prompt's metadata
line) and scores every ``samples/<digits>.png``. Its generation script names the folders
``f"{index:05}"`` (the line number of the metadata file) and the samples ``f"{j:05}.png"``;
:func:`write_geneval_prompt` writes exactly that, so the official evaluator scores our images
unchanged. Its summary reports per-tag accuracy and, as overall, the mean of the tag scores.

The metadata schema is :mod:`maskgrpo_ray.prompts.geneval_schema`; the rule, exact (the evaluator's box
selection and ``evaluate``: :func:`decide`), is :mod:`maskgrpo_ray.prompts.geneval_rule`
(NumPy only, so the worlds import it without this module's torch); the toy world's scorer
(:func:`score_toy`, the rule on its decoded pixels) is :mod:`maskgrpo_ray.worlds.toy.world`.
All stay importable from here. The official evaluator stays the number to publish.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from maskgrpo_ray.prompts.geneval_rule import (
    COLORS,
    GenEvalRuleError,
    compute_iou,
    decide,
    relative_position,
    rule_options,
    select_boxes,
)
from maskgrpo_ray.prompts.geneval_schema import GENEVAL_CLASSES, check_metadata
from maskgrpo_ray.worlds.toy.world import score_toy, toy_decide, toy_detections

__all__ = [
    "COLORS",
    "GENEVAL_CLASSES",
    "GenEvalRuleError",
    "check_geneval_folder",
    "compute_iou",
    "decide",
    "relative_position",
    "rule_options",
    "sample_folder",
    "score_toy",
    "select_boxes",
    "toy_decide",
    "toy_detections",
    "write_geneval_prompt",
]

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
