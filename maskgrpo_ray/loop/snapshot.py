"""Checkpoints off the critical path (``run.checkpoint_async``), as large trainers save them:
the step loop pays only for a *snapshot* (the learner's state copied to host memory, the
driver's counters copied), and one background thread writes it (files, the manifest's sha256,
fsync, publish, ``latest``, retention) while the next steps run.

Threads: the driver's main thread takes snapshots and calls :meth:`BackgroundWriter.submit`
and :meth:`BackgroundWriter.wait`; the writer thread runs one write at a time and touches only
what its snapshot holds (never the live model, optimizer or source). A save waits for the
previous write to finish first (at most one in flight, so host memory holds at most two
states), and so do a restore, a learner roll-back and the run's end. The storage publishes
the manifest last and moves ``latest`` after it (:meth:`maskgrpo_ray.checkpoints.storage.CheckpointStore.save`),
so a crash mid-write leaves the previous checkpoint the newest valid one.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger(__name__)


def host_copy(state: Any) -> Any:
    """A deep copy of ``state`` (nested dicts, lists, tuples of tensors and plain values) with
    every tensor copied to host memory: what the snapshot holds while the training moves on.
    A CPU tensor is cloned (the live one keeps changing); a GPU tensor is copied to pinned
    memory where CUDA is there (the copy a background write reads)."""
    if isinstance(state, torch.Tensor):
        t = state.detach()
        if t.device.type == "cpu":
            return t.clone()
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=torch.cuda.is_available())
        return out.copy_(t, non_blocking=False)
    if isinstance(state, dict):
        return type(state)((k, host_copy(v)) for k, v in state.items())
    if isinstance(state, list | tuple):
        return type(state)(host_copy(v) for v in state)
    return copy.deepcopy(state)


class BackgroundWriter:
    """One background thread writing one snapshot at a time (see the module doc).

    Attributes:
        last_write_s: the seconds the last finished write took (its whole path to storage).
        last_snapshot_s: the seconds the last snapshot took on the loop's path.
    """

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.last_write_s = 0.0
        self.last_snapshot_s = 0.0

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, write: Callable[[], Any], what: str) -> None:
        """Wait for the write in flight, then run ``write()`` in the background."""
        self.wait()

        def run() -> None:
            t0 = time.monotonic()
            try:
                write()
            except BaseException as err:  # raised in the main thread by the next wait()
                self._error = err
            else:
                self.last_write_s = time.monotonic() - t0
                log.info("%s written in the background (%.2f s)", what, self.last_write_s)

        self._thread = threading.Thread(target=run, name="maskgrpo-checkpoint", daemon=False)
        self._thread.start()

    def wait(self) -> float:
        """Block until no write is in flight; the seconds waited. A write that failed raises
        here (the checkpoint it was writing is not published; the previous one stands)."""
        t0 = time.monotonic()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        err, self._error = self._error, None
        if err is not None:
            raise RuntimeError(f"a background checkpoint write failed: {err}") from err
        return time.monotonic() - t0
