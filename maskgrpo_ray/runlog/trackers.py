"""Experiment trackers (``logging.trackers``): TensorBoard, Weights & Biases, MLflow.

The driver's :class:`~maskgrpo_ray.runlog.run_log.RunLog` forwards what it writes to the run folder:
every step's numeric figures (the ``metrics.jsonl`` row, ``step`` as the step axis), the sample
grids as images, the resolved config as hyperparameters (flattened dotted keys) once at the
start, and ``summary.json``'s numbers at the end. Only the driver holds trackers; no actor
imports this module or a tracker library.

Each library is imported when its tracker opens, never by a run that names none. A tracker
named but not installed fails at config validation (:func:`check_trackers`); a tracker that
raises during the run is warned about once, counted and disabled (:class:`Trackers`), and the
run goes on. A resumed run continues the same tracker run: the ids live in
``RUN_DIR/trackers.json`` (W&B run id, MLflow run id); TensorBoard reuses its log folder.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import math
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, Protocol

from maskgrpo_ray.extras import install_hint

log = logging.getLogger(__name__)

TrackerName = Literal["tensorboard", "wandb", "mlflow"]
TrackerArgs = Mapping[TrackerName, Mapping[str, Any]]

MODULE = {  # tracker -> the module its library is imported as (extra: maskgrpo_ray.extras)
    "tensorboard": "tensorboard",
    "wandb": "wandb",
    "mlflow": "mlflow",
}
ARGS = {  # tracker -> the settings logging.tracker_args may give it
    "tensorboard": ("log_dir",),
    "wandb": ("project", "entity", "group", "mode", "dir"),
    "mlflow": ("tracking_uri", "experiment_name"),
}
IDS_FILE = "trackers.json"


def check_installed(names: Sequence[TrackerName]) -> None:
    """Raise ValueError (one line: the tracker, the fix) when ``names`` repeats a tracker or
    names one whose library is not installed. Finds the library without importing it."""
    for name in names:
        if names.count(name) > 1:
            raise ValueError(f"{name!r} is named twice; name each tracker once")
        module = MODULE[name]
        if importlib.util.find_spec(module) is None:
            raise ValueError(
                f"tracker {name!r} is named but the {module!r} package is not installed; "
                f"{install_hint(module)} (or drop {name!r} from logging.trackers)"
            )


def check_args(names: Sequence[TrackerName], args: TrackerArgs) -> None:
    """Raise ValueError when ``args`` sets a tracker ``names`` leaves out, or a setting that
    tracker does not take (:data:`ARGS`)."""
    for name, settings in args.items():
        if name not in names:
            raise ValueError(
                f"logging.tracker_args has settings for {name!r}, which logging.trackers does "
                f"not name; add {name!r} to logging.trackers or drop its settings"
            )
        unknown = sorted(set(settings) - set(ARGS[name]))
        if unknown:
            raise ValueError(
                f"logging.tracker_args.{name} has {unknown}: {name} takes {list(ARGS[name])}"
            )


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; lists and ``None`` become JSON text."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping) and v:
            out.update(flatten(v, key + "."))
        elif isinstance(v, bool | int | float | str):
            out[key] = v
        else:
            out[key] = json.dumps(v)
    return out


def numbers(row: Mapping[str, Any]) -> dict[str, float]:
    """The finite numbers of a (nested) row as floats, dotted keys, ``step`` left out."""
    out = {}
    for k, v in flatten(row).items():
        if k != "step" and isinstance(v, int | float) and math.isfinite(v):
            out[k] = float(v)
    return out


class Tracker(Protocol):
    """One tracker library's run. Methods may raise; :class:`Trackers` handles it."""

    name: str

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None: ...

    def log_image(self, step: int, key: str, path: Path) -> None: ...

    def log_summary(self, step: int, summary: dict[str, float]) -> None: ...

    def close(self, ok: bool) -> None: ...


