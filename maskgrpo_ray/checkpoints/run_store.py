"""A run's checkpoints: where they live (``run.storage``) and the run-level calls on them.

The storage itself (local/NFS folder or object store, manifests, the ``latest`` pointer,
retention) is :mod:`maskgrpo_ray.checkpoints.storage`. Without ``run.storage`` a run's checkpoints live in
``RUN_DIR/checkpoints/step_000010/`` with ``RUN_DIR/checkpoints/latest``, as before. What goes
in is the caller's: the driver writes ``driver.pt`` (step, prompt-stream position, base
evaluation) and the executor writes its own files (weights, optimizer, RNG, filter).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from maskgrpo_ray.checkpoints.storage import LATEST, CheckpointStore
from maskgrpo_ray.config import RunConfig

__all__ = ["LATEST", "checkpoint_root", "latest_checkpoint", "run_store", "save_checkpoint"]


def checkpoint_root(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def run_store(run: RunConfig, run_dir: Path) -> CheckpointStore:
    """The run's checkpoint location: ``run.storage``, else ``RUN_DIR/checkpoints``."""
    return CheckpointStore(run.storage or str(checkpoint_root(run_dir)), run.storage_options)


def save_checkpoint(run_dir: Path, step: int, write: Callable[[Path], None], keep: int) -> Path:
    """``RUN_DIR/checkpoints/step_<step>`` from ``write(folder)`` (local storage)."""
    CheckpointStore(str(checkpoint_root(run_dir))).save(step, write, keep)
    return checkpoint_root(run_dir) / f"step_{step:06d}"


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The local folder ``RUN_DIR/checkpoints/latest`` names, or None (not verified)."""
    name = CheckpointStore(str(checkpoint_root(run_dir))).latest()
    folder = checkpoint_root(run_dir) / name if name else None
    return folder if folder is not None and folder.is_dir() else None
