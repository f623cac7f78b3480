"""Run outputs: ``metrics.jsonl`` (one line a step), the reward-curve PNG, sample grids, and
``superseded/``, where a resume moves what it replaces (:meth:`RunLog.supersede`)."""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from PIL import Image, ImageDraw

from maskgrpo_ray.runlog.monitors import MonitorRules, monitor_summary, monitors_figure
from maskgrpo_ray.runlog.trackers import TrackerArgs, TrackerName, Trackers, open_trackers

log = logging.getLogger(__name__)
SUPERSEDED = "superseded"  # RUN_DIR/superseded/<time>-from-step_N/: what a later attempt replaced

CURVES = (
    # (panel, metric key, legend label): what the reward-curve figure draws where logged
    ("reward", "reward_mean", "every generated group"),
    ("reward", "reward_mean_kept", "groups trained on"),
    ("reward", "eval_reward", "held-out evaluation"),
    ("accuracy", "accuracy", "every generated group"),
    ("accuracy", "accuracy_kept", "groups trained on"),
    ("accuracy", "eval_accuracy", "held-out evaluation"),
)


def reward_curve_figure(rows: list[dict[str, Any]]) -> Any:
    """A matplotlib figure of a run's rows: mean reward per driver step (top) and, when the
    reward defines one, accuracy (bottom); evaluations as markers. Axes and legends labelled."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def series(key: str) -> tuple[list[int], list[float]]:
        xs: list[int] = []
        ys: list[float] = []
        for r in rows:
            v = r.get(key)
            if "step" in r and isinstance(v, int | float) and math.isfinite(v):
                xs.append(int(r["step"]))
                ys.append(float(v))
        return xs, ys

    panels = ["reward"] + (["accuracy"] if series("accuracy")[0] else [])
    fig, axes = plt.subplots(len(panels), 1, figsize=(7, 2.6 * len(panels) + 0.6), sharex=True)
    axes = [axes] if len(panels) == 1 else list(axes)
    for ax, panel in zip(axes, panels, strict=True):
        for where, key, label in CURVES:
            xs, ys = series(key)
            if where != panel or not xs:
                continue
            style = {"marker": "o", "ls": "--"} if key.startswith("eval_") else {"lw": 1.5}
            ax.plot(xs, ys, label=f"{label} ({key})", **style)
        ax.set_ylabel("mean reward" if panel == "reward" else "accuracy (0-1)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    axes[0].set_title("Training curves per driver step", fontsize=10)
    axes[-1].set_xlabel("driver step")
    fig.tight_layout()
    return fig


SIGNAL_FIGURES = ("cos", "cos_se", "floor", "floor_se", "norm", "norm_floor")


def probe_rows(rows: list[dict[str, Any]]) -> list[tuple[int, dict[str, list[float]]]]:
    """Each step-signal probe in a run's rows (``train.step_signal_every_steps``): its driver
    step and, per figure (``step_signal/<figure>/<t>``), the values over the unmasking steps
    (a non-finite value, logged as null, is NaN here)."""
    out = []
    for r in rows:
        if "step" not in r or not any(k.startswith("step_signal/cos/") for k in r):
            continue
        figs: dict[str, list[float]] = {}
        for name in SIGNAL_FIGURES:
            prefix = f"step_signal/{name}/"
            items = sorted((int(k[len(prefix) :]), v) for k, v in r.items() if k.startswith(prefix))
            figs[name] = [math.nan if v is None else float(v) for _, v in items]
        out.append((int(r["step"]), figs))
    return out


def step_signal_figure(probes: list[tuple[int, dict[str, list[float]]]]) -> Any:
    """One plot of the probes (up to four: the first, the last and two between): each unmasking
    step's cosine between probe batches' gradients (+-2 standard errors), against the last
    probe's shuffled-advantage floor (its band +-2 standard errors)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    picks = sorted({round(i * (len(probes) - 1) / 3) for i in range(4)}) if probes else []
    fig, ax = plt.subplots(figsize=(7, 3.6))
    step, last = probes[-1]
    ts = list(range(len(last["floor"])))
    lo = [f - 2 * e for f, e in zip(last["floor"], last["floor_se"], strict=True)]
    hi = [f + 2 * e for f, e in zip(last["floor"], last["floor_se"], strict=True)]
    ax.fill_between(ts, lo, hi, color="0.85", label=f"shuffled floor +-2 se (step {step})")
    ax.plot(ts, last["floor"], color="0.5", ls="--", lw=1)
    for i in picks:
        at, figs = probes[i]
        err = [2 * e for e in figs["cos_se"]]
        ax.errorbar(ts, figs["cos"], yerr=err, marker="o", ms=3, capsize=2, label=f"step {at}")
    ax.axhline(0.0, color="0.3", lw=0.5)
    ax.set_xlabel("unmasking step t")
    ax.set_ylabel("cos between probe batches' g_t")
    ax.set_title("Each unmasking step's gradient signal on the run's model", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    return fig


def step_signal_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """``summary.json``'s ``step_signal``: the last probe's figures (empty: no probe ran)."""
    probes = probe_rows(rows)
    if not probes:
        return {}
    step, figs = probes[-1]
    last = next(r for r in rows if r.get("step") == step)
    out: dict[str, Any] = {"probes": len(probes), "last_probe_step": step}
    out.update({k: [None if math.isnan(v) else v for v in vs] for k, vs in figs.items()})
    out["steps_above_floor"] = last.get("step_signal/steps_above_floor")
    if "auto_steps" in last:
        out["auto_steps"] = last["auto_steps"]
    out["plot"] = "step_signal.png"
    return out


class RunLog:
    """Writes a run directory's step metrics, pictures and summary, and passes them on to the
    experiment trackers opened by :meth:`tracking` (none by default)."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "samples").mkdir(exist_ok=True)
        self.path = run_dir / "metrics.jsonl"
        self.rows: list[dict[str, Any]] = []
        if self.path.exists():  # resuming: keep what earlier steps wrote
            self.rows = [json.loads(x) for x in self.path.read_text().splitlines() if x.strip()]
        self.trackers = Trackers()
        self.monitor_rules: MonitorRules | None = None  # logging.monitors: draw monitors.png

    @contextmanager
    def tracking(
        self,
        names: Sequence[TrackerName],
        args: TrackerArgs,
        config: Mapping[str, Any],
        start_step: int,
        run_name: str,
    ) -> Iterator[Trackers]:
        """The named trackers (:mod:`maskgrpo_ray.runlog.trackers`) open for the block, closed at its
        end, marked failed when it raises."""
        self.trackers = open_trackers(names, args, self.run_dir, config, start_step, run_name)
        ok = False
        try:
            yield self.trackers
            ok = True
        finally:
            self.trackers.close(ok)

    def log_step(self, row: dict[str, Any]) -> None:
        clean = {
            k: (None if isinstance(v, float) and not math.isfinite(v) else v)
            for k, v in row.items()
        }
        self.rows = [r for r in self.rows if r.get("step") != clean.get("step")] + [clean]
        with self.path.open("a") as f:
            f.write(json.dumps(clean) + "\n")
        step = clean.get("step")
        if isinstance(step, int):
            self.trackers.log_metrics(step, clean)

    def supersede(self, step: int, outputs: Sequence[str], why: str) -> Path | None:
        """Set aside what a run going on from ``step`` replaces, so that the folder's files
        describe one run and no history is lost: the rows of ``step`` and later, the sample
        grids of those steps and the ``outputs`` of a run's end (``summary.json``, the final
        policy, ...) that are there move to ``superseded/<UTC time>-from-step_NNNNNN/``
        (``metrics.jsonl`` then holds the kept rows, written anew and renamed into place).
        One WARNING names the folder, what moved and ``why``. Returns the folder (None:
        nothing to move)."""
        gone = [r for r in self.rows if r.get("step", -1) >= step]
        grids = [g for g in (self.run_dir / "samples").glob("step_*.png") if _step_of(g) >= step]
        ends = [self.run_dir / o for o in outputs if (self.run_dir / o).exists()]
        if not (gone or grids or ends):
            return None
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        aside = self.run_dir / SUPERSEDED / f"{stamp}-from-step_{step:06d}"
        for n in range(1, 100):  # two in one second (a roll-back right after a resume)
            if not aside.exists():
                break
            aside = aside.with_name(f"{stamp}-from-step_{step:06d}-{n}")
        aside.mkdir(parents=True)
        moved = []
        if gone:
            (aside / self.path.name).write_text("".join(json.dumps(r) + "\n" for r in gone))
            self.rows = [r for r in self.rows if r.get("step", -1) < step]
            tmp = self.path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in self.rows))
            tmp.replace(self.path)
            steps = sorted({int(r["step"]) for r in gone})
            moved.append(f"{len(gone)} rows of {self.path.name} (steps {steps[0]}-{steps[-1]})")
        if grids:
            (aside / "samples").mkdir()
            for g in grids:
                g.replace(aside / "samples" / g.name)
            moved.append(f"{len(grids)} sample grids")
        for f in ends:
            f.replace(aside / f.name)
        moved += [f.name for f in ends]
        log.warning("%s: moved %s to %s", why, ", ".join(moved), aside.resolve())
        return aside

    def plot_reward_curve(self, name: str = "reward_curve.png") -> Path:
        """The run's curves with labelled axes (:func:`reward_curve_figure`), as a PNG; with
        step-signal probes in the rows, also ``step_signal.png`` (to the trackers too); with
        ``monitor_rules`` set and monitors in the rows, ``monitors.png`` (:meth:`plot_monitors`)."""
        import matplotlib.pyplot as plt

        fig = reward_curve_figure(self.rows)
        out = self.run_dir / name
        fig.savefig(out, dpi=100)
        plt.close(fig)
        if self.monitor_rules is not None and monitor_summary(self.rows):
            self.plot_monitors(self.monitor_rules)
        probes = probe_rows(self.rows)
        if probes:
            fig = step_signal_figure(probes)
            signal = self.run_dir / "step_signal.png"
            fig.savefig(signal, dpi=100)
            plt.close(fig)
            self.trackers.log_image(probes[-1][0], "step_signal", signal)
        return out

    def plot_monitors(self, rules: MonitorRules, name: str = "monitors.png") -> Path:
        """The run's monitors (:func:`maskgrpo_ray.runlog.monitors.monitors_figure`) as a PNG, to the
        trackers too (docs/monitors.md)."""
        import matplotlib.pyplot as plt

        fig = monitors_figure(self.rows, rules)
        out = self.run_dir / name
        fig.savefig(out, dpi=100)
        plt.close(fig)
        steps = [int(r["step"]) for r in self.rows if isinstance(r.get("step"), int)]
        self.trackers.log_image(max(steps, default=0), "monitors", out)
        return out

    def save_sample_grid(
        self,
        images: torch.Tensor,
        step: int,
        group_size: int,
        prompts: list[str] | None = None,
        name: str | None = None,
        key: str = "samples",
    ) -> Path:
        """``uint8 [N, H, W, 3]`` -> one PNG, a row per prompt group labelled with its prompt:
        ``samples/step_<step>.png``, or ``samples/<name>.png``; to the trackers under ``key``
        at ``step``."""
        n, hh, ww, _ = images.shape
        cols = group_size
        rows = math.ceil(n / cols)
        scale = max(1, 64 // max(hh, 1))
        grid = torch.full((rows * (hh + 2), cols * (ww + 2), 3), 255, dtype=torch.uint8)
        for i in range(n):
            r, c = divmod(i, cols)
            grid[r * (hh + 2) : r * (hh + 2) + hh, c * (ww + 2) : c * (ww + 2) + ww] = images[i]
        tiles = Image.fromarray(grid.numpy())
        tiles = tiles.resize((tiles.width * scale, tiles.height * scale), Image.Resampling.NEAREST)
        label_w = 260 if prompts else 0
        img = Image.new("RGB", (tiles.width + label_w, tiles.height), "white")
        img.paste(tiles, (label_w, 0))
        if prompts:
            d = ImageDraw.Draw(img)
            row_h = (hh + 2) * scale
            for r, text in enumerate(prompts[:rows]):
                d.text((4, r * row_h + row_h // 2 - 6), text[:40], fill="black")
        out = self.run_dir / "samples" / f"{name or f'step_{step:06d}'}.png"
        img.save(out)
        self.trackers.log_image(step, key, out)
        return out

    def write_summary(self, summary: dict[str, Any]) -> None:
        """``summary.json``, its numbers to the trackers; ``tracker_failures`` when any failed;
        the last step-signal probe's figures (``step_signal``) when the run probed; the
        monitors' alarms (``monitors``: each one's first step) when the rows carry monitors."""
        signal = step_signal_summary(self.rows)
        if signal:
            summary["step_signal"] = signal
        monitors = monitor_summary(self.rows)
        if monitors:
            summary["monitors"] = monitors
        self.trackers.log_summary(summary)
        if self.trackers.failures:
            summary["tracker_failures"] = dict(self.trackers.failures)
        write_json_atomic(self.run_dir / "summary.json", summary)


def _step_of(grid: Path) -> int:
    """The step of ``samples/step_000012.png`` (-1 for another name)."""
    tail = grid.stem.removeprefix("step_")
    return int(tail) if tail.isdigit() else -1


def write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2))
    tmp.replace(path)
