"""Run outputs: ``metrics.jsonl`` (one line a step), the reward-curve PNG, sample grids."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from PIL import Image, ImageDraw


class RunLog:
    """Writes a run directory's step metrics and pictures."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "samples").mkdir(exist_ok=True)
        self.path = run_dir / "metrics.jsonl"
        self.rows: list[dict[str, Any]] = []
        if self.path.exists():  # resuming: keep what earlier steps wrote
            self.rows = [json.loads(x) for x in self.path.read_text().splitlines() if x.strip()]

    def log_step(self, row: dict[str, Any]) -> None:
        clean = {
            k: (None if isinstance(v, float) and not math.isfinite(v) else v)
            for k, v in row.items()
        }
        self.rows = [r for r in self.rows if r.get("step") != clean.get("step")] + [clean]
        with self.path.open("a") as f:
            f.write(json.dumps(clean) + "\n")

    def truncate_from(self, step: int) -> None:
        """Drop rows of ``step`` and later (a resumed run re-does them)."""
        self.rows = [r for r in self.rows if r.get("step", -1) < step]
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in self.rows))
        tmp.replace(self.path)

    def plot_reward_curve(self, name: str = "reward_curve.png") -> Path:
        """Mean training reward per step (blue) and eval accuracy where logged (red)."""
        w, h, pad = 640, 360, 40
        img = Image.new("RGB", (w, h), "white")
        d = ImageDraw.Draw(img)
        d.rectangle([pad, pad, w - pad, h - pad], outline="black")
        series = {
            "reward_mean": ("blue", [(r["step"], r.get("reward_mean")) for r in self.rows]),
            "eval_accuracy": ("red", [(r["step"], r.get("eval_accuracy")) for r in self.rows]),
        }
        pts_all = [(s, v) for _, pts in series.values() for s, v in pts if v is not None]
        if pts_all:
            s_max = max(max(s for s, _ in pts_all), 1)
            for key, (colour, raw) in series.items():
                pts = [(s, float(v)) for s, v in raw if v is not None]
                if not pts:
                    continue
                lo, hi = min(v for _, v in pts), max(v for _, v in pts)
                lo, hi = (lo, hi) if hi > lo else (lo - 0.5, hi + 0.5)
                xy = [
                    (
                        pad + (w - 2 * pad) * s / s_max,
                        h - pad - (h - 2 * pad) * (v - lo) / (hi - lo),
                    )
                    for s, v in pts
                ]
                if len(xy) > 1:
                    d.line(xy, fill=colour, width=2)
                for x, y in xy:
                    d.ellipse([x - 2, y - 2, x + 2, y + 2], fill=colour)
                d.text(
                    (pad + 5, 5 + 14 * list(series).index(key)),
                    f"{key}: {lo:.3g} .. {hi:.3g}",
                    fill=colour,
                )
        d.text((w // 2 - 20, h - pad + 10), "step", fill="black")
        out = self.run_dir / name
        img.save(out)
        return out

    def save_sample_grid(
        self, images: torch.Tensor, step: int, group_size: int, prompts: list[str] | None = None
    ) -> Path:
        """``uint8 [N, H, W, 3]`` -> one PNG, a row per prompt group labelled with its prompt."""
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
        out = self.run_dir / "samples" / f"step_{step:06d}.png"
        img.save(out)
        return out


def write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2))
    tmp.replace(path)
