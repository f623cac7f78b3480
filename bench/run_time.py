"""Where a lab run's time goes, read off the committed records (``bench/records``).

    .venv/bin/python -m bench.run_time [--steps 60] [--config configs/shapes.yaml]
        [--markdown FILE]

Every record of ``bench/toy_lab.py`` keeps its wall time and, per training step, the rollout's
seconds (``generate_seconds``), the learner's (``update_seconds``) and the whole step's
(``step_seconds``: also reward, filter re-sampling, the monitors' rules and logging), the base
model's held-out evaluation (``base_eval_seconds``: near 0 where ``eval.reuse_base_evaluation``
found it kept) and the final one. What the record does not time is the rest: start-up (the
world, the models) and, in records made before the lab kept their seconds
(``in_run_eval_seconds``, ``probe_seconds``: "-" in the table), the in-run evaluations
(``eval.every_steps``) and the monitors' probes (``logging.monitors.probe_every_steps``; step 0
draws the base twice).

Per recipe (the record's ``variant``, by today's name where the recipe sweep knows its key) and base evaluation (run or reused): the median of
each part over its runs, and each part's share of the wall time. The runs were timed under the
batch's load (two at a time on this 2-core machine, one torch thread each): the shares are what a
batch pays, not a quiet machine's.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

from bench import recipe_sweep as rs
from bench import toy_lab as lab

PARTS = (
    "generate",
    "update",
    "step other",
    "base eval",
    "in-run evals",
    "probes",
    "final eval",
    "rest",
)
REUSED_BELOW = 1.0  # seconds: a base evaluation this short was read back, not run


def parts(r: dict) -> dict[str, float]:
    """A record's wall seconds split into :data:`PARTS` (see the module doc)."""
    n = r["steps"]
    steps = n * r["step_seconds"]
    gen, upd = n * r["generate_seconds"], n * r["update_seconds"]
    base, final = r.get("base_eval_seconds") or 0.0, r.get("final_eval_seconds") or 0.0
    # timed in records made since the lab kept them (NaN before: then inside "rest")
    evals, probes = r.get("in_run_eval_seconds", math.nan), r.get("probe_seconds", math.nan)
    timed = (evals if math.isfinite(evals) else 0.0) + (probes if math.isfinite(probes) else 0.0)
    return {
        "wall": r["wall_seconds"],
        "generate": gen,
        "update": upd,
        "step other": max(steps - gen - upd, 0.0),
        "base eval": base,
        "in-run evals": evals,
        "probes": probes,
        "final eval": final,
        "rest": r["wall_seconds"] - steps - base - final - timed,
    }


def name(r: dict) -> str:
    """The recipe a record ran, by today's names (``recipe_sweep.label``: a run of the default
    before it moved reads "lr 5e-4 (first default)")."""
    return rs.label(r) if r.get("config") == rs.CONFIG else r["variant"]


def table(records: Iterable[dict]) -> list[dict]:
    """One row per (variant, base evaluation run or reused): ``runs`` and each part's median."""
    groups: dict[tuple[str, bool], list[dict[str, float]]] = defaultdict(list)
    for r in records:
        if "generate_seconds" not in r or "wall_seconds" not in r:
            continue  # a record from before the lab timed its parts
        reused = r.get("base_eval_reused")  # recorded since the lab kept it, else inferred
        if reused is None:
            reused = (r.get("base_eval_seconds") or 0.0) < REUSED_BELOW
        groups[(name(r), reused)].append(parts(r))
    rows = []
    for (variant, reused), ps in sorted(groups.items()):
        row: dict = {
            "variant": variant,
            "base_eval": "reused" if reused else "run",
            "runs": len(ps),
        }
        for k in ("wall", *PARTS):
            xs = [p[k] for p in ps if math.isfinite(p[k])]
            row[k] = statistics.median(xs) if xs else math.nan
        rows.append(row)
    return rows


def markdown(rows: list[dict]) -> str:
    out = [
        "Median seconds per run (share of the wall time), from the lab's records; two runs at a "
        "time on the 2-core machine.\n",
        "| recipe | base eval | runs | wall s | " + " | ".join(PARTS) + " |",
        "|---" * (len(PARTS) + 4) + "|",
    ]
    for r in rows:
        cells = [
            f"{r[k]:.0f} ({r[k] / r['wall']:.0%})" if math.isfinite(r[k]) else "-" for k in PARTS
        ]
        out.append(
            f"| {r['variant']} | {r['base_eval']} | {r['runs']} | {r['wall']:.0f} | "
            + " | ".join(cells)
            + " |"
        )
    return "\n".join(out) + "\n"


def load(steps: int, config: str, cache: Path = lab.CACHE) -> list[dict]:
    """The records of ``steps``-step runs of ``config``, each with its ``key`` (its file's name)."""
    recs = [{**json.loads(p.read_text()), "key": p.stem} for p in sorted(cache.glob("*.json"))]
    return [r for r in recs if r.get("steps") == steps and r.get("config") == config]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--config", default="configs/shapes.yaml")
    ap.add_argument("--markdown", default="")
    a = ap.parse_args()
    md = markdown(table(load(a.steps, a.config)))
    print(md)
    if a.markdown:
        Path(a.markdown).write_text(md)


if __name__ == "__main__":
    main()
