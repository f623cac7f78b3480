"""The evaluation report: cluster-bootstrap intervals, paired differences, per-tag tables and
GenEval's overall, NaN handling, the JSON, the grid and the curves."""

import json
import math

import numpy as np
import pytest
from PIL import Image

from maskgrpo_ray.evaluation.report import (
    build_report,
    cluster_bootstrap,
    eval_curves_figure,
    paired_difference,
    summarize_metric,
)
from maskgrpo_ray.evaluation.types import EvalSample, ModelEval


def model(label, values, tags=None, out=None, nan_at=()):
    """``values[p][j]``: the score of sample j of prompt p (one image file each under out)."""
    samples = []
    for p, row in enumerate(values):
        for j, v in enumerate(row):
            path = None
            if out is not None:
                path = f"{label}/{p:03d}_{j}.png"
                (out / label).mkdir(parents=True, exist_ok=True)
                Image.fromarray(np.full((16, 16, 3), 40 * p, np.uint8)).save(out / path)
            score = math.nan if (p, j) in nan_at else float(v)
            tag = tags[p] if tags else None
            samples.append(EvalSample(p, j, f"prompt {p}", tag, {"acc": score}, path))
    return ModelEval(label, f"{label}.safetensors", samples, {}, {"images": len(samples)})


def test_bootstrap_interval_contains_the_mean_and_is_deterministic():
    rng = np.random.default_rng(0)
    clusters = [list(rng.normal(0.5, 0.2, 4)) for _ in range(30)]
    mean = float(np.mean([v for c in clusters for v in c]))
    lo, hi = cluster_bootstrap(clusters, 2000, 0.95, seed=0)
    assert lo < mean < hi and hi - lo < 0.2
    assert cluster_bootstrap(clusters, 2000, 0.95, seed=0) == (lo, hi)
    # no spread, no width; one prompt: no interval at all
    assert cluster_bootstrap([[1.0, 1.0]] * 5, 500, 0.95, 0) == (1.0, 1.0)
    assert cluster_bootstrap([[1.0, 0.0]], 500, 0.95, 0) is None


def test_cluster_bootstrap_is_wider_than_iid_when_prompts_differ():
    # each prompt's samples agree, prompts disagree: 8 prompts, not 64 independent images
    clusters = [[float(p % 2)] * 8 for p in range(8)]
    lo, hi = cluster_bootstrap(clusters, 4000, 0.95, 0)
    assert hi - lo > 0.5  # an iid bootstrap over 64 images would give about 0.25


def test_means_nan_and_paired_difference_by_hand():
    base = model("base", [[0, 1], [1, 1], [0, 0]], nan_at={(2, 1)})
    tuned = model("tuned", [[1, 1], [1, 1], [1, 0]])
    s = summarize_metric(base.samples, "acc", 500, 0.95, 0)
    assert s["mean"] == pytest.approx(3 / 5) and s["n"] == 5 and s["nonfinite"] == 1
    d = paired_difference(base.samples, tuned.samples, "acc", 500, 0.95, 0)
    # pairs with both finite: (0,0) +1, (0,1) 0, (1,0) 0, (1,1) 0, (2,0) +1 -> 2/5
    assert d["mean"] == pytest.approx(2 / 5) and d["n"] == 5


def test_report_files_tables_and_geneval_overall(tmp_path):
    tags = ["counting", "counting", "single_object"]
    base = model("base", [[0, 0], [1, 0], [1, 1]], tags, tmp_path)
    tuned = model("tuned", [[1, 1], [1, 0], [1, 1]], tags, tmp_path)
    tuned.set_metrics["fid"] = 12.5
    rows = [
        {"step": 0, "reward_mean": 0.1, "eval_accuracy": 0.3},
        {"step": 1, "reward_mean": 0.2},
        {"step": 2, "reward_mean": 0.3, "eval_accuracy": 0.6},
    ]
    report = build_report(tmp_path, [base, tuned], run_rows=rows, grid_prompts=3, grid_samples=2)
    assert json.loads((tmp_path / "report.json").read_text()) == report
    per_tag = report["per_tag"]["acc"]
    assert per_tag["counting"]["base"]["mean"] == pytest.approx(1 / 4)
    assert per_tag["single_object"]["tuned"]["mean"] == pytest.approx(1.0)
    # GenEval's overall: the mean of the tag means, not of the images
    assert per_tag["overall (mean of tags)"]["base"]["mean"] == pytest.approx((1 / 4 + 1) / 2)
    diff = report["differences"]["acc"]["tuned - base"]
    assert diff["mean"] == pytest.approx(2 / 6)
    assert report["set_metrics"]["tuned"]["fid"] == 12.5
    md = (tmp_path / "report.md").read_text()
    assert "| acc |" in md and "counting" in md and "overall (mean of tags)" in md and "fid" in md
    grid = Image.open(tmp_path / report["files"]["grid"])
    assert grid.size[0] > grid.size[1]  # 3 prompt rows, 2 models x 2 samples columns
    assert (tmp_path / "reward_curve.png").is_file() and (tmp_path / "eval_curves.png").is_file()
    assert report["grid_missing_images"] == []


def test_eval_curves_have_labelled_axes_and_gaps():
    rows = [{"step": 0, "eval_reward": 1.0}, {"step": 5}, {"step": 10, "eval_reward": 2.0}]
    fig = eval_curves_figure(rows)
    ax = fig.axes[0]
    assert ax.get_xlabel() == "training step" and ax.get_ylabel() == "evaluation metric"
    (line,) = ax.get_lines()
    assert list(line.get_xdata()) == [0, 10]
    assert eval_curves_figure([{"step": 0, "reward_mean": 1.0}]) is None
