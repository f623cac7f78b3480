"""``maskgrpo`` command line: ``maskgrpo train --config FILE|NAME [--set k=v ...] [--run-dir DIR]``,
``maskgrpo eval``, ``maskgrpo prompts``, ``maskgrpo scale|status``, ``maskgrpo validate``,
``maskgrpo configs`` (the built-in configs: ``--config toy``)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import yaml

from maskgrpo_ray.checkpoints.storage import CheckpointError
from maskgrpo_ray.cli.run_folder import COMPLETE, complete_run, find_checkpoint, resolve_run_dir
from maskgrpo_ray.config import Config, ConfigError, load_config
from maskgrpo_ray.errors import UserError, one_line
from maskgrpo_ray.loop.driver import RunFailed
from maskgrpo_ray.loop.executor import Executor
from maskgrpo_ray.weights.hub import pending_fields, resolve_config

log = logging.getLogger("maskgrpo")


DEBUG_ENV = "MASKGRPO_DEBUG"


class _Parser(argparse.ArgumentParser):
    """argparse's usage errors as one line and exit 2 (the sub-commands' parsers too)."""

    def error(self, message: str) -> NoReturn:
        print(f"maskgrpo: {self.prog}: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)


def _add_train(sub: Any) -> str:
    """``maskgrpo train``'s arguments; returns the ``--config`` help the other commands share."""
    t = sub.add_parser("train", help="run Mask-GRPO training")
    config_help = "a YAML file or a built-in config's name, e.g. toy (maskgrpo configs list)"
    t.add_argument("--config", default=None, help=f"{config_help}; default: toy's values")
    t.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config field, e.g. --set train.steps=20 (repeatable)",
    )
    t.add_argument("--run-dir", default=None, help="where outputs go (default: runs/<name>-<time>)")
    t.add_argument(
        "--resume",
        default="auto",
        metavar="RUN_DIR|auto",
        help="RUN_DIR: continue RUN_DIR from its latest valid checkpoint, with its saved config "
        "(an error if it has none); auto (the default): resume when the run's checkpoint "
        "location (run.storage, else RUN_DIR/checkpoints) holds one, else start from step 0",
    )
    t.add_argument(
        "--backend",
        choices=["ray", "local"],
        default=None,
        help="'local' runs the single-process baseline (same as --set run.backend=local)",
    )
    t.add_argument(
        "--json",
        action="store_true",
        help="print the run's whole summary (RUN_DIR/summary.json) as JSON before its last line",
    )
    return config_help


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="maskgrpo", description=__doc__)
    p.add_argument(
        "--debug",
        action="store_true",
        help=f"show the traceback of a user error too (or set {DEBUG_ENV}=1)",
    )
    sub = p.add_subparsers(dest="command", required=True)
    config_help = _add_train(sub)
    for name, helptext in (
        ("scale", "change a running job's rollout actor count at its next step"),
        ("status", "print a running job's last step status"),
    ):
        c = sub.add_parser(name, help=helptext)
        c.add_argument("--run", default="toy", help="the job's run.name (default: toy)")
        c.add_argument(
            "--address",
            default=None,
            help="the job's Ray head: HOST:PORT of its GCS, or the job API's URL "
            "http://HOST:8265 (default: RAY_ADDRESS, else the head started on this machine)",
        )
        c.add_argument(
            "--timeout",
            type=float,
            default=20.0,
            metavar="S",
            help="seconds to find and join the cluster before giving up (default 20)",
        )
        if name == "scale":
            c.add_argument(
                "--rollout",
                type=int,
                required=True,
                metavar="N",
                help="rollout actors wanted (>= 1)",
            )
    from maskgrpo_ray.cli import plan as plan_cli

    plan_cli.add_parser(sub)
    v = sub.add_parser("validate", help="check a config and print it resolved")
    v.add_argument("--config", default=None, help=config_help)
    v.add_argument("--set", dest="overrides", action="append", default=[])
    from maskgrpo_ray.cli import configs as configs_cli
    from maskgrpo_ray.cli import geneval as geneval_cli
    from maskgrpo_ray.cli import prompts as prompts_cli
    from maskgrpo_ray.evaluation import cli as eval_cli

    eval_cli.register(sub)
    prompts_cli.register(sub)
    configs_cli.register(sub)
    geneval_cli.register(sub)
    d = sub.add_parser("config-docs", help="print the config reference (docs/config.md)")
    d.add_argument("--out", default=None, metavar="FILE", help="write it to FILE instead")
    return p