class TensorBoardTracker:
    """``RUN_DIR/tensorboard`` (or ``log_dir``) through ``torch.utils.tensorboard``; a resume
    writes to the same folder with ``purge_step`` (TensorBoard drops the re-done steps)."""

    name = "tensorboard"

    def __init__(self, run_dir: Path, config: dict[str, Any], start_step: int, log_dir: str = ""):
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        self.log_dir = Path(log_dir) if log_dir else run_dir / "tensorboard"
        self.writer = SummaryWriter(str(self.log_dir), purge_step=start_step or None)
        for summary in hparams(config, {}):  # the HParams dashboard's view of the config
            self.writer._get_file_writer().add_summary(summary, start_step)
        text = "\n".join(f"    {k} = {v}" for k, v in sorted(config.items()))
        self.writer.add_text("config", text, start_step)  # indented: Markdown code block

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        for k, v in metrics.items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def log_image(self, step: int, key: str, path: Path) -> None:
        import numpy as np
        from PIL import Image

        with Image.open(path) as img:
            self.writer.add_image(key, np.asarray(img.convert("RGB")), step, dataformats="HWC")

    def log_summary(self, step: int, summary: dict[str, float]) -> None:
        for k, v in summary.items():
            self.writer.add_scalar(f"summary/{k}", v, step)

    def close(self, ok: bool) -> None:
        self.writer.close()


class WandbTracker:
    """A W&B run; its id is kept in ``RUN_DIR/trackers.json`` and a resume passes it back with
    ``resume="allow"``. Offline with ``mode: offline`` or ``WANDB_MODE=offline``."""

    name = "wandb"

    def __init__(
        self, run_dir: Path, config: dict[str, Any], run_id: str | None, run_name: str, **args: Any
    ):
        import wandb
        from wandb.sdk.lib.runid import generate_id

        if "dir" not in args and "WANDB_DIR" not in os.environ:
            args["dir"] = str(run_dir)  # its files beside the run's (wandb/ in RUN_DIR)
        if args.get("dir"):
            Path(args["dir"]).mkdir(parents=True, exist_ok=True)
        args.setdefault("project", "maskgrpo")
        self.run = wandb.init(
            id=run_id or generate_id(),
            resume="allow",
            name=run_name,
            config=config,
            allow_val_change=True,  # a resume may change a setting (e.g. train.steps)
            settings=wandb.Settings(console="off", x_disable_stats=True, silent=True),
            **args,
        )
        self.id = self.run.id

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def log_image(self, step: int, key: str, path: Path) -> None:
        import wandb

        self.run.log({key: wandb.Image(str(path))}, step=step)

    def log_summary(self, step: int, summary: dict[str, float]) -> None:
        self.run.summary.update({f"summary/{k}": v for k, v in summary.items()})

    def close(self, ok: bool) -> None:
        self.run.finish(exit_code=0 if ok else 1)


class MlflowTracker:
    """An MLflow run through ``MlflowClient`` (no global active run, no atexit hook); its id is
    kept in ``RUN_DIR/trackers.json`` and a resume logs to it again. Default store: the file
    store ``RUN_DIR/mlruns`` (``tracking_uri`` or ``MLFLOW_TRACKING_URI`` for a server)."""

    name = "mlflow"

    def __init__(
        self,
        run_dir: Path,
        config: dict[str, Any],
        run_id: str | None,
        run_name: str,
        tracking_uri: str = "",
        experiment_name: str = "maskgrpo",
    ):
        if not tracking_uri and "MLFLOW_TRACKING_URI" not in os.environ:
            tracking_uri = (run_dir / "mlruns").resolve().as_uri()
            # MLflow 3 keeps the file store in maintenance mode behind this switch; a database
            # store needs the full mlflow package (SQLAlchemy), a server needs tracking_uri
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.tracking import MlflowClient

        uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI", "")
        # the file store keeps one file per metric, so `a` and `a/b` (eval_reward and
        # eval_reward/<tag>) cannot both exist there: it gets `a.b`
        self.file_store = uri.startswith("file:") or (":" not in uri and uri != "databricks")
        self.client = MlflowClient(tracking_uri=tracking_uri or None)
        found = self._existing(run_id)
        if found is None:
            exp = self.client.get_experiment_by_name(experiment_name)
            exp_id = exp.experiment_id if exp else self.client.create_experiment(experiment_name)
            self.id = self.client.create_run(exp_id, run_name=run_name).info.run_id
            logged: dict[str, str] = {}
        else:
            self.id, logged = found
            self.client.update_run(self.id, status="RUNNING")
        params = {k: str(v)[:6000] for k, v in config.items() if k not in logged}
        self._batch(params=params)  # params are immutable: a resume adds only new keys

    def _existing(self, run_id: str | None) -> tuple[str, dict[str, str]] | None:
        if run_id is None:
            return None
        try:
            return run_id, self.client.get_run(run_id).data.params
        except Exception as err:  # e.g. another tracking_uri than the run's first start
            log.warning("mlflow run %s not found (%s): starting a new MLflow run", run_id, err)
            return None

    def _batch(self, step: int = 0, metrics: dict[str, float] | None = None, **kw: Any) -> None:
        from mlflow.entities import Metric, Param

        now = int(time.time() * 1000)
        ms = [Metric(self.metric_key(k), v, now, step) for k, v in (metrics or {}).items()]
        ps = [Param(k, v) for k, v in kw.get("params", {}).items()]
        for i in range(0, max(len(ms), len(ps)), 100):  # MLflow's batch limit is 100 params
            self.client.log_batch(self.id, metrics=ms[i : i + 100], params=ps[i : i + 100])

    def metric_key(self, key: str) -> str:
        return key.replace("/", ".") if self.file_store else key

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self._batch(step, metrics)

    def log_image(self, step: int, key: str, path: Path) -> None:
        self.client.log_artifact(self.id, str(path), key)

    def log_summary(self, step: int, summary: dict[str, float]) -> None:
        self._batch(step, {f"summary/{k}": v for k, v in summary.items()})

    def close(self, ok: bool) -> None:
        self.client.set_terminated(self.id, "FINISHED" if ok else "FAILED")


