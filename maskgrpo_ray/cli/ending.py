"""The few lines ``maskgrpo train`` ends with: what a person reads after a run.

Every figure of the run stays in ``RUN_DIR/summary.json`` (``maskgrpo train --json`` prints it
too); the ending names the base and tuned model's held-out accuracy, reward and diversity, where
the run folder and its pictures are, and what to try next. Its last line stays ``run directory:
RUN_DIR`` (scripts and the Ray job logs read it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# the run folder's pictures, in the order a person wants them (those the run wrote are named)
PICTURES = ("reward_curve.png", "samples/eval_tags_final.png", "monitors.png", "step_signal.png")


def _fig(value: Any) -> str:
    return "n/a" if not isinstance(value, (int, float)) else f"{value:.2f}"


def _model_line(label: str, figures: dict[str, Any]) -> str:
    """``base model:  accuracy 0.33  reward 1.15  distinct images 0.59`` (n/a: not measured)."""
    parts = [f"accuracy {_fig(figures.get('eval_accuracy'))}"]
    parts.append(f"reward {_fig(figures.get('eval_reward'))}")
    if "eval_diversity/distinct" in figures:
        parts.append(f"distinct images {_fig(figures['eval_diversity/distinct'])}")
    return f"{label:<13} " + "  ".join(parts)


def ending_lines(summary: dict[str, Any], run_dir: Path) -> list[str]:
    """The run's ending (see the module docstring); ``summary``: the run's ``summary.json``."""
    n = summary.get("eval_samples_per_prompt")
    prompts = summary.get("eval_prompts")
    held_out = "held-out prompts" if prompts is None else f"{prompts} held-out prompts"
    lines = [f"evaluated on {held_out}" + ("" if n is None else f", {n} samples each") + ":"]
    lines.append(_model_line("  base model", summary.get("base_eval") or {}))
    lines.append(_model_line("  tuned model", summary.get("final_eval") or {}))
    lines.append(f"every figure: {run_dir / 'summary.json'}")
    pictures = [p for p in PICTURES if (run_dir / p).exists()]
    if pictures:
        lines.append("pictures: " + ", ".join(str(run_dir / p) for p in pictures))
    if not summary.get("completed", True):
        lines.append(
            f"stopped early by {summary.get('stopped_by')}; run the same command to resume"
        )
    else:
        lines.append(f"next: maskgrpo eval --weights base --weights {run_dir}  (samples, report)")
        lines.append(
            "      maskgrpo configs list  (the other built-in worlds, e.g. --config shapes)"
        )
    lines.append(f"run directory: {run_dir}")
    return lines
