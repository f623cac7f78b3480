"""``maskgrpo eval``: generate with fixed seeds on every rollout actor, score, write the report.

Phases: check everything that can be checked before an actor starts (prompts and their
metadata, metric files, the weights of every model), then per model (base first): install the
weights on every generator, generate the evaluation units (``evaluation.generation``), write
each prompt's images in GenEval's folder layout, score them with the per-sample metrics, then
the set metrics (FID/KID); last, the base-vs-tuned report.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from maskgrpo_ray.algo.diversity import CEILING
from maskgrpo_ray.config import Config
from maskgrpo_ray.evaluation.generation import (
    EvalUnit,
    ceiling_counter,
    distinct_ceiling,
    generate_unit,
    make_units,
    unit_rewards,
)
from maskgrpo_ray.evaluation.geneval import check_geneval_folder, write_geneval_prompt
from maskgrpo_ray.evaluation.types import EvalSample, ModelEval
from maskgrpo_ray.evaluation.weights import BASE
from maskgrpo_ray.pipeline.messages import RolloutBatch
from maskgrpo_ray.pipeline.settings import EvalSettings, settings_from_config
from maskgrpo_ray.prompts.geneval_schema import GENEVAL_CLASSES, check_metadata
from maskgrpo_ray.prompts.loading import LoadedPrompts, PromptRecord

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelSource:
    """A model to evaluate: ``label`` in the report, ``state`` (None: the base weights)."""

    label: str
    source: str
    state: dict[str, torch.Tensor] | None


def geneval_metadata(prompts: LoadedPrompts, cfg: Config) -> list[dict[str, Any]] | None:
    """Every prompt's GenEval metadata when the prompts carry it (checked), else None.

    A prompts file for a model whose images the official evaluator scores (a kind with no world
    rule of its own) must name GenEval's 80 detector classes; a registered prompt set (the toy's
    and the shapes world's grammars) or a world model's prompts name the world's own classes.

    Raises ValueError when some prompts carry a ``tag`` and others do not, or a line is not
    GenEval metadata (naming the line, the field and the fix)."""
    from maskgrpo_ray.models.registry import get_model, get_prompt_set

    records = prompts.records
    tagged = [r for r in records if r.meta and "tag" in r.meta]
    if not tagged:
        return None
    world = get_model(cfg.model.kind, cfg.model.plugins).geneval_rule is not None
    classes = None if world or get_prompt_set(prompts.source) is not None else GENEVAL_CLASSES
    metas = []
    for r in records:
        meta = {**(r.meta or {}), "prompt": r.text}
        check_metadata(meta, r.source, classes)
        metas.append(meta)
    return metas


# ----------------------------------------------------------------------------- generators


class LocalGenerator:
    """One policy in this process."""

    def __init__(self, cfg: Config, settings: EvalSettings) -> None:
        from maskgrpo_ray.pipeline.build import build_policy

        self.settings = settings
        self.policy = build_policy(cfg.model).eval()
        self.base = {k: v.clone() for k, v in self.policy.state_dict().items()}
        self.actors = 1

    def load(self, state: dict[str, torch.Tensor] | None) -> None:
        self.policy.load_state_dict(self.base)
        if state is not None:
            unknown = set(state) - set(self.base)
            if unknown:
                raise KeyError(f"weights for tensors the model lacks: {sorted(unknown)[:5]}")
            self.policy.load_state_dict(state, strict=False)

    def rollouts(self, units: list[EvalUnit]) -> list[RolloutBatch]:
        return [generate_unit(self.policy, u, self.settings) for u in units]

    def shutdown(self) -> None:
        pass


class RayGenerator:
    """Rollout actors of the config's model on a local or remote Ray cluster; a lost actor is
    replaced (with the weights in use) and its unit re-run with the same seed."""

    def __init__(self, cfg: Config, actors: int, timeout_s: float = 600.0) -> None:
        import ray

        from maskgrpo_ray.actors.pool import rollout_pool
        from maskgrpo_ray.cluster.attach import connect

        self.timeout_s, self.actors = timeout_s, actors
        self.cluster = connect(cfg.run.ray_address, cfg.run.num_cpus, None)
        self.pool = rollout_pool(settings_from_config(cfg), timeout_s)
        self.pool.start(actors)
        self._state: Any = None
        self._version = 0
        self._ray = ray

    def _install(self, members: list[Any]) -> None:
        if self._state is not None:
            self._ray.get(
                [m.handle.load_weights.remote(self._state, self._version) for m in members],
                timeout=self.timeout_s,
            )

    def load(self, state: dict[str, torch.Tensor] | None) -> None:
        if state is None:
            if self._state is not None:
                raise ValueError("the base model must be evaluated first (it is, by default)")
            return
        self._state, self._version = self._ray.put(state), self._version + 1
        self._install(self.pool.members)

    def rollouts(self, units: list[EvalUnit]) -> list[RolloutBatch]:
        from maskgrpo_ray.backend.chunks import map_over_pool

        def heal(member: Any, why: str) -> Any:
            self.pool.drop(member, kill=why == "hung")
            fresh = self.pool.grow()
            self._install([fresh])
            return fresh

        return map_over_pool(
            self.pool, units, lambda h, u: h.eval_rollout.remote(u), self.timeout_s, heal=heal
        )

    def shutdown(self) -> None:
        from maskgrpo_ray.cluster.attach import disconnect

        self.pool.shutdown()
        disconnect(self.cluster)


# ----------------------------------------------------------------------------- scoring


SampleScorer = Callable[[RolloutBatch, list[str], list[dict[str, Any]] | None], dict]
"""``(rollout, prompt of each image, metadata of each image) -> {name: values [N]}``."""


def scorers(
    cfg: Config, metric_specs: Sequence[Any], metas_known: bool, device: torch.device
) -> dict[str, SampleScorer]:
    """Per-sample scorers: the run's training reward (``reward``, ``accuracy``, the diversity
    figures), GenEval's rule (``geneval``: when the model kind scores it on its images, e.g. the
    toy world's, and the prompts carry GenEval metadata), the ceiling of
    ``diversity/distinct`` (when the kind counts a prompt's correct images) and every
    per-sample metric spec."""
    from maskgrpo_ray.evaluation.metrics import build_sample_metric
    from maskgrpo_ray.models.registry import entry_for
    from maskgrpo_ray.pipeline.build import build_reward_from_settings

    settings = settings_from_config(cfg)
    reward = build_reward_from_settings(settings.reward, device)

    def training_reward(batch: RolloutBatch, prompts: list[str], metas: Any) -> dict:
        table = dict(zip(prompts, metas, strict=True)) if metas is not None else None
        return unit_rewards(reward, batch, table)  # a reward that reads metadata gets it

    out: dict[str, SampleScorer] = {"reward": training_reward}  # with the diversity figures
    geneval_rule = entry_for(cfg.model).geneval_rule
    if geneval_rule is not None and metas_known:
        rule = geneval_rule(cfg.model)

        def geneval(batch: RolloutBatch, prompts: list[str], metas: Any) -> dict:
            return rule(batch.images, metas)

        out["geneval"] = geneval
    elif cfg.eval.geneval is not None and metas_known:  # a real model: GenEval's scorer
        out["geneval"] = geneval_scorer(cfg.eval.geneval, device)
    count = ceiling_counter(cfg.model)
    if count is not None:  # the world knows each prompt's correct images: distinct's ceiling

        def ceiling(batch: RolloutBatch, prompts: list[str], metas: Any) -> dict:
            return {CEILING: distinct_ceiling(count, batch.prompts, batch.group_size)}

        out["ceiling"] = ceiling
    for spec in metric_specs:
        if spec.kind == "fid":
            continue
        metric = build_sample_metric(spec, device)

        def per_sample(batch: RolloutBatch, prompts: list[str], metas: Any, m=metric) -> dict:
            return {m.name: m(batch.images, prompts)}

        out[metric.name] = per_sample
    return out


def geneval_scorer(judge: Any, device: torch.device) -> SampleScorer:
    """``geneval``: GenEval's 0/1 correctness of each image from the in-process scorer
    (``eval.geneval``; :class:`maskgrpo_ray.rewards.geneval.GenEvalReward`), NaN where its
    metadata cannot be judged."""
    from maskgrpo_ray.rewards.geneval import GenEvalReward

    scorer = GenEvalReward(**judge.reward_args(), device=device)

    def geneval(batch: RolloutBatch, prompts: list[str], metas: Any) -> dict:
        return {"geneval": scorer.accuracy(batch.images, prompts, metas)}

    return geneval


# ----------------------------------------------------------------------------- the run


def evaluate_model(
    model: ModelSource,
    generator: LocalGenerator | RayGenerator,
    records: list[PromptRecord],
    metas: list[dict[str, Any]] | None,
    settings: EvalSettings,
    score: dict[str, SampleScorer],
    out: Path,
) -> ModelEval:
    """Generate, write and score every evaluation image of one model."""
    t0 = time.perf_counter()
    generator.load(model.state)
    units = make_units([r.text for r in records], settings)
    s = settings.samples_per_prompt
    wave = max(1, 2 * generator.actors)
    samples: list[EvalSample] = []
    root = out / model.label / "images"
    for w in range(0, len(units), wave):
        batch_units = units[w : w + wave]
        for unit, batch in zip(batch_units, generator.rollouts(batch_units), strict=True):
            images = batch.images
            prompts = [p for p in unit.prompts for _ in range(s)]
            unit_metas = None
            if metas is not None:
                unit_metas = [metas[i] for i in unit.prompt_indices for _ in range(s)]
            values: dict[str, torch.Tensor] = {}
            for fn in score.values():
                values.update(fn(batch, prompts, unit_metas))
            for k, i in enumerate(unit.prompt_indices):
                meta = metas[i] if metas is not None else {"prompt": records[i].text}
                paths = write_geneval_prompt(root, i, meta, images[k * s : (k + 1) * s])
                tag = meta.get("tag") if metas is not None else None
                for j, path in enumerate(paths):
                    row = k * s + j
                    samples.append(
                        EvalSample(
                            prompt_index=i,
                            sample_index=j,
                            prompt=records[i].text,
                            tag=tag,
                            scores={n: float(v[row]) for n, v in values.items()},
                            image_path=str(path.relative_to(out)),
                        )
                    )
    problems = check_geneval_folder(root, len(records), s) if metas is not None else []
    for p in problems:
        log.warning("GenEval layout: %s", p)
    seconds = time.perf_counter() - t0
    log.info("%s: %d images in %.1f s", model.label, len(samples), seconds)
    info = {"images": len(samples), "seconds": seconds, "geneval_layout_problems": problems}
    return ModelEval(model.label, model.source, samples, {}, info)


def set_metrics(me: ModelEval, out: Path, fids: dict[str, Any]) -> None:
    """FID/KID of a model's images (its folder) against each fid spec's reference folder;
    ``fids`` maps a label to its :class:`FidKid` (built once: reference features are kept)."""
    for name, fid in fids.items():
        figures = fid(out / me.label / "images")
        for k, v in figures.items():
            me.set_metrics[k if name == "fid" else f"{name}/{k}"] = float(v)


def publish(evals: Sequence[ModelEval]) -> dict[str, dict[str, float]]:
    """Per model, the mean of each per-sample metric over all prompts and per GenEval tag, and
    the set metrics; mirrored to ``maskgrpo_eval_metric`` (Ray dashboard) when Ray is up."""
    from maskgrpo_ray.cluster.ray_metrics import process_metrics

    table: dict[str, dict[str, float]] = {}
    for me in evals:
        flat: dict[str, float] = {}
        names = sorted({n for s in me.samples for n in s.scores})
        tags = sorted({s.tag for s in me.samples if s.tag is not None})
        for name in names:
            for tag in ["all", *tags]:
                vals = [
                    s.scores[name]
                    for s in me.samples
                    if (tag == "all" or s.tag == tag) and math.isfinite(s.scores[name])
                ]
                if vals:
                    key = name if tag == "all" else f"{name}/{tag}"
                    flat[key] = sum(vals) / len(vals)
        flat.update(me.set_metrics)
        table[me.label] = flat
    try:
        import ray

        if ray.is_initialized():
            metrics = process_metrics()
            for label, flat in table.items():
                for key, value in flat.items():
                    metric, _, tag = key.partition("/")
                    labels = {"metric": metric, "model": label, "tag": tag or "all"}
                    metrics.gauge("maskgrpo_eval_metric", value, labels)
    except ImportError:  # pragma: no cover - ray is a dependency
        pass
    return table


def run_eval(
    cfg: Config,
    prompts: LoadedPrompts,
    models: list[ModelSource],
    out: Path,
    *,
    backend: str,
    actors: int,
    metric_specs: Sequence[Any],
    run_rows: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Evaluate ``models`` (base first) on ``prompts``; write images, ``report.md`` and
    ``report.json`` under ``out``; returns the report's dict. Every input was checked by the
    caller (:func:`maskgrpo_ray.evaluation.cli.prepare`)."""
    from maskgrpo_ray.evaluation.fid import FidKid
    from maskgrpo_ray.evaluation.report import build_report
    from maskgrpo_ray.rewards.base import default_device

    out.mkdir(parents=True, exist_ok=True)
    settings = settings_from_config(cfg).eval
    metas = geneval_metadata(prompts, cfg)
    models = sorted(models, key=lambda m: m.source != BASE)
    generator: LocalGenerator | RayGenerator
    if backend == "local":
        generator = LocalGenerator(cfg, settings)
    else:
        generator = RayGenerator(cfg, actors)
    try:
        device = default_device(None)  # this process's GPU when it has one
        score = scorers(cfg, metric_specs, metas is not None, device)
        fids = {s.label: FidKid(s, device) for s in metric_specs if s.kind == "fid"}
        evals = []
        for model in models:
            me = evaluate_model(model, generator, prompts.records, metas, settings, score, out)
            set_metrics(me, out, fids)
            evals.append(me)
        table = publish(evals)
    finally:
        generator.shutdown()
    settings_info = {
        "samples_per_prompt": settings.samples_per_prompt,
        "unmasking_steps": settings.num_steps,
        "seed": settings.seed,
        "prompts_per_unit": settings.prompts_per_unit,
        "backend": backend,
        "actors": generator.actors,
        "prompts": len(prompts.records),
        "prompts_dropped": prompts.dropped,
    }
    report = build_report(
        out, evals, run_rows=run_rows, extra={"means": table, "settings": settings_info}
    )
    (out / "summary.json").write_text(json.dumps(report["means"], indent=2) + "\n")
    with open(out / "samples.jsonl", "w") as f:  # per image: its scores beside its file
        for me in evals:
            for s in me.samples:
                f.write(json.dumps({"model": me.label, **asdict(s)}) + "\n")
    return report
