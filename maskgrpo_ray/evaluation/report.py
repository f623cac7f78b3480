"""The evaluation report: ``report.md`` and ``report.json`` (the same figures), image grids of
the same prompts and seeds side by side, and curves with labelled axes.

Confidence intervals come from a cluster bootstrap over prompts: prompts are resampled with
replacement and all samples of a drawn prompt come along, since the samples of one prompt are
correlated. Models evaluated on the same (prompt, seed) keys also get the paired difference
(each model minus the first) with its interval. GenEval's overall score is the unweighted
mean of its per-tag scores.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from maskgrpo_ray.evaluation.html_report import write_html_report
from maskgrpo_ray.evaluation.types import EvalSample, ModelEval


def _finite(values: list[float]) -> list[float]:
    return [v for v in values if math.isfinite(v)]


def cluster_bootstrap(
    per_prompt: list[list[float]], resamples: int, confidence: float, seed: int
) -> tuple[float, float] | None:
    """``(low, high)`` of the mean over samples, resampling prompts (clusters) with replacement;
    None with fewer than two prompts."""
    if len(per_prompt) < 2:
        return None
    sums = torch.tensor([sum(c) for c in per_prompt], dtype=torch.float64)
    counts = torch.tensor([len(c) for c in per_prompt], dtype=torch.float64)
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(len(per_prompt), (resamples, len(per_prompt)), generator=g)
    means = sums[idx].sum(1) / counts[idx].sum(1).clamp_min(1)
    alpha = (1 - confidence) / 2
    q = torch.quantile(means, torch.tensor([alpha, 1 - alpha], dtype=torch.float64))
    return float(q[0]), float(q[1])


def _clusters(samples: Sequence[EvalSample], metric: str) -> dict[int, list[float]]:
    out: dict[int, list[float]] = {}
    for s in samples:
        v = s.scores.get(metric, math.nan)
        if math.isfinite(v):
            out.setdefault(s.prompt_index, []).append(v)
    return out


def summarize_metric(
    samples: Sequence[EvalSample], metric: str, resamples: int, confidence: float, seed: int
) -> dict[str, Any]:
    """Mean over finite values, n, non-finite count and the bootstrap interval."""
    values = [s.scores.get(metric, math.nan) for s in samples]
    finite = _finite(values)
    ci = cluster_bootstrap(list(_clusters(samples, metric).values()), resamples, confidence, seed)
    return {
        "mean": sum(finite) / len(finite) if finite else None,
        "n": len(finite),
        "nonfinite": len(values) - len(finite),
        "ci": list(ci) if ci else None,
    }


def paired_difference(
    first: Sequence[EvalSample],
    second: Sequence[EvalSample],
    metric: str,
    resamples: int,
    confidence: float,
    seed: int,
) -> dict[str, Any] | None:
    """``second - first`` on the (prompt, sample) keys both have finite values for; None when
    they share none."""
    a = {(s.prompt_index, s.sample_index): s.scores.get(metric, math.nan) for s in first}
    per_prompt: dict[int, list[float]] = {}
    for s in second:
        key = (s.prompt_index, s.sample_index)
        v = s.scores.get(metric, math.nan)
        if key in a and math.isfinite(a[key]) and math.isfinite(v):
            per_prompt.setdefault(s.prompt_index, []).append(v - a[key])
    diffs = [d for c in per_prompt.values() for d in c]
    if not diffs:
        return None
    ci = cluster_bootstrap(list(per_prompt.values()), resamples, confidence, seed)
    return {"mean": sum(diffs) / len(diffs), "n": len(diffs), "ci": list(ci) if ci else None}


def metric_names(evals: Sequence[ModelEval]) -> list[str]:
    return sorted({k for me in evals for s in me.samples for k in s.scores})


def build_tables(
    evals: Sequence[ModelEval], resamples: int, confidence: float, seed: int
) -> dict[str, Any]:
    """The report's figures: per metric and model, per metric and tag, differences, set
    metrics."""
    names = metric_names(evals)
    tags = sorted({s.tag for me in evals for s in me.samples if s.tag is not None})
    out: dict[str, Any] = {"models": [], "metrics": {}, "differences": {}, "per_tag": {}}
    for me in evals:
        out["models"].append({"label": me.label, "source": me.source, **me.info})
    for name in names:
        out["metrics"][name] = {
            me.label: summarize_metric(me.samples, name, resamples, confidence, seed)
            for me in evals
        }
        out["differences"][name] = {
            f"{me.label} - {evals[0].label}": paired_difference(
                evals[0].samples, me.samples, name, resamples, confidence, seed
            )
            for me in evals[1:]
        }
        if tags:
            per_tag: dict[str, Any] = {}
            for tag in tags:
                per_tag[tag] = {
                    me.label: summarize_metric(
                        [s for s in me.samples if s.tag == tag], name, resamples, confidence, seed
                    )
                    for me in evals
                }
            per_tag["overall (mean of tags)"] = {
                me.label: _mean_of_tags(per_tag, tags, me.label) for me in evals
            }
            out["per_tag"][name] = per_tag
    out["set_metrics"] = {me.label: dict(me.set_metrics) for me in evals}
    return out


def _mean_of_tags(per_tag: dict[str, Any], tags: list[str], label: str) -> dict[str, Any]:
    means = [per_tag[t][label]["mean"] for t in tags if per_tag[t][label]["mean"] is not None]
    return {"mean": sum(means) / len(means) if means else None, "tags": len(means)}


# ----------------------------------------------------------------------------- figures


def grid_figure(
    out_dir: Path, evals: Sequence[ModelEval], prompts: int, samples: int
) -> tuple[Any, list[str]]:
    """Rows: the first ``prompts`` prompts; columns: for each model, its first ``samples``
    images of that prompt (the same seeds). Returns the figure and the missing image paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from PIL import Image

    first = sorted({s.prompt_index for s in evals[0].samples})[:prompts]
    text = {s.prompt_index: s.prompt for s in evals[0].samples}
    by_key = [{(s.prompt_index, s.sample_index): s for s in me.samples} for me in evals]
    cols = samples * len(evals)
    fig, axes = plt.subplots(
        len(first), cols, figsize=(1.6 * cols, 1.8 * len(first)), squeeze=False
    )
    missing = []
    for r, p in enumerate(first):
        for m, me in enumerate(evals):
            for j in range(samples):
                ax = axes[r][m * samples + j]
                ax.set_xticks([])
                ax.set_yticks([])
                s = by_key[m].get((p, j))
                path = out_dir / s.image_path if s is not None and s.image_path else None
                if path is not None and path.is_file():
                    ax.imshow(Image.open(path).convert("RGB"))
                elif path is not None:
                    missing.append(str(path))
                if r == 0:
                    ax.set_title(f"{me.label} #{j}", fontsize=8)
        axes[r][0].set_ylabel(text[p][:40], fontsize=7, rotation=0, ha="right", va="center")
    fig.suptitle("the same prompts and seeds, model by model")
    fig.tight_layout()
    return fig, missing


