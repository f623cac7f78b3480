"""Where ``maskgrpo train`` writes a run, and what a resume of it may do.

* The run folder: ``--run-dir``, else ``run.run_dir``, else ``runs/<run.name>-<time>``, always
  made absolute (the run logs it at its start and its end). Inside a Ray job's uploaded working
  directory (``.../runtime_resources/working_dir_files/_ray_pkg_<hash>/``, which Ray deletes
  with the job's package) the default goes to a lasting place instead, ``$MASKGRPO_RUNS_DIR``
  or ``~/maskgrpo-runs`` (:func:`lasting_runs_root`), and a relative ``--run-dir``,
  ``run.run_dir`` or ``run.storage`` is refused in one line naming the fix.
* The checkpoint a run resumes from (:func:`find_checkpoint`) and whether the run is already
  complete (:func:`complete_run`): a run's end is a checkpoint of its last step, so a resume
  with a larger ``train.steps`` continues it; with the same or a smaller one nothing changes.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from maskgrpo_ray.checkpoints.run_store import run_store
from maskgrpo_ray.checkpoints.storage import STEP_PREFIX
from maskgrpo_ray.config import Config, ConfigError

log = logging.getLogger("maskgrpo")

RUNS_ENV = "MASKGRPO_RUNS_DIR"
COMPLETE = "unchanged"  # the key train_command's summary carries when the run was complete


def ray_job_working_dir(cwd: Path | None = None) -> Path | None:
    """The Ray job's uploaded working directory that ``cwd`` (default: this process's) is in,
    or None. Ray unpacks a job's ``working_dir`` to
    ``<session>/runtime_resources/working_dir_files/_ray_pkg_<hash>/`` and runs the
    entrypoint there; the folder goes when Ray drops the package (the job's end, a new
    session, the head's restart)."""
    here = (cwd or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        if folder.name.startswith("_ray_pkg_") and folder.parent.name == "working_dir_files":
            return folder
    return None


def lasting_runs_root() -> Path:
    """Where a Ray job's runs go by default: ``$MASKGRPO_RUNS_DIR``, else ``~/maskgrpo-runs``
    (on the machine of the job's driver: the head)."""
    return Path(os.environ.get(RUNS_ENV) or Path.home() / "maskgrpo-runs").expanduser()


def resolve_run_dir(cfg: Config, arg: str | Path | None) -> Path:
    """The run folder, absolute (see the module docstring). Raises ConfigError for a relative
    path inside a Ray job's working directory, before anything starts."""
    job_dir = ray_job_working_dir()
    if job_dir is not None:
        refuse_relative_in_job(cfg, arg, job_dir)
    if arg:
        return Path(arg).expanduser().resolve()
    if cfg.run.run_dir:
        return Path(cfg.run.run_dir).expanduser().resolve()
    name = f"{cfg.run.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    if job_dir is None:
        return (Path("runs") / name).resolve()
    run_dir = lasting_runs_root().resolve() / name
    log.info(
        "in the Ray job's working directory %s (Ray deletes it with the job's package): the run "
        "folder is %s (${%s}, else ~/maskgrpo-runs; --run-dir names another)",
        job_dir,
        run_dir,
        RUNS_ENV,
    )
    return run_dir


def refuse_relative_in_job(cfg: Config, arg: str | Path | None, job_dir: Path) -> None:
    """A relative run folder or checkpoint location inside a Ray job's working directory would
    be deleted with it: one line naming the field and the fix."""
    fix = (
        "give an absolute path on storage that outlives the job (a shared volume such as "
        f"/mnt/maskgrpo/runs/{cfg.run.name}, or run.storage=s3://...)"
    )
    where = f"a relative path inside the Ray job's working directory {job_dir}, which Ray deletes"
    for field, value in (("--run-dir", arg), ("run.run_dir", cfg.run.run_dir)):
        if value and not Path(value).expanduser().is_absolute():
            leave = f"drop it for the default ${RUNS_ENV} or ~/maskgrpo-runs/<name>-<time>, or "
            raise ConfigError(f"{field} {value}: {where}; {leave}{fix}")
    storage = cfg.run.storage
    if storage and "://" not in storage and not Path(storage).expanduser().is_absolute():
        raise ConfigError(f"run.storage={storage!r}: {where}; {fix}")


def find_checkpoint(
    cfg: Config, run_dir: Path, scratch: Path, required: bool
) -> tuple[Path | None, str]:
    """The run's newest valid checkpoint as a local folder (None: start from step 0), and
    where it is. Raises ConfigError when ``required`` and there is none, CheckpointError when
    the location holds checkpoints but none is valid."""
    store = run_store(cfg.run, run_dir)
    folder = store.fetch_valid(scratch)
    if folder is None and required:
        raise ConfigError(
            f"--resume {run_dir}: no complete checkpoint at {store.location} (set "
            "run.checkpoint_every_steps > 0 in the run, or drop --resume to start from step 0)"
        )
    return folder, store.location


def checkpoint_step(folder: Path) -> int:
    """The step a checkpoint folder (``step_000120``) resumes at."""
    return int(folder.name.removeprefix(STEP_PREFIX))


def complete_run(cfg: Config, run_dir: Path, folder: Path) -> dict[str, Any] | None:
    """Whether a resume from checkpoint ``folder`` has nothing to do: the run's
    ``summary.json``, with :data:`COMPLETE` set to the line that says so (logged here), when
    the run completed at that checkpoint's step and ``train.steps`` asks for no more; None
    when the run goes on (more steps, or a completed step loop whose end did not finish).
    Raises ConfigError when the checkpoint of an unfinished run is past ``train.steps``."""
    step, want = checkpoint_step(folder), cfg.train.steps
    if step < want:
        return None
    path = run_dir / "summary.json"
    summary = json.loads(path.read_text()) if path.is_file() else {}
    if not (summary.get("completed") and summary.get("steps") == step):
        if step == want:
            return None  # the steps are done, the end (final evaluation, export) is not: do it
        raise ConfigError(
            f"train.steps={want}: the run in {run_dir} has a checkpoint at step {step}, past "
            f"it, and did not finish; set train.steps={step} to finish it there, or more to "
            "train on"
        )
    line = (
        f"{run_dir} is complete: {step} steps, its last checkpoint {folder.name}; "
        f"train.steps={want} asks for no more, so nothing was changed; to train on, set "
        f"train.steps above {step} (--set train.steps={step + max(step // 2, 1)})"
    )
    log.warning("%s", line)
    return {**summary, COMPLETE: line}
