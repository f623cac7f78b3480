"""``report.html``: the evaluation report as one self-contained page.

The same figures as ``report.json`` (it is built from that dict): per metric and model the mean
with its bootstrap interval and n, the paired differences, the per-GenEval-tag tables and the
set metrics; the report's PNG figures; and each model's sample images of the same prompts and
seeds side by side, prompt by prompt. Every image is a base64 ``data:`` URI and the style sheet
is inline, so the file opens anywhere without a network or the files beside it. Every number
cell carries ``data-path`` (its JSON path in ``report.json``, as a JSON list) and
``data-value`` (the number at full precision); every user-provided string is escaped.

Standard library only.
"""

from __future__ import annotations

import base64
import html
import json
import mimetypes
import string
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from maskgrpo_ray.evaluation.types import ModelEval

PAGE = string.Template("""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>Evaluation report</title>
<style>
body { font-family: sans-serif; margin: 1.5em; color: #222; }
table { border-collapse: collapse; margin: 0.6em 0 1.2em; }
th, td { border: 1px solid #bbb; padding: 0.2em 0.5em; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
td.na { color: #999; text-align: center; }
img.plot { max-width: 100%; display: block; margin: 0.5em 0 1.5em; }
.prompt-row { display: flex; gap: 1.2em; align-items: flex-start; margin-bottom: 0.8em; }
.prompt-text { width: 14em; font-size: 0.85em; }
.model-grid { border: 1px solid #ccc; padding: 0.3em; }
.model-grid h4 { margin: 0 0 0.2em; font-size: 0.8em; }
.model-grid img { width: 96px; height: 96px; image-rendering: pixelated; margin: 1px; }
.missing { display: inline-block; width: 96px; color: #a00; font-size: 0.7em; }
</style>
</head>
<body>
<h1>Evaluation report</h1>
$body
<h2>How to read this</h2>
<p>Means are over images with a finite score; n counts them. Intervals are $confidence
percentile intervals of a bootstrap that resamples prompts with all their samples; with a
single prompt there is none (-). Differences pair each model's image with the first model's
image of the same prompt and seed. GenEval's overall is the unweighted mean of its tag
scores. The same figures are in report.json and report.md.</p>
</body>
</html>
""")

PLOTS = (("grid", "Images"), ("reward_curve", "Reward curve"), ("eval_curves", "Evaluation curves"))


def _e(x: Any) -> str:
    return html.escape(str(x), quote=True)


def _num(path: list[Any], value: Any, digits: int = 4) -> str:
    """A table cell for the number at ``path`` of report.json: the formatted number, with the
    path and the full-precision value as data attributes ("-" without a value)."""
    key = f'data-path="{_e(json.dumps(path))}"'
    if isinstance(value, bool) or not isinstance(value, int | float):
        return f'<td class="na" {key}>{"-" if value is None else _e(value)}</td>'
    text = str(value) if isinstance(value, int) else f"{value:.{digits}f}"
    return f'<td class="num" {key} data-value="{value!r}">{text}</td>'


def _stat_cells(path: list[Any], stat: dict[str, Any] | None) -> str:
    """mean, CI low, CI high, n of a summary (``summarize_metric`` / ``paired_difference``)."""
    stat = stat or {}
    ci = stat.get("ci") or [None, None]
    return (
        _num([*path, "mean"], stat.get("mean"))
        + _num([*path, "ci", 0], ci[0])
        + _num([*path, "ci", 1], ci[1])
        + _num([*path, "n"], stat.get("n"))
    )


def _stat_table(
    table_id: str, first: str, rows: dict[str, dict[str, Any]], cols: list[str], path: list[str]
) -> str:
    """Rows ``rows[row][col]`` (summaries), four cells per column."""
    head = "".join(f'<th colspan="4">{_e(c)}</th>' for c in cols)
    sub = "<th>mean</th><th>CI low</th><th>CI high</th><th>n</th>" * len(cols)
    body = []
    for row, per_col in rows.items():
        cells = "".join(_stat_cells([*path, row, c], (per_col or {}).get(c)) for c in cols)
        body.append(f"<tr><th>{_e(row)}</th>{cells}</tr>")
    return (
        f'<table id="{_e(table_id)}"><tr><th rowspan="2">{_e(first)}</th>{head}</tr>'
        f"<tr>{sub}</tr>{''.join(body)}</table>"
    )