@dataclass(frozen=True)
class RunPrompts:
    """The prompt records a training run reads (loaded, and so checked, before it starts)."""

    train: list[Any]
    eval: list[Any]


def preflight(cfg: Config, unfetched: Collection[str] = ()) -> RunPrompts:
    """What a run needs before anything starts: its prompt files read and checked, the model
    kind's and the rewards' files found (nothing downloaded: hub ids were resolved before, by
    :func:`maskgrpo_ray.weights.hub.resolve_config`). ``unfetched``: config keys holding a hub id that
    was checked on the hub but not downloaded (``maskgrpo validate``); their files are not
    checked. Raises a :class:`UserError` naming the field, the path and the fix."""
    from maskgrpo_ray.models.registry import check_model_files
    from maskgrpo_ray.pipeline.geneval_judge import warn_same_detector
    from maskgrpo_ray.pipeline.reward_refresh import check_reward_refresh
    from maskgrpo_ray.pipeline.settings import check_diversity_spaces, settings_from_config
    from maskgrpo_ray.prompts.loading import load_prompt_records
    from maskgrpo_ray.rewards.base import check_reward_files

    column = cfg.data.prompt_column
    train = load_prompt_records(cfg.data.prompts, "train", column=column).records
    evals = load_prompt_records(
        cfg.data.eval_prompts or cfg.data.prompts, "eval", column=column
    ).records
    if not any(k.startswith("model.") for k in unfetched):
        check_model_files(cfg.model)
    check_diversity_spaces(cfg)  # reward.diversity_embedding, train.diversity: one line
    check_reward_refresh(cfg)  # reward.refresh names a kind that can keep training
    reward = settings_from_config(cfg).reward
    fetched = [
        s
        for i, s in enumerate(reward.specs)
        if not any(k.startswith(f"reward.components[{i}].") for k in unfetched)
    ]
    if reward.judge is not None and not any(k.startswith("eval.geneval.") for k in unfetched):
        fetched.append(reward.judge)  # eval.geneval's scorer
    warn_same_detector(reward.specs, reward.judge)  # one line: trained and judged alike
    check_reward_files(fetched)
    for key in sorted(unfetched):
        log.info("%s: a hub id not downloaded by validate; its files are checked by train", key)
    return RunPrompts(train, evals)


def run_train(
    cfg: Config,
    run_dir: Path,
    resume_from: Path | None = None,
    prompts: RunPrompts | None = None,
) -> dict[str, Any]:
    """Build everything from the config and run the chosen backend (``prompts``: what
    :func:`preflight` loaded; None: preflight here)."""
    import torch

    from maskgrpo_ray.loop import driver
    from maskgrpo_ray.loop.held_out import EvalSet
    from maskgrpo_ray.pipeline.build import build_filter, build_policy, build_reward_from_settings
    from maskgrpo_ray.prompts.loading import PromptStream, keep_valid_prompts
    from maskgrpo_ray.runlog.run_log import write_json_atomic

    prompts = prompts or preflight(cfg)
    torch.manual_seed(cfg.run.seed)
    run_dir.mkdir(parents=True, exist_ok=True)
    resolved = cfg.model_dump(mode="json")
    write_json_atomic(run_dir / "config.json", resolved)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(resolved, sort_keys=False))
    train_records, eval_records = prompts.train, prompts.eval
    train_prompts = [r.text for r in train_records]
    eval_prompts = [r.text for r in eval_records]
    if cfg.run.backend == "local":
        from maskgrpo_ray.loop.local import LocalExecutor
        from maskgrpo_ray.pipeline.settings import settings_from_config

        settings = settings_from_config(cfg)
        policy = build_policy(cfg.model)
        train_prompts, _ = keep_valid_prompts(train_prompts, lambda p: policy.tokenize([p]))
        eval_prompts, _ = keep_valid_prompts(eval_prompts, lambda p: policy.tokenize([p]))
        reward = build_reward_from_settings(settings.reward)
        ex: Executor = LocalExecutor(cfg, policy, reward, build_filter(settings.filter))
    else:
        from maskgrpo_ray.backend.ray_executor import RayExecutor

        ex = RayExecutor(cfg)
        train_prompts, _ = keep_valid_prompts(train_prompts, batched_check(ex, train_prompts))
        eval_prompts, _ = keep_valid_prompts(eval_prompts, batched_check(ex, eval_prompts))
    table = {r.text: r.meta for r in (*train_records, *eval_records) if r.meta}
    if table:  # the prompt files' metadata, for rewards that read it
        ex.set_prompt_metadata(table)
    stream = PromptStream(train_prompts, cfg.run.seed, cfg.data.shuffle)
    tag_of = {r.text: (r.meta or {}).get("tag") for r in eval_records}
    evals: list[str] | EvalSet = eval_prompts
    if any(tag_of.values()):  # GenEval metadata: evaluations also report per tag
        evals = EvalSet(eval_prompts, [tag_of[p] for p in eval_prompts])
    try:
        return driver.train(
            cfg,
            ex,
            run_dir,
            stream,
            evals,
            resume_from=resume_from,
            on_step_end=ex.on_step_end,
        )
    finally:
        ex.shutdown()