class Trackers:
    """The run's open trackers. A call that raises disables that tracker for the rest of the
    run, with one warning; ``failures`` counts them (``summary.json``'s ``tracker_failures``)."""

    def __init__(self, trackers: list[Tracker] | None = None) -> None:
        self.live: list[Tracker] = list(trackers or [])
        self.failures: dict[str, int] = {}
        self.last_step = 0

    def _each(self, what: str, call: Any) -> None:
        for t in list(self.live):
            try:
                call(t)
            except Exception as err:
                self.disable(t.name, what, err)
                self.live.remove(t)
                with contextlib.suppress(Exception):
                    t.close(False)

    def disable(self, name: str, what: str, err: BaseException) -> None:
        self.failures[name] = self.failures.get(name, 0) + 1
        log.warning(
            "tracker %s failed to %s (%s: %s); it is disabled for the rest of this run, which "
            "goes on (metrics.jsonl and the run folder have everything)",
            name,
            what,
            type(err).__name__,
            err,
        )

    def log_metrics(self, step: int, row: Mapping[str, Any]) -> None:
        self.last_step = max(self.last_step, step)
        metrics = numbers(row)
        self._each(f"log step {step}", lambda t: t.log_metrics(step, metrics))

    def log_image(self, step: int, key: str, path: Path) -> None:
        self._each(f"log the image {path.name}", lambda t: t.log_image(step, key, path))

    def log_summary(self, summary: Mapping[str, Any]) -> None:
        figures = numbers(summary)
        self._each("log the summary", lambda t: t.log_summary(self.last_step, figures))

    def close(self, ok: bool) -> None:
        self._each("close", lambda t: t.close(ok))
        self.live = []


def open_trackers(
    names: Sequence[TrackerName],
    args: TrackerArgs,
    run_dir: Path,
    config: Mapping[str, Any],
    start_step: int,
    run_name: str,
) -> Trackers:
    """Open the named trackers for ``run_dir`` (continuing the runs in ``trackers.json`` when
    resuming); a tracker that fails to open is disabled like one failing later."""
    out = Trackers()
    out.last_step = start_step
    if not names:
        return out
    ids_path = run_dir / IDS_FILE
    ids = json.loads(ids_path.read_text()) if ids_path.exists() else {}
    flat = flatten(config)
    for name in names:
        kw = dict(args.get(name, {}))
        try:
            if name == "tensorboard":
                t: Tracker = TensorBoardTracker(run_dir, flat, start_step, **kw)
            elif name == "wandb":
                t = WandbTracker(run_dir, flat, ids.get("wandb"), run_name, **kw)
                ids["wandb"] = t.id
            else:
                t = MlflowTracker(run_dir, flat, ids.get("mlflow"), run_name, **kw)
                ids["mlflow"] = t.id
        except Exception as err:
            out.disable(name, "open", err)
            continue
        out.live.append(t)
        log.info(
            "tracker %s: logging this run%s", name, f" (id {ids[name]})" if name in ids else ""
        )
    ids_path.write_text(json.dumps(ids, indent=2))
    return out
