"""The Python API: the ``maskgrpo`` commands as functions, on the commands' own code paths.

    import maskgrpo_ray as mg

    cfg = mg.load_config("toy", {"train.steps": 20, "run.backend": "local"})
    summary = mg.train(cfg, run_dir="runs/notebook")     # the summary dict (summary.json)
    report = mg.evaluate(["base", summary["run_dir"]])   # base against the tuned weights
    split = mg.plan(profile="showo_512_h100", gpus=16)   # maskgrpo plan --json's object

``config`` is anything ``--config`` takes (a YAML file, or a built-in config's name such as
``"toy"``: ``maskgrpo configs list``), a config tree (a dict, as the YAML reads) or a
:class:`~maskgrpo_ray.config.Config`; ``overrides`` are ``--set`` items (``["train.steps=20"]``)
or a dict (``{"train.steps": 20}``). :func:`train` is ``maskgrpo train``: hub ids resolved to
local folders, prompts and files checked, an existing checkpoint resumed (``resume="auto"``).
:func:`evaluate` is ``maskgrpo eval``, :func:`plan` is ``maskgrpo plan --json``,
:func:`validate` is ``maskgrpo validate``.

A bad input raises a :class:`~maskgrpo_ray.errors.UserError` (one line: the field, the value,
the fix) before anything starts; a failed run raises :class:`~maskgrpo_ray.loop.driver.RunFailed`.
Nothing here configures logging: ``logging.basicConfig(level=logging.INFO)`` shows the commands'
progress lines. Where :func:`train` wrote is said in one line all the same (the log's, when
logging shows this module's INFO lines; else on stderr, beside the progress bar), and the
summary carries it as an absolute path. Importing this module loads no torch and no ray (the
functions do).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from maskgrpo_ray.config import Config
from maskgrpo_ray.config import load_config as _load_config

__all__ = ["evaluate", "load_config", "plan", "train", "validate"]

log = logging.getLogger(__name__)

ConfigSource = str | Path | Mapping[str, Any] | Config | None
Overrides = Sequence[str] | Mapping[str, Any] | None


def _override_items(overrides: Overrides) -> list[str]:
    """``{"a.b": 1}`` -> ``["a.b=1"]`` (JSON is YAML: the value reads back as given)."""
    if overrides is None:
        return []
    if isinstance(overrides, str):
        raise TypeError(f"overrides={overrides!r}: give a list of 'key=value' items or a dict")
    if isinstance(overrides, Mapping):
        return [f"{key}={json.dumps(value)}" for key, value in overrides.items()]
    return list(overrides)


def _source(config: ConfigSource) -> str | Path | Mapping[str, Any] | None:
    return config.model_dump(mode="json") if isinstance(config, Config) else config


def load_config(config: ConfigSource = None, overrides: Overrides = None) -> Config:
    """The validated config (``maskgrpo validate`` without the file checks): ``config`` with
    ``overrides`` applied; None: the defaults (the built-in ``toy``'s values)."""
    return _load_config(_source(config), _override_items(overrides))


def validate(config: ConfigSource = None, overrides: Overrides = None) -> Config:
    """``maskgrpo validate``: the config, its hub ids checked (not fetched), its prompt files
    read and its model and reward files found. Returns the resolved config."""
    from maskgrpo_ray.cli.app import validate_command

    return validate_command(_source(config), _override_items(overrides))


def train(
    config: ConfigSource = None,
    overrides: Overrides = None,
    *,
    run_dir: str | Path | None = None,
    resume: str | Path | None = "auto",
    backend: str | None = None,
) -> dict[str, Any]:
    """``maskgrpo train``: run Mask-GRPO and return the run's summary (``summary.json``'s
    content) with ``run_dir`` added (absolute), which one line (``run directory: ...``, as the
    command's last) also names when the run ends.
    On the toy, ``final_accuracy`` is the held-out accuracy after training (the share of the
    evaluation prompts' samples the toy's rules judge right; ``base_accuracy`` the same before).

    Args:
        config, overrides: the run's config (see the module's docstring).
        run_dir: where outputs go (default: ``run.run_dir``, else ``runs/<name>-<time>``).
        resume: ``"auto"`` resumes from the run's newest checkpoint when there is one; a run
            directory resumes that run (its saved config when ``config`` is None).
        backend: ``"local"`` or ``"ray"`` (default: ``run.backend``).
    """
    from maskgrpo_ray.cli.app import train_command

    items = _override_items(overrides) + ([f"run.backend={backend}"] if backend else [])
    summary, where = train_command(_source(config), items, run_dir, resume)
    where = Path(where).absolute()
    _say(f"run directory: {where}")  # the command's last line, here for a user of the API
    return {**summary, "run_dir": str(where)}


def _say(line: str) -> None:
    """``line`` to the log when logging shows this module's INFO lines, else on stderr: a
    user who configured no logging still learns it, and nobody reads it twice."""
    if log.isEnabledFor(logging.INFO) and log.hasHandlers():
        log.info(line)
    else:
        print(line, file=sys.stderr, flush=True)


def _namespace(register: Callable[[Any], None], command: str, **values: Any) -> argparse.Namespace:
    """The arguments the command's own parser gives, defaults included, with ``values`` set."""
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args([command])
    for key, value in values.items():
        if not hasattr(args, key):
            raise AssertionError(f"maskgrpo {command} has no argument {key!r}")  # a bug here
        setattr(args, key, value)
    return args


def evaluate(
    weights: Sequence[str] = ("base",),
    *,
    config: ConfigSource = None,
    overrides: Overrides = None,
    prompts: str | Path | None = None,
    prompt_column: str | None = None,
    samples_per_prompt: int | None = None,
    out: str | Path | None = None,
    backend: str | None = None,
    actors: int | None = None,
    metrics: Sequence[str | Mapping[str, Any]] = (),
) -> dict[str, Any]:
    """``maskgrpo eval``: generate for ``prompts`` with each of ``weights`` (``"base"``, a run
    directory, a checkpoint folder or a weights file; ``"LABEL=SOURCE"`` names one), score, and
    write images, ``report.md``/``.html``/``.json`` and ``summary.json`` under ``out``. Returns
    the report (``means``: per model, the mean of every metric) with ``out`` added
    (absolute). ``config`` defaults to the first run directory's saved config; ``metrics`` adds
    metrics besides ``eval.metrics`` (dicts of :class:`~maskgrpo_ray.config.metrics.MetricSpec`'s
    fields, or ``--metric``'s ``"kind=fid,weights=...,reference_dir=..."``)."""
    from maskgrpo_ray.evaluation import cli as eval_cli

    args = _namespace(
        eval_cli.register,
        "eval",
        config=_source(config),
        overrides=_override_items(overrides),
        weights=[str(w) for w in weights],
        prompts=None if prompts is None else str(prompts),
        prompt_column=prompt_column,
        samples_per_prompt=samples_per_prompt,
        out=None if out is None else str(out),
        backend=backend,
        actors=actors,
        metric=list(metrics),
    )
    report, where = eval_cli.evaluate(args)
    return {**report, "out": str(Path(where).absolute())}


def plan(
    profile: str | None = None,
    *,
    gpus: int = 16,
    model: str | None = None,
    resolution: int = 512,
    gpu: str = "H100",
    estimator: str | None = None,
    prompts_per_step: int | None = None,
    sync: bool = False,
    config: str | None = None,
    overrides: Sequence[str] = (),
) -> dict[str, Any]:
    """``maskgrpo plan --json``: the recommended rollout/learner split of ``gpus`` for a built-in
    cost ``profile`` (or ``model="showo"`` at ``resolution`` on ``gpu``; or a run ``config``'s
    workload, with ``overrides``), every split's predicted images/s and the work-conserving
    limit. A model, not a measurement. ValueError (one line, the fix) for an unknown profile or
    GPU."""
    from maskgrpo_ray.cli import plan as plan_cli

    args = _namespace(
        plan_cli.add_parser,
        "plan",
        profile=profile,
        gpus=gpus,
        model=model,
        resolution=resolution,
        gpu=gpu,
        estimator=estimator,
        prompts_per_step=prompts_per_step,
        sync=sync,
        config=config,
        overrides=list(overrides),
    )
    return plan_cli.report(*plan_cli.make_plan(args))