def eval_curves_figure(rows: Sequence[dict[str, Any]]) -> Any:
    """Every ``eval_*`` key of a run's ``metrics.jsonl`` rows over training steps (rows without
    the key are gaps; standard errors, ``*_se``, left out), or None when the rows have none."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted({k for r in rows for k in r if k.startswith("eval_") and not k.endswith("_se")})
    if not keys:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    for key in keys:
        pts = [(int(r["step"]), r[key]) for r in rows if key in r and r[key] is not None]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=key)
    ax.set_xlabel("training step")
    ax.set_ylabel("evaluation metric")
    ax.set_title("held-out evaluation during training")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------- markdown


def _fmt(x: Any, digits: int = 4) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _cell(stat: dict[str, Any] | None) -> str:
    if stat is None or stat.get("mean") is None:
        return "-"
    ci = stat.get("ci")
    band = f" [{_fmt(ci[0])}, {_fmt(ci[1])}]" if ci else " (CI n/a)"
    return f"{_fmt(stat['mean'])}{band}"


def markdown(tables: dict[str, Any], files: dict[str, str], confidence: float) -> str:
    labels = [m["label"] for m in tables["models"]]
    lines = ["# Evaluation report", "", "| model | weights | images |", "|---|---|---|"]
    lines += [
        f"| {m['label']} | {m['source']} | {m.get('images', '-')} |" for m in tables["models"]
    ]
    lines += ["", f"## Metrics (mean [{confidence:.0%} CI], n images)", ""]
    lines += ["| metric | " + " | ".join(labels) + " |", "|---" * (len(labels) + 1) + "|"]
    for name, per_model in tables["metrics"].items():
        cells = [f"{_cell(per_model[lab])}, n={per_model[lab]['n']}" for lab in labels]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    diffs = {k: v for k, v in tables["differences"].items() if v}
    if diffs and len(labels) > 1:
        pairs = list(next(iter(diffs.values())))
        lines += ["", "## Paired differences (same prompts and seeds)", ""]
        lines += ["| metric | " + " | ".join(pairs) + " |", "|---" * (len(pairs) + 1) + "|"]
        for name, per_pair in diffs.items():
            lines.append(f"| {name} | " + " | ".join(_cell(per_pair[p]) for p in pairs) + " |")
    for name, per_tag in tables["per_tag"].items():
        lines += ["", f"## {name} per GenEval tag", ""]
        lines += ["| tag | " + " | ".join(labels) + " |", "|---" * (len(labels) + 1) + "|"]
        for tag, per_model in per_tag.items():
            lines.append(f"| {tag} | " + " | ".join(_cell(per_model[lab]) for lab in labels) + " |")
    sets = {lab: m for lab, m in tables["set_metrics"].items() if m}
    if sets:
        keys = sorted({k for m in sets.values() for k in m})
        lines += ["", "## Set metrics (over all images; no CI)", ""]
        lines += ["| metric | " + " | ".join(labels) + " |", "|---" * (len(labels) + 1) + "|"]
        for k in keys:
            lines.append(
                f"| {k} | " + " | ".join(_fmt(sets.get(lab, {}).get(k)) for lab in labels) + " |"
            )
    for title, key in (
        ("Images", "grid"),
        ("Reward curve", "reward_curve"),
        ("Evaluation curves", "eval_curves"),
    ):
        if key in files:
            lines += ["", f"## {title}", "", f"![{title}]({files[key]})"]
    lines += [
        "",
        "## How to read this",
        "",
        f"Means are over images with a finite score; n counts them. Intervals are {confidence:.0%} "
        "percentile intervals of a bootstrap that resamples prompts with all their samples "
        "(samples of one prompt are correlated); with a single prompt there is none (n/a). "
        "Differences pair each model's image with the first model's image of the same prompt "
        "and seed. GenEval's overall is the unweighted mean of its tag scores.",
    ]
    return "\n".join(lines) + "\n"


def _json_safe(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {str(k): _json_safe(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_json_safe(v) for v in x]
    return x


def build_report(
    out_dir: Path,
    evals: list[ModelEval],
    *,
    run_rows: list[dict[str, Any]] | None = None,
    grid_prompts: int = 8,
    grid_samples: int = 4,
    confidence: float = 0.95,
    bootstrap_resamples: int = 2000,
    seed: int = 0,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Write ``report.json`` (with ``extra`` merged in), ``report.md`` and the figures under
    ``out_dir``; returns the report's dict (the JSON's content)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from maskgrpo_ray.runlog.run_log import reward_curve_figure

    out_dir.mkdir(parents=True, exist_ok=True)
    tables = build_tables(evals, bootstrap_resamples, confidence, seed)
    files: dict[str, str] = {}
    samples = min(grid_samples, max((s.sample_index + 1 for s in evals[0].samples), default=0))
    if evals and evals[0].samples and samples:
        fig, missing = grid_figure(out_dir, evals, grid_prompts, samples)
        name = "grid_" + "_vs_".join(me.label for me in evals) + ".png"
        fig.savefig(out_dir / name, dpi=80)
        plt.close(fig)
        files["grid"] = name
        tables["grid_missing_images"] = missing
    if run_rows:
        for key, make in (
            ("reward_curve", reward_curve_figure),
            ("eval_curves", eval_curves_figure),
        ):
            fig = make(run_rows)
            if fig is not None:
                fig.savefig(out_dir / f"{key}.png", dpi=100)
                plt.close(fig)
                files[key] = f"{key}.png"
    tables["files"] = files
    tables["confidence"] = confidence
    tables["bootstrap_resamples"] = bootstrap_resamples
    tables.update(extra or {})
    safe = _json_safe(tables)
    (out_dir / "report.json").write_text(json.dumps(safe, indent=2) + "\n")
    (out_dir / "report.md").write_text(markdown(safe, files, confidence))
    write_html_report(out_dir, safe, evals, grid_prompts, samples)
    return safe
