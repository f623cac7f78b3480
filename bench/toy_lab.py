"""The toy-world lab: seeded training runs, cached per (config, overrides, seed, steps), run in
parallel, and the statistics the benches print (means, 95% t-intervals, paired differences).

Used by ``bench/diversity_sweep.py`` (reward against diversity) and ``bench/learner_cost.py``
(the cheaper learner's instrument). A run is ``maskgrpo train`` on the single-process backend
(``run.backend=local``) with one torch thread, so two runs share two cores; its record holds the
base and final held-out evaluations (accuracy, reward, the three diversity figures), the
in-run evaluations (the held-out learning curve), the training reward per step, and the
learner's and the rollout's seconds per step. A record is written to
``bench/records/<key>.json`` (small JSON, committed to the repository: ``--commit`` commits each
one the moment its run ends, so a batch cut short resumes from the repository on any machine of
the same kind) the moment its run ends: a rerun with more seeds or variants runs only what is
missing (``--fresh`` ignores the records). The key hashes the resolved config's fields that
differ from the config schema's defaults (the file with its overrides, validated: seed and steps
included; a field added later at a default that keeps today's behaviour keeps every record) and
:data:`LAB_VERSION` (bump it when a change to the code, or to a schema default, changes what a
run learns).

A run is deterministic on one machine; another machine's float rounding takes the same seed
elsewhere, so figures are compared paired by seed *on one machine*, never across machines.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import logging
import math
import multiprocessing as mp
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import lab_records as records

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / "bench" / "records"  # committed: small JSON, one a finished run
LAB_VERSION = 2  # bump when a code change (or a schema default) changes what a seeded run learns

EVAL_KEYS = (
    "eval_accuracy",
    "eval_reward",
    "eval_diversity/distinct",
    "eval_diversity/pairwise",
    "eval_diversity/nn",
)
# one evaluation sampler for every variant, so variants are compared paired by seed
COMMON = [
    "run.backend=local",
    "logging.progress_bar=false",
    "logging.sample_grid_every_steps=0",
    "run.export_final_policy=false",
    "eval.gumbel_temperature=0.0",
    "eval.sampler=showo",
    # the base's evaluation once per seed (and base): a run reads it back (maskgrpo_ray/loop/
    # held_out.py; what a run learns is unchanged, so the field is not in the record's key)
    "eval.reuse_base_evaluation=true",
]
# settings that cannot change what a run learns or reports: left out of the record's key
NOT_IN_KEY = ("evidence", "eval.reuse_base_evaluation")

# two-sided 95% Student t quantiles by degrees of freedom
T975 = {
    1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262,
    10: 2.228, 11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110,
    18: 2.101, 19: 2.093, 20: 2.086, 23: 2.069, 31: 2.040,
}  # fmt: skip


@dataclass(frozen=True)
class Job:
    """One training run: a config file plus overrides, a seed and a step count."""

    variant: str
    overrides: tuple[str, ...]
    seed: int
    steps: int
    config: str = "configs/toy.yaml"  # relative to the repository root
    extra: tuple[str, ...] = field(default_factory=tuple)  # the bench's own settings

    def all_overrides(self) -> list[str]:
        return [
            *COMMON,
            f"run.seed={self.seed}",
            f"train.steps={self.steps}",
            *self.extra,
            *self.overrides,
        ]

    def resolved(self) -> dict[str, Any]:
        """The validated config the run trains with (every field, defaults included)."""
        from maskgrpo_ray.config import load_config

        cfg = load_config(ROOT / self.config, self.all_overrides())
        return cfg.model_dump(mode="json")

    def key(self) -> str:
        """The record's key: the resolved config's fields that differ from the schema's
        defaults (so a default moved from the YAML into an override, or the reverse, keeps its
        runs, and so does a field added later at a default that keeps today's behaviour; the
        ``evidence`` section, which cites a result and cannot change one, left out) and
        :data:`LAB_VERSION`."""
        resolved = self.resolved()
        resolved.pop("evidence", None)  # a config's citation cannot change what a run learns
        changed = records.non_default(resolved, records.schema_defaults())
        changed = {k: v for k, v in changed.items() if k not in NOT_IN_KEY}
        blob = json.dumps([LAB_VERSION, changed], sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:20]


def run_job(job: Job) -> dict[str, Any]:
    """One training run in this process (one torch thread): its record."""
    import torch

    from maskgrpo_ray.cli.app import run_train
    from maskgrpo_ray.config import load_config

    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)
    cfg = load_config(ROOT / job.config, job.all_overrides())
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        s = run_train(cfg, Path(d))
        wall = time.perf_counter() - t0
        rows = [json.loads(x) for x in (Path(d) / "metrics.jsonl").read_text().splitlines()]
    curve = [
        {"step": r["step"] + 1, **{k: r[k] for k in r if _eval_key(k)}}
        for r in rows
        if "eval_accuracy" in r
    ]
    steps = cfg.train.steps
    curve = [
        {"step": 0, **{k: v for k, v in s["base_eval"].items() if _eval_key(k)}},
        *curve,
        {"step": steps, **{k: v for k, v in s["final_eval"].items() if _eval_key(k)}},
    ]
    return {
        "variant": job.variant,
        "seed": job.seed,
        "steps": job.steps,
        "config": job.config,
        "overrides": list(job.overrides),
        "extra": list(job.extra),
        "base": {k: v for k, v in s["base_eval"].items() if _eval_key(k)},
        "final": {k: v for k, v in s["final_eval"].items() if _eval_key(k)},
        "curve": curve,
        "train_reward": [r.get("reward_mean") for r in rows],
        "train_accuracy": [r.get("accuracy") for r in rows],
        "train_distinct": [r.get("diversity/distinct") for r in rows],
        "wall_seconds": wall,
        "update_seconds": _mean(r.get("time/update") for r in rows),
        "generate_seconds": _mean(r.get("time/generate_score") for r in rows),
        "step_seconds": _mean(r.get("step_seconds") for r in rows),
        # the learner's model input rows per image and update (NaN in records made before it)
        "forward_passes_per_sample": _mean(r.get("forward_passes_per_sample") for r in rows),
        **{k: s.get(k) for k in ("base_eval_seconds", "base_eval_reused", "probe_reused")},
        # the in-run evaluations' and the monitors' probes' seconds, summed over the run
        "in_run_eval_seconds": _sum(r.get("time/eval") for r in rows),
        "probe_seconds": _sum(r.get("time/monitor_probe") for r in rows),
        "final_eval_seconds": s.get("final_eval_seconds"),
        "monitors": s.get("monitors"),  # each alarm's first step, where any fired
        # every step's numeric figures (timings and byte counts left out), so monitors and
        # alarm rules can be re-read and re-judged offline without running the run again
        "rows": [_slim(r) for r in rows],
    }


def _slim(row: dict[str, Any]) -> dict[str, float]:
    """A metrics row's finite numbers, 6 significant digits, without ``time/*`` and ``bytes/*``."""
    out: dict[str, float] = {}
    for k, v in row.items():
        if k.startswith(("time/", "bytes/")) or isinstance(v, bool):
            continue
        if isinstance(v, int | float) and math.isfinite(float(v)):
            out[k] = float(f"{float(v):.6g}")
    return out