def batched_check(ex: Executor, prompts: list[str]) -> Any:
    """A per-prompt check for ``keep_valid_prompts`` answered from one batched actor call."""
    reasons = dict(zip(prompts, ex.check_prompts(prompts)))

    def check(prompt: str) -> None:
        if reasons[prompt] is not None:
            raise ValueError(reasons[prompt])

    return check


def control(args: argparse.Namespace) -> int:
    """``maskgrpo scale`` / ``maskgrpo status``: talk to a running job's control actor."""
    from maskgrpo_ray.cluster.attach import attach, use_token_if_present

    use_token_if_present()  # before ray is imported: it reads the auth mode then
    import ray

    from maskgrpo_ray.actors.control import NAMESPACE, control_name

    attach(args.address, NAMESPACE, args.timeout)
    name = args.run if args.run.startswith("maskgrpo-control:") else control_name(args.run)
    try:
        actor = ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        print(
            f"maskgrpo: no running job named {args.run!r} (no actor {name!r} in namespace "
            f"{NAMESPACE!r}); pass --run with the job's run.name",
            file=sys.stderr,
        )
        return 2
    try:
        if args.command == "scale":
            ray.get(actor.request_rollout_actors.remote(args.rollout), timeout=args.timeout)
            print(f"requested {args.rollout} rollout actors; applied at the next step boundary")
        status: Any = ray.get(actor.get_status.remote(), timeout=args.timeout)
    except ray.exceptions.RayTaskError as err:
        print(f"maskgrpo: {err.cause}", file=sys.stderr)
        return 2
    except ray.exceptions.GetTimeoutError:
        print(
            f"maskgrpo: the job {args.run!r} did not answer within {args.timeout:.0f} s (its "
            "driver may be busy or gone); try again, or raise --timeout",
            file=sys.stderr,
        )
        return 2
    print(json.dumps(status, indent=2))
    return 0


