"""What the evaluation modules hand each other: per-sample scores and one model's evaluation.

Images live on disk (``image_path``, relative to the evaluation's output folder), so the report
reads the same files the GenEval layout and FID use.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class EvalSample:
    """One generated image and its scores.

    ``scores`` maps a per-sample metric's name to its value (NaN: the metric failed on this
    image). ``tag`` is the prompt's GenEval tag when its metadata has one.
    """

    prompt_index: int
    sample_index: int
    prompt: str
    tag: str | None
    scores: dict[str, float]
    image_path: str | None = None


@dataclass
class ModelEval:
    """One model's evaluation: ``label`` ("base", "tuned", ...), where its weights came from,
    its samples, and the set metrics computed over all its images (FID, KID: no per-sample
    value)."""

    label: str
    source: str
    samples: list[EvalSample]
    set_metrics: dict[str, float] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)
