"""Atomic, retained checkpoints of a run: ``RUN_DIR/checkpoints/step_000010/``.

A checkpoint is written into a temporary folder that is renamed into place only when complete,
and ``checkpoints/latest`` (a one-line file) is replaced atomically after that; a crash at any
moment leaves the previous ``latest`` intact. The newest ``keep`` checkpoints are retained.
What goes in is the caller's: the driver writes ``driver.pt`` (step, prompt-stream position,
base evaluation) and the executor writes its own files (weights, optimizer, RNG, filter).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

LATEST = "latest"


def checkpoint_root(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def save_checkpoint(run_dir: Path, step: int, write: Callable[[Path], None], keep: int) -> Path:
    """Call ``write(folder)`` into a temporary folder, then publish it as ``step_<step>``."""
    root = checkpoint_root(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:06d}"
    tmp = root / f".tmp-step_{step:06d}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    write(tmp)
    _fsync_tree(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    pointer = root / f".{LATEST}.tmp"
    pointer.write_text(final.name + "\n")
    os.replace(pointer, root / LATEST)
    for old in sorted(p for p in root.glob("step_*") if p.is_dir())[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The folder ``latest`` names, or None when the run has no complete checkpoint."""
    pointer = checkpoint_root(run_dir) / LATEST
    if not pointer.exists():
        return None
    folder = checkpoint_root(run_dir) / pointer.read_text().strip()
    return folder if folder.is_dir() else None


def _fsync_tree(folder: Path) -> None:
    for f in folder.rglob("*"):
        if f.is_file():
            with f.open("rb") as fh:
                os.fsync(fh.fileno())
