"""Reading weight, checkpoint and state files without running code from them.

A pickle runs whatever it names when it is loaded, and people download weights and copy
checkpoints around. So every file the project reads is either safetensors or
``torch.load(weights_only=True)``, which rebuilds tensors, numbers, strings and containers and
refuses anything else. DeepSpeed's own ``load_checkpoint`` unpickles freely, so a checkpoint's
pickles are scanned before anything loads them: ``torch.serialization``'s
``get_unsafe_globals_in_checkpoint`` lists what a pickle would import, without running it, and
anything outside :data:`DEEPSPEED_GLOBALS` (what DeepSpeed itself writes) refuses the
checkpoint. A refusal is one line naming the file, what it would import and the fix.
"""

from __future__ import annotations

import os
import pickle
import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from maskgrpo_ray.errors import UserError

# What a DeepSpeed checkpoint of this project's learner pickles besides tensors, numbers and
# containers, read off the files of ZeRO stages 0, 2 and 3 (DeepSpeed 0.19.8): stage 0 names
# nothing; the optimizer states of stages 1-3 name these three data classes and no function.
DEEPSPEED_GLOBALS: frozenset[str] = frozenset(
    {
        "deepspeed.runtime.fp16.loss_scaler.LossScaler",
        "deepspeed.runtime.zero.config.ZeroStageEnum",
        "deepspeed.utils.tensor_fragment.fragment_address",
    }
)


class UnsafeFileError(UserError, ValueError):
    """A file that would import (and so could run) code when loaded: it is not loaded."""


def _refusal(path: Path, names: Iterable[str], what: str) -> UnsafeFileError:
    shown = ", ".join(sorted(names)) or "objects other than tensors and containers"
    return UnsafeFileError(
        f"{path}: refused to load {what}: its pickle imports {shown}, and loading a pickle can "
        "run code; re-save it as safetensors (or torch.save of a plain dict of tensors) from a "
        "source you trust"
    )


def unsafe_globals(path: str | Path) -> list[str]:
    """What ``path``'s pickle would import beyond torch's weights-only allow-list (not run)."""
    try:
        return list(torch.serialization.get_unsafe_globals_in_checkpoint(str(path)))
    except (RuntimeError, ValueError, pickle.UnpicklingError, EOFError) as err:
        raise UnsafeFileError(
            f"{path}: not a torch.save file that can be inspected ({err}); re-save it as "
            "safetensors or with torch.save"
        ) from None


def load_torch_file(path: str | Path, what: str = "a state file", allow: Iterable[Any] = ()) -> Any:
    """``torch.load(path, weights_only=True)`` on the CPU; ``allow``: extra classes or
    functions the file may name (``torch.serialization.safe_globals``). A pickle that names
    anything else raises :class:`UnsafeFileError` (one line), nothing of it runs."""
    path = Path(path)
    try:
        with torch.serialization.safe_globals(list(allow)):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        names = re.findall(r"GLOBAL ([\w.]+)", str(err))
        raise _refusal(path, names, what) from None


@contextmanager
def deepspeed_accelerator(device_type: str) -> Iterator[None]:
    """DeepSpeed imported inside this block takes ``device_type`` (``cuda`` or ``cpu``, the
    device this process computes on) as its accelerator instead of probing for one.

    Its probe, on a machine without CUDA, warns "Setting accelerator to CPU. If you have GPU or
    other accelerator, we were unable to detect it." at every start: on the embedded default (a
    CPU run by design) nothing to act on, and where a GPU was asked for and is missing,
    :func:`maskgrpo_ray.pipeline.build.resolve_device` already says so in our words. DeepSpeed keeps the
    accelerator it picks on its first import, so ``DS_ACCELERATOR`` is set only for the block
    (no child process inherits it); a value the user set wins.
    """
    if "DS_ACCELERATOR" in os.environ:
        yield
        return
    os.environ["DS_ACCELERATOR"] = device_type
    try:
        yield
    finally:
        os.environ.pop("DS_ACCELERATOR", None)


def deepspeed_globals() -> list[Any]:
    """The objects of :data:`DEEPSPEED_GLOBALS` that import here (for ``load_torch_file``'s
    ``allow`` on a DeepSpeed file: its model states name them)."""
    import importlib

    out = []
    with deepspeed_accelerator("cuda" if torch.cuda.is_available() else "cpu"):
        for name in sorted(DEEPSPEED_GLOBALS):
            module, _, attr = name.rpartition(".")
            try:
                out.append(getattr(importlib.import_module(module), attr))
            except (ImportError, AttributeError):
                continue  # that DeepSpeed part is not installed: its files cannot name it either
    return out


def check_pickles(
    folder: str | Path, allowed: frozenset[str] = DEEPSPEED_GLOBALS, pattern: str = "*.pt"
) -> int:
    """Scan every ``pattern`` file under ``folder`` (a checkpoint DeepSpeed will unpickle);
    raise :class:`UnsafeFileError` on the first that imports anything outside ``allowed``.
    Returns the number of files scanned."""
    files = sorted(Path(folder).rglob(pattern))
    for f in files:
        bad = [n for n in unsafe_globals(f) if n not in allowed]
        if bad:
            raise _refusal(f, bad, "a checkpoint file")
    return len(files)
