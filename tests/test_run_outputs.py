"""Run outputs: the training-curve figure has labelled axes and draws what was logged."""

from __future__ import annotations

import math

from PIL import Image

from maskgrpo_ray.runlog.run_log import RunLog, reward_curve_figure


def _rows():
    rows = []
    for step in range(6):
        row = {"step": step, "reward_mean": 0.1 * step, "reward_mean_kept": 0.1 * step + 0.05}
        row["accuracy"] = 0.5 + 0.05 * step
        if step in (2, 5):
            row["eval_accuracy"] = 0.6 + 0.05 * step
        rows.append(row)
    rows[3]["reward_mean_kept"] = None  # no group kept that step: a gap, not a zero
    rows[4]["accuracy"] = math.nan
    return rows


def test_curve_figure_is_labelled_and_plots_the_logged_points():
    fig = reward_curve_figure(_rows())
    top, bottom = fig.axes
    assert top.get_ylabel() == "mean reward" and bottom.get_ylabel() == "accuracy (0-1)"
    assert bottom.get_xlabel() == "driver step" and top.get_title()
    lines = {ln.get_label(): ln for ax in fig.axes for ln in ax.get_lines()}
    kept = lines["groups trained on (reward_mean_kept)"]
    assert list(kept.get_xdata()) == [0, 1, 2, 4, 5]  # step 3 had no value
    ev = lines["held-out evaluation (eval_accuracy)"]
    assert list(ev.get_xdata()) == [2, 5] and list(ev.get_ydata()) == [0.7, 0.85]
    acc = lines["every generated group (accuracy)"]
    assert 4 not in list(acc.get_xdata())  # NaN skipped
    fig.canvas.draw()
    assert all(t.get_text() for t in bottom.get_xticklabels() if t.get_visible())


def test_reward_only_run_gets_one_panel_and_a_png(tmp_path):
    log = RunLog(tmp_path)
    for step in range(3):
        log.log_step({"step": step, "reward_mean": float(step)})
    assert len(reward_curve_figure(log.rows).axes) == 1
    png = log.plot_reward_curve()
    with Image.open(png) as img:
        assert img.size[0] >= 600 and img.size[1] >= 250
