"""``maskgrpo eval``: arguments, the checks made before any actor starts, and the printout."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from maskgrpo_ray.errors import UserError

log = logging.getLogger("maskgrpo")


def register(sub: Any) -> None:
    """Add the ``eval`` command to the ``maskgrpo`` sub-parsers."""
    e = sub.add_parser(
        "eval",
        help="evaluate the base model and tuned weights on prompts (images, metrics, report)",
    )
    e.add_argument(
        "--config",
        default=None,
        help="a YAML file or a built-in config's name (default: the config.yaml of the first run "
        "directory in --weights, else toy's values)",
    )
    e.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    e.add_argument(
        "--weights",
        action="append",
        default=[],
        metavar="[LABEL=]SOURCE",
        help="a model to evaluate (repeatable): 'base', a run directory (its final policy, "
        "else its newest checkpoint), a checkpoint folder or a .safetensors/.pt file; "
        "labels default to 'base' and 'tuned' (default: base only)",
    )
    e.add_argument("--prompts", default=None, help="prompts (default: data.eval_prompts)")
    e.add_argument("--prompt-column", default=None, help="the prompt column/key of --prompts")
    e.add_argument("--samples-per-prompt", type=int, default=None, metavar="N")
    e.add_argument("--out", default=None, metavar="DIR", help="where images and the report go")
    e.add_argument("--backend", choices=["ray", "local"], default=None)
    e.add_argument("--actors", type=int, default=None, help="rollout actors (Ray backend)")
    e.add_argument(
        "--metric",
        action="append",
        default=[],
        metavar="kind=K,key=value,...",
        help="a metric besides eval.metrics (repeatable), e.g. "
        "kind=clip_score,model=ViT-L-14,weights=/models/clip.bin or "
        "kind=fid,weights=/models/inception.pth,reference_dir=/data/coco_val",
    )


def parse_metric(text: str) -> dict[str, Any]:
    """``"kind=fid,weights=/w.pth"`` -> ``{"kind": "fid", "weights": "/w.pth"}``."""
    out: dict[str, Any] = {}
    for part in filter(None, text.split(",")):
        key, sep, value = part.partition("=")
        if not sep:
            raise ValueError(f"--metric {text!r}: {part!r} is not key=value")
        out[key.strip()] = int(value) if value.strip().isdigit() else value.strip()
    return out


def _labels(specs: list[str]) -> list[tuple[str, str]]:
    out, tuned = [], 0
    for spec in specs or ["base"]:
        label, sep, source = spec.partition("=")
        if not sep:
            source = spec
            if spec == "base":
                label = "base"
            else:
                tuned += 1
                label = "tuned" if tuned == 1 else f"tuned{tuned}"
        out.append((label, source))
    labels = [lab for lab, _ in out]
    if len(set(labels)) != len(labels):
        raise ValueError(f"--weights: labels {labels} repeat; give each LABEL=SOURCE its own")
    return out


def adapter_overrides(sources: list[str], config: Path | None, overrides: list[str]) -> list[str]:
    """``model.lora=...`` from the first LoRA adapter folder among ``sources`` when the config
    has no ``model.lora`` of its own (an adapter evaluated on its base model's config)."""
    from maskgrpo_ray.config import load_config
    from maskgrpo_ray.models.lora import is_adapter_folder, load_adapter

    folders = [Path(s) for s in sources if is_adapter_folder(Path(s))]
    if not folders or load_config(config, overrides).model.lora is not None:
        return []
    settings = load_adapter(folders[0])[1]
    log.info(
        "evaluating LoRA adapter %s: model.lora=%s (its adapter_config.json)", folders[0], settings
    )
    return [f"model.lora={json.dumps(settings)}"]


def check_files(cfg: Any, specs: list[Any]) -> None:
    """Every metric's files, and those of GenEval's scorer (``eval.geneval``), are here."""
    from maskgrpo_ray.evaluation.metric_files import check_metric_files
    from maskgrpo_ray.rewards.base import RewardSpec, check_reward_files

    for k, ms in enumerate(specs):
        check_metric_files(ms, f"eval.metrics[{k}]")
    if cfg.eval.geneval is not None:
        check_reward_files([RewardSpec("geneval", 0.0, cfg.eval.geneval.reward_args())])


def prepare(args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    """Everything checked before an actor starts: config, prompts and metadata, metric files,
    weights. Raises ConfigError / ValueError / FileNotFoundError with the field and the fix."""
    from maskgrpo_ray.config import load_config
    from maskgrpo_ray.config.metrics import MetricSpec
    from maskgrpo_ray.evaluation.runner import ModelSource, geneval_metadata
    from maskgrpo_ray.evaluation.weights import resolve_weights
    from maskgrpo_ray.pipeline.settings import check_diversity_spaces
    from maskgrpo_ray.prompts.loading import load_prompt_records
    from maskgrpo_ray.weights.hub import resolve_config

    models = _labels(args.weights)
    run_dirs = [Path(s) for _, s in models if (Path(s) / "config.yaml").is_file()]
    config = args.config or (run_dirs[0] / "config.yaml" if run_dirs else None)
    overrides = list(args.overrides)
    if args.samples_per_prompt is not None:
        overrides.append(f"eval.samples_per_prompt={args.samples_per_prompt}")
    overrides += adapter_overrides([s for _, s in models], config, overrides)
    cfg, _ = resolve_config(load_config(config, overrides))  # hub ids -> local folders
    check_diversity_spaces(cfg)  # reward.diversity_embedding names a component that embeds
    spec = args.prompts or cfg.data.eval_prompts or cfg.data.prompts
    prompts = load_prompt_records(spec, "eval", column=args.prompt_column or cfg.data.prompt_column)
    geneval_metadata(prompts, cfg)  # a tag on some lines only, or a bad metadata line: stop here
    specs = list(cfg.eval.metrics)
    for k, text in enumerate(args.metric):  # "kind=fid,weights=..." (CLI) or a dict (API)
        try:
            specs.append(MetricSpec(**(parse_metric(text) if isinstance(text, str) else text)))
        except ValueError as err:
            raise ValueError(f"--metric #{k + 1} {text!r}: {err}") from err
    labels = [ms.label for ms in specs]
    repeated = sorted({lab for lab in labels if labels.count(lab) > 1})
    if repeated:
        raise ValueError(
            f"eval.metrics / --metric: the labels {repeated} repeat; give each metric of the "
            "same kind its own name=..."
        )
    check_files(cfg, specs)
    sources = []
    for label, source in models:
        state, desc = resolve_weights(source, cfg, scratch)
        sources.append(ModelSource(label, desc, state))
    rows = None
    if run_dirs and (run_dirs[0] / "metrics.jsonl").is_file():
        lines = (run_dirs[0] / "metrics.jsonl").read_text().splitlines()
        rows = [json.loads(x) for x in lines if x.strip()]
    if args.out:
        out = Path(args.out)
    elif run_dirs:
        out = run_dirs[0] / "eval"
    else:
        out = Path("runs") / f"eval-{time.strftime('%Y%m%d-%H%M%S')}"
    return {
        "cfg": cfg,
        "prompts": prompts,
        "models": sources,
        "specs": specs,
        "rows": rows,
        "out": out,
        "backend": args.backend or cfg.run.backend,
        "actors": args.actors or cfg.rollout.num_actors,
    }


def print_tables(report: dict[str, Any]) -> None:
    """The per-model means (all prompts and per GenEval tag) as a plain table."""
    means: dict[str, dict[str, float]] = report["means"]
    labels = list(means)
    keys = sorted({k for m in means.values() for k in m})
    print("metric".ljust(32) + "".join(lab.rjust(12) for lab in labels))
    for key in keys:
        vals = [means[lab].get(key) for lab in labels]
        print(key.ljust(32) + "".join(("-" if v is None else f"{v:.4f}").rjust(12) for v in vals))


class EvalInputError(UserError, ValueError):
    """A bad ``maskgrpo eval`` input found before anything started (the cause is chained)."""


def evaluate(args: argparse.Namespace) -> tuple[dict[str, Any], Path]:
    """``maskgrpo eval``'s path (the Python API's ``evaluate`` too): every input checked by
    :func:`prepare` (a bad one raises :class:`EvalInputError`, nothing started), then
    :func:`~maskgrpo_ray.evaluation.runner.run_eval`. Returns the report and its folder."""
    from maskgrpo_ray.config import ConfigError
    from maskgrpo_ray.evaluation.runner import run_eval

    with tempfile.TemporaryDirectory(prefix="maskgrpo-eval-") as scratch:
        try:
            p = prepare(args, Path(scratch))
        except (ConfigError, ValueError, FileNotFoundError, KeyError) as err:
            raise EvalInputError(str(err)) from err
        log.info(
            "evaluating %s on %d prompts x %d samples -> %s",
            ", ".join(f"{m.label} ({m.source})" for m in p["models"]),
            len(p["prompts"].records),
            p["cfg"].eval.samples_per_prompt,
            p["out"],
        )
        report = run_eval(
            p["cfg"],
            p["prompts"],
            p["models"],
            p["out"],
            backend=p["backend"],
            actors=p["actors"],
            metric_specs=p["specs"],
            run_rows=p["rows"],
        )
    return report, p["out"]


def run(args: argparse.Namespace) -> int:
    """``maskgrpo eval``: 0 done, 2 bad input (nothing started)."""
    try:
        report, out = evaluate(args)
    except EvalInputError as err:
        print(f"maskgrpo: {err}", file=sys.stderr)
        return 2
    print_tables(report)
    print(f"report: {out / 'report.md'}")
    return 0
