"""The Ray backend's part of a checkpoint: the learner group's DeepSpeed files (all ranks,
brought to the driver's machine through the object store) in ``learner/``, and
``executor.pt`` with the policy version and the step planner's random stream."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from maskgrpo_ray.learner.group import LearnerGroup
from maskgrpo_ray.loop.snapshot import host_copy
from maskgrpo_ray.weights.safe_files import load_torch_file


def snapshot_learner(learner: LearnerGroup, policy_version: int) -> Callable[[Path], None]:
    """The learner's state taken now (the ranks' files in the object store, the version and
    the planner's stream copied); the returned call writes it to a folder (on any thread)."""
    files = learner.snapshot()
    state = host_copy({"policy_version": policy_version, "step_generator": learner.planner.state()})

    def write(folder: Path) -> None:
        learner.write_snapshot(str((folder / "learner").resolve()), files)
        torch.save(state, folder / "executor.pt")

    return write


def load_learner(learner: LearnerGroup, folder: Path) -> None:
    """Restore what :func:`snapshot_learner` wrote into ``learner`` (its version included)."""
    state = load_torch_file(folder / "executor.pt", "a checkpoint's executor state")
    learner.load(
        str((folder / "learner").resolve()), int(state["policy_version"]), state["step_generator"]
    )