def _eval_key(key: str) -> bool:
    """An evaluation figure the lab keeps: the EVAL_KEYS and their per-tag values
    (``eval_accuracy/<tag>``, ...), and the diversity ceiling where a world reports one."""
    return key.startswith(("eval_accuracy", "eval_reward", "eval_diversity"))


def _sum(xs: Iterable[Any]) -> float:
    return sum(float(x) for x in xs if x is not None and math.isfinite(float(x)))


def _mean(xs: Iterable[Any]) -> float:
    v = [float(x) for x in xs if x is not None and math.isfinite(float(x))]
    return statistics.fmean(v) if v else math.nan


def _cached(job: Job, cache: Path) -> dict[str, Any] | None:
    path = cache / f"{job.key()}.json"
    if path.exists():
        rec = json.loads(path.read_text())
        rec["variant"] = job.variant  # a variant may be renamed; its runs stay
        return rec
    return None


def _worker(job: Job) -> tuple[Job, dict[str, Any]]:
    return job, run_job(job)


def run_jobs(
    jobs: Sequence[Job],
    *,
    n_jobs: int = 2,
    cache: Path = CACHE,
    fresh: bool = False,
    on_done: Callable[[dict[str, Any], int, int], None] | None = None,
    commit: bool = False,
    recorded_only: bool = False,
) -> list[dict[str, Any]]:
    """Every job's record, from the records or run now (``n_jobs`` processes, spawn), in the
    order of ``jobs``. Each new record is written as soon as its run ends (and, with
    ``commit``, committed to the repository's current branch, that file alone).
    ``recorded_only``: run nothing, return the recorded ones (a batch's table so far)."""
    cache.mkdir(parents=True, exist_ok=True)
    found: dict[Job, dict[str, Any]] = {}
    if not fresh:
        for j in jobs:
            rec = _cached(j, cache)
            if rec is not None:
                found[j] = rec
    todo = [j for j in dict.fromkeys(jobs) if j not in found]
    print(f"{len(found)} of {len(found) + len(todo)} runs recorded; {len(todo)} to run", flush=True)
    if recorded_only:
        return [found[j] for j in jobs if j in found]
    if todo:
        _pretrain(todo)
        done = 0
        with mp.get_context("spawn").Pool(n_jobs, maxtasksperchild=1) as pool:
            for job, rec in pool.imap_unordered(_worker, todo):
                path = cache / f"{job.key()}.json"
                path.write_text(json.dumps(rec) + "\n")
                if commit:
                    records.commit_record(
                        ROOT, path, f"{job.variant}, seed {job.seed}, {job.steps} steps"
                    )
                found[job] = rec
                done += 1
                if on_done is not None:
                    on_done(rec, done, len(todo))
    return [found[j] for j in jobs]