def _tables(report: dict[str, Any], labels: list[str]) -> list[str]:
    conf = f"{report.get('confidence', 0.95):.0%}"
    out = ['<h2>Models</h2><table id="models"><tr><th>model</th><th>weights</th>']
    out[0] += "<th>images</th></tr>"
    for i, m in enumerate(report["models"]):
        out.append(f"<tr><th>{_e(m['label'])}</th><td>{_e(m['source'])}</td>")
        out.append(_num(["models", i, "images"], m.get("images")) + "</tr>")
    out.append("</table>")
    out.append(f"<h2>Metrics (mean, {conf} CI, n images)</h2>")
    out.append(_stat_table("metrics", "metric", report["metrics"], labels, ["metrics"]))
    diffs = {k: v for k, v in report["differences"].items() if v}
    if diffs and len(labels) > 1:
        pairs = list(next(iter(diffs.values())))
        out.append("<h2>Paired differences (same prompts and seeds)</h2>")
        out.append(_stat_table("differences", "metric", diffs, pairs, ["differences"]))
    for name, per_tag in report["per_tag"].items():
        out.append(f"<h2>{_e(name)} per GenEval tag</h2>")
        out.append(_stat_table(f"per-tag-{name}", "tag", per_tag, labels, ["per_tag", name]))
    sets = {lab: m for lab, m in report["set_metrics"].items() if m}
    if sets:
        keys = sorted({k for m in sets.values() for k in m})
        out.append('<h2>Set metrics (over all images; no CI)</h2><table id="set-metrics">')
        out.append("<tr><th>metric</th>" + "".join(f"<th>{_e(x)}</th>" for x in labels) + "</tr>")
        for k in keys:
            cells = "".join(
                _num(["set_metrics", lab, k], sets.get(lab, {}).get(k)) for lab in labels
            )
            out.append(f"<tr><th>{_e(k)}</th>{cells}</tr>")
        out.append("</table>")
    return out


def data_uri(path: Path) -> str:
    """``data:<mime>;base64,...`` of a file (PNG unless its suffix says otherwise)."""
    mime = mimetypes.guess_type(path.name)[0] or "image/png"
    return f"data:{mime};base64,{base64.b64encode(path.read_bytes()).decode('ascii')}"


def _plots(out_dir: Path, files: dict[str, str]) -> list[str]:
    out = []
    for key, title in PLOTS:
        path = out_dir / files[key] if key in files else None
        if path is not None and path.is_file():
            out.append(f"<h2>{_e(title)}</h2>")
            out.append(
                f'<img class="plot" data-plot="{_e(key)}" alt="{_e(title)}" src="{data_uri(path)}">'
            )
    return out


def _samples(out_dir: Path, evals: Sequence[ModelEval], prompts: int, samples: int) -> list[str]:
    """Per prompt (the grid's first ``prompts``), each model's first ``samples`` images."""
    if not evals or not evals[0].samples or samples < 1:
        return []
    first = sorted({s.prompt_index for s in evals[0].samples})[:prompts]
    text = {s.prompt_index: (s.prompt, s.tag) for s in evals[0].samples}
    by_key = [{(s.prompt_index, s.sample_index): s for s in me.samples} for me in evals]
    out = ["<h2>Samples: the same prompts and seeds, model by model</h2>"]
    for p in first:
        prompt, tag = text[p]
        tag_line = f"<br><small>{_e(tag)}</small>" if tag else ""
        out.append(f'<div class="prompt-row" data-prompt-index="{p}">')
        out.append(f'<div class="prompt-text">#{p}: {_e(prompt)}{tag_line}</div>')
        for m, me in enumerate(evals):
            out.append(f'<div class="model-grid" data-model="{_e(me.label)}">')
            out.append(f"<h4>{_e(me.label)}</h4>")
            for j in range(samples):
                s = by_key[m].get((p, j))
                path = out_dir / s.image_path if s is not None and s.image_path else None
                if path is not None and path.is_file():
                    alt = _e(f"{me.label} prompt {p} sample {j}")
                    out.append(f'<img alt="{alt}" data-sample="{j}" src="{data_uri(path)}">')
                else:
                    out.append(f'<span class="missing">#{j} missing</span>')
            out.append("</div>")
        out.append("</div>")
    return out


def render_html(
    out_dir: Path, report: dict[str, Any], evals: Sequence[ModelEval], prompts: int, samples: int
) -> str:
    """The page for ``report`` (the dict ``report.json`` holds); images are read from
    ``out_dir``."""
    labels = [m["label"] for m in report["models"]]
    parts = _tables(report, labels)
    parts += _plots(out_dir, report.get("files", {}))
    parts += _samples(out_dir, evals, prompts, samples)
    conf = f"{report.get('confidence', 0.95):.0%}"
    return PAGE.substitute(body="\n".join(parts), confidence=_e(conf))


def write_html_report(
    out_dir: Path, report: dict[str, Any], evals: Sequence[ModelEval], prompts: int, samples: int
) -> Path:
    """Write ``out_dir/report.html`` (see the module docstring); returns its path."""
    path = out_dir / "report.html"
    path.write_text(render_html(out_dir, report, evals, prompts, samples), encoding="utf-8")
    return path