def config_docs(out: str | None) -> int:
    """Print the generated config reference, or write it to ``out`` (``make docs``)."""
    from maskgrpo_ray.config.docs import render_config_docs

    text = render_config_docs()
    if out is None:
        sys.stdout.write(text)
    else:
        Path(out).write_text(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``maskgrpo``: a user's mistake ends in one line and exit 2 (no traceback unless
    ``--debug`` or ``MASKGRPO_DEBUG=1``); anything else is a bug and keeps its traceback."""
    args = _parser().parse_args(argv)
    debug = args.debug or os.environ.get(DEBUG_ENV, "") not in ("", "0")
    try:
        return _run(args)
    except UserError as err:
        if debug:
            raise
        print(f"maskgrpo: {one_line(str(err))}", file=sys.stderr)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError) as err:
        if debug:
            raise
        where = err.filename if err.filename is not None else "a path"
        print(
            f"maskgrpo: {where}: {err.strerror or err}; check the path "
            f"(--debug or {DEBUG_ENV}=1 shows where it was read)",
            file=sys.stderr,
        )
    return 2


def _run(args: argparse.Namespace) -> int:
    if args.command in ("scale", "status"):
        return control(args)
    if args.command == "config-docs":
        return config_docs(args.out)
    if args.command == "plan":
        from maskgrpo_ray.cli import plan as plan_cli

        return plan_cli.run(args)
    if args.command == "configs":
        from maskgrpo_ray.cli import configs as configs_cli

        return configs_cli.run(args)
    if args.command == "geneval":
        from maskgrpo_ray.cli import geneval as geneval_cli

        return geneval_cli.run(args)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.command == "eval":
        from maskgrpo_ray.evaluation import cli as eval_cli

        return eval_cli.run(args)
    if args.command == "prompts":
        from maskgrpo_ray.cli import prompts as prompts_cli

        return prompts_cli.run(args)
    overrides = list(args.overrides)
    if getattr(args, "backend", None):
        overrides.append(f"run.backend={args.backend}")
    if args.command == "validate":
        cfg = validate_command(args.config, overrides)
        print(json.dumps(cfg.model_dump(mode="json"), indent=2))
        return 0
    try:
        summary, run_dir = train_command(args.config, overrides, args.run_dir, args.resume)
    except RunFailed as err:
        print(f"maskgrpo: the run failed: {err}", file=sys.stderr)
        return 1
    if COMPLETE in summary:  # the run was complete: the one line said so, nothing changed
        print(f"run directory: {run_dir}")
        return 0
    if args.json:
        print(json.dumps(summary, indent=2))
    from maskgrpo_ray.cli.ending import ending_lines

    print("\n".join(ending_lines(summary, run_dir)))
    return 0


ConfigSource = str | Path | Mapping[str, Any] | None


def validate_command(config: ConfigSource, overrides: list[str]) -> Config:
    """``maskgrpo validate``: the config loaded, its hub ids checked on the hub but not fetched,
    its prompts and files checked (:func:`preflight`). Raises a UserError naming the fix."""
    cfg, found = resolve_config(load_config(config, overrides), download=False)
    preflight(cfg, pending_fields(found))
    return cfg


def train_command(
    config: ConfigSource,
    overrides: list[str],
    run_dir: str | Path | None = None,
    resume: str | Path | None = "auto",
) -> tuple[dict[str, Any], Path]:
    """``maskgrpo train``'s whole path (the API's ``train`` too): load the config (a resumed
    run's saved one when ``config`` is None), resolve hub ids to local folders (fetching only
    what ``MASKGRPO_ALLOW_DOWNLOADS`` allows), check prompts and files, find the checkpoint to
    resume, run. Returns the summary and the run directory. Raises a UserError for bad input
    (nothing started), :class:`RunFailed` when the run fails."""
    resume_dir = None if resume in (None, "auto") else Path(str(resume)).expanduser().resolve()
    if resume_dir is not None:
        saved = resume_dir / "config.yaml"
        if config is None and not saved.exists():
            raise ConfigError(
                f"--resume {resume_dir}: no complete checkpoint there ({saved} is missing "
                "too: is it a run directory?); pass the run directory a run wrote"
            )
        cfg = load_config(saved if config is None else config, overrides)
    else:
        cfg = load_config(config, overrides)
    cfg, found = resolve_config(cfg, download=True)  # hub ids -> local snapshot folders, once
    prompts = preflight(cfg, pending_fields(found))  # prompts and model files, before any actor
    run_dir = resume_dir or resolve_run_dir(cfg, run_dir)  # absolute
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(
            f"--run-dir {run_dir}: a file is there; give a folder path (it is created if new)"
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".resume-", dir=run_dir) as scratch:
        try:
            resume_from, where = find_checkpoint(
                cfg, run_dir, Path(scratch), required=resume_dir is not None
            )
        except CheckpointError as err:
            raise ConfigError(str(err)) from None
        if resume_from is None:
            log.info("no checkpoint at %s: starting %s from step 0", where, run_dir)
        else:
            done = complete_run(cfg, run_dir, resume_from)
            if done is not None:
                return done, run_dir
            log.info("resuming %s from checkpoint %s (at %s)", run_dir, resume_from.name, where)
        try:
            return run_train(cfg, run_dir, resume_from, prompts), run_dir
        finally:  # the run's start named it too (above), absolute
            log.info("run folder: %s (checkpoints: %s)", run_dir, where)