def run_from_args(
    jobs: Sequence[Job],
    a: argparse.Namespace,
    on_done: Callable[[dict[str, Any], int, int], None] | None = None,
) -> list[dict[str, Any]]:
    """:func:`run_jobs` with the experiment's flags (:func:`experiment_parser`'s ``--jobs``,
    ``--fresh``, ``--commit``, ``--recorded-only``)."""
    return run_jobs(
        jobs,
        n_jobs=a.jobs,
        fresh=a.fresh,
        commit=a.commit,
        recorded_only=a.recorded_only,
        on_done=on_done,
    )


def _pretrain(jobs: Sequence[Job]) -> None:
    """Pre-train (or load) each distinct world's base model (and the world's own reward model,
    where it has one) once, before the workers race for the model cache."""
    from maskgrpo_ray.config import load_config
    from maskgrpo_ray.models.registry import prepare_model

    seen = set()
    for j in jobs:
        cfg = load_config(ROOT / j.config, j.all_overrides())
        spec = json.dumps(cfg.model.model_dump(mode="json"), sort_keys=True)
        if spec not in seen:
            seen.add(spec)
            prepare_model(cfg.model)


# ----------------------------------------------------------------------------- statistics


def interval(xs: Sequence[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95% t-interval (0 for one value)."""
    m = statistics.fmean(xs)
    if len(xs) < 2:
        return m, 0.0
    return m, t975(len(xs) - 1) * statistics.stdev(xs) / math.sqrt(len(xs))


def t975(df: int) -> float:
    """The two-sided 95% Student t quantile for ``df`` degrees of freedom (the next smaller
    tabulated one between table entries: a slightly wider interval; 1.96 past 31)."""
    if df > 31:
        return 1.96
    return T975[max(k for k in T975 if k <= df)]


def fmt_ci(xs: Sequence[float], digits: int = 3, signed: bool = False) -> str:
    """``mean [lo, hi]`` of the 95% t-interval."""
    return fmt_interval(interval(xs), signed, digits)


def fmt_interval(v: tuple[float, float], signed: bool = False, d: int = 3) -> str:
    """``mean [lo, hi]`` of a ``(mean, half-width)`` pair (:func:`interval`'s), ``d`` digits."""
    m, h = v
    f = f"{{:{'+' if signed else ''}.{d}f}}"
    return f"{f.format(m)} [{f.format(m - h)}, {f.format(m + h)}]"


def score_key(record: dict[str, Any]) -> str:
    """The held-out score of a run's record: GenEval's overall (the mean of the tags' accuracies,
    ``eval_accuracy/tag_mean``) where the evaluation prompts carry tags of unequal counts, else
    the accuracy over all images (``eval_accuracy``)."""
    return (
        "eval_accuracy/tag_mean" if "eval_accuracy/tag_mean" in record["final"] else "eval_accuracy"
    )


def score(record: dict[str, Any], when: str = "final") -> float:
    """The record's held-out score (:func:`score_key`) of the base or the final model."""
    return float(record[when][score_key(record)])


def auc(curve: Sequence[dict[str, Any]], key: str = "eval_accuracy") -> float:
    """The area under a held-out learning curve over the run's steps, divided by the steps:
    the curve's mean height (trapezoids between the evaluations, base and final included)."""
    pts = [(c["step"], c[key]) for c in curve if c.get(key) is not None]
    if len(pts) < 2:
        return math.nan
    area = sum((s1 - s0) * (y0 + y1) / 2 for (s0, y0), (s1, y1) in zip(pts, pts[1:]))
    return area / (pts[-1][0] - pts[0][0])


def paired(
    runs: Sequence[dict[str, Any]], variant: str, ref: str, figure: Callable[[dict], float]
) -> list[float]:
    """``figure(variant's run) - figure(ref's run)`` for every seed both have."""
    a = {r["seed"]: r for r in runs if r["variant"] == variant}
    b = {r["seed"]: r for r in runs if r["variant"] == ref}
    return [figure(a[s]) - figure(b[s]) for s in sorted(set(a) & set(b))]


def of(runs: Sequence[dict[str, Any]], variant: str) -> list[dict[str, Any]]:
    return sorted((r for r in runs if r["variant"] == variant), key=lambda r: r["seed"])


def seeds_of(spec: str) -> list[int]:
    """``--seeds`` of the lab's benches: ``0-7``, ``0,1,2`` or both (``0-4,10-12``)."""
    out: list[int] = []
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        a, _, b = part.partition("-")
        out += range(int(a), int(b or a) + 1)
    return out


def seeds_spec(seeds: Sequence[int]) -> str:
    """The shortest ``--seeds`` for ``seeds`` (:func:`seeds_of`'s inverse): runs of consecutive
    seeds as ranges, ``[0, 1, 2, 3, 4, 10, 11, 12]`` -> ``0-4,10-12``."""
    runs = [
        [s for _, s in g]
        for _, g in itertools.groupby(enumerate(sorted(seeds)), lambda x: x[1] - x[0])
    ]
    return ",".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)


def variants_of(spec: str, known: Sequence[str], reference: str) -> list[str]:
    """``--variants`` (names separated by ``;``, empty: all ``known``), the reference first when
    left out; an unknown name ends the bench in one line."""
    names = [v for v in spec.split(";") if v] or list(known)
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; choose from {list(known)}")
    return names if reference in names else [reference, *names]


# ----------------------------------------------------------------------------- the scripts' parts


def experiment_parser(doc: str, seeds: str, steps: int, results: str) -> argparse.ArgumentParser:
    """The flags every seeded experiment takes: ``--seeds``, ``--steps``, ``--variants``,
    ``--jobs``, ``--fresh`` (ignore cached runs), ``--out`` (default ``bench/RESULTS``),
    ``--markdown`` (write the table there too)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--seeds", default=seeds)
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--variants", default="", help="names separated by ';' (default: all)")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--fresh", action="store_true", help="ignore recorded runs")
    ap.add_argument(
        "--commit", action="store_true", help="commit each run's record as it lands (git)"
    )
    ap.add_argument(
        "--recorded-only", action="store_true", help="run nothing: the table of what is recorded"
    )
    ap.add_argument("--out", default=str(ROOT / "bench" / results))
    ap.add_argument("--markdown", default="")
    return ap


def seed_major_jobs(
    names: Sequence[str],
    variants: dict[str, Sequence[str]],
    seeds: Sequence[int],
    steps: int,
    config: str,
    extra: Sequence[str] = (),
) -> list[Job]:
    """Every (seed, variant) run, seed by seed (a sweep cut short has whole seeds: paired)."""
    return [
        Job(n, tuple(variants[n]), s, steps, config=config, extra=tuple(extra))
        for s in seeds
        for n in names
    ]


def write_results(
    out: str, record: dict, md: str, markdown: str = "", indent: int | None = 1
) -> None:
    """Print the table ``md``, write ``record`` to ``out`` (JSON) and ``md`` to ``markdown``."""
    print(md)
    Path(out).write_text(json.dumps(record, indent=indent) + "\n")
    if markdown:
        Path(markdown).write_text(md)


def progress(width: int, describe: Callable[[dict], str]) -> Callable[[dict, int, int], None]:
    """:func:`run_jobs`' ``on_done``: one line a finished run: its variant and seed,
    ``describe(run)``, its wall time, how many are done and the seconds since this call."""
    t0 = time.perf_counter()

    def done(r: dict, i: int, total: int) -> None:
        spent = time.perf_counter() - t0
        left = (total - i) * spent / i
        print(
            f"{r['variant']:{width}s} seed {r['seed']:3d}: {describe(r)} "
            f"({r['wall_seconds']:.0f} s) [{i}/{total}, {spent:.0f} s; {total - i} left, "
            f"~{left / 60:.0f} min]",
            flush=True,
        )

    return done
