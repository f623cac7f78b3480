"""Issue 53, item 1: what separates the shapes-world runs that fail from those that learn,
measured on the sweep's committed records (``bench/records``: no run is made here).

    .venv/bin/python -m bench.why_seeds_fail [--by 20] [--markdown docs/why_seeds_fail.md]

Every record of ``configs/shapes.yaml`` at 60 steps (any variant of ``bench/recipe_sweep.py``)
is one run. With ``--split gain`` (the default) a run *failed* when its judged gain is not
positive or it keeps under 75% of its base's pairwise diversity; with ``--split sweep`` by the
sweep's rule (``recipe_sweep.per_run``, which also fails a learned reward that falls); it
*learned* otherwise.
Per run, figures from its logged rows, each from the first ``--by`` steps only (what a monitor
could act on) or over the run where the name says so:

- ``update``: the peak learning rate; ``grad_norm`` (mean); ``adv/abs_mean``;
- ``groups``: the share of groups with near-zero reward std (``groups/near_zero_std_share``),
  the filter's threshold at step ``--by`` over its first value;
- ``reward``: the training reward's slope per step (least squares), the within-group rank
  agreement of the learned reward with the judge (``agreement/*``) early and its fall from
  steps 1-10 to the last 10 (over the run);
- ``probe``: KL to the base (``probe/kl``), the probe's z of diversity, judge and reward
  against the base's two draws (``probe/z/*``), at the last probe at or before ``--by``.

Per figure: its mean over the failed and over the learned runs and the AUC of telling them
apart (the share of (failed, learned) pairs the figure orders as failed > learned; 0.5: no
separation, 0 or 1: complete), listed by ``|AUC - 0.5|``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from bench import recipe_sweep as rs
from bench import toy_lab as lab

NAN = float("nan")


def _mean(rows: list[dict[str, Any]], key: str) -> float:
    xs = [float(r[key]) for r in rows if isinstance(r.get(key), int | float) and r[key] == r[key]]
    return statistics.fmean(xs) if xs else NAN


def _slope(ys: list[float]) -> float:
    n = len(ys)
    if n < 2:
        return NAN
    xm, ym = (n - 1) / 2, statistics.fmean(ys)
    sxx = sum((i - xm) ** 2 for i in range(n))
    return sum((i - xm) * (y - ym) for i, y in enumerate(ys)) / sxx


def _at(rows: list[dict[str, Any]], key: str, by: int) -> float:
    """The last logged value of ``key`` at a step <= ``by``."""
    vals = [r[key] for r in rows if r.get("step", 0) <= by and key in r]
    return float(vals[-1]) if vals else NAN


def figures(record: dict[str, Any], by: int) -> dict[str, float]:
    rows = sorted(record.get("rows", []), key=lambda r: r.get("step", 0))
    early = [r for r in rows if r.get("step", 0) < by]  # step 0 is the first update
    agree = next((k for r in rows for k in r if k.startswith("agreement/") and k != "agreement/mean"), "agreement/mean")  # fmt: skip
    thresholds = [r["filter_threshold"] for r in early if r.get("filter_threshold", 0) > 0]
    lr = max((float(r["learning_rate"]) for r in rows if "learning_rate" in r), default=NAN)
    first10 = [r for r in rows if r.get("step", 0) < 10]
    last10 = rows[-10:]
    return {
        "update/learning_rate": lr,
        "update/grad_norm": _mean(early, "grad_norm"),
        "update/adv_abs_mean": _mean(early, "adv/abs_mean"),
        "groups/near_zero_std_share": _mean(early, "groups/near_zero_std_share"),
        "groups/filter_threshold_ratio": thresholds[-1] / thresholds[0] if thresholds else NAN,
        "reward/slope_per_step": _slope([float(r["reward_mean"]) for r in early if "reward_mean" in r]),
        "reward/agreement_early": _mean(first10, agree),
        "reward/agreement_fall_over_run": _mean(first10, agree) - _mean(last10, agree),
        "probe/kl": _at(rows, "probe/kl", by),
        "probe/z_diversity": _at(rows, "probe/z/diversity", by),
        "probe/z_judge": _at(rows, "probe/z/judge", by),
        "probe/z_reward": _at(rows, "probe/z/reward", by),
    }  # fmt: skip


def auc(failed: list[float], learned: list[float]) -> float:
    """P(failed > learned) over the pairs (ties count half); NaN values left out."""
    f = [x for x in failed if x == x]
    g = [x for x in learned if x == x]
    if not f or not g:
        return NAN
    wins = sum((a > b) + 0.5 * (a == b) for a in f for b in g)
    return wins / (len(f) * len(g))


def _finite_mean(xs: list[float]) -> float:
    ys = [x for x in xs if x == x]
    return statistics.fmean(ys) if ys else NAN


def shapes_records(steps: int = 60) -> list[dict[str, Any]]:
    out = []
    for p in sorted(lab.CACHE.glob("*.json")):
        r = json.loads(p.read_text())
        if r.get("config") == rs.CONFIG and r.get("steps") == steps and "final" in r:
            r["key"] = p.stem  # the record's file is named by its key
            r["variant"] = rs.label(r)  # today's name for what it ran
            out.append(r)
    return out


def analyse(records: list[dict[str, Any]], by: int, split: str = "gain") -> dict[str, Any]:
    runs = []
    for r in records:
        v = rs.per_run(r)
        failed = v["failed"] if split == "sweep" else v["gain"] <= 0 or v["diversity_kept"] < 0.75
        runs.append({"variant": r["variant"], "seed": r["seed"], "failed": bool(failed),
                     "gain": v["gain"], **figures(r, by)})  # fmt: skip
    names = [k for k in runs[0] if "/" in k] if runs else []
    sep = []
    for k in names:
        f = [x[k] for x in runs if x["failed"]]
        g = [x[k] for x in runs if not x["failed"]]
        sep.append({"figure": k, "failed_mean": _finite_mean(f), "learned_mean": _finite_mean(g),
                    "runs": sum(x == x for x in f + g), "auc": auc(f, g)})  # fmt: skip
    sep.sort(key=lambda s: -abs(s["auc"] - 0.5) if s["auc"] == s["auc"] else 0.0)
    return {"by": by, "split": split, "runs": runs, "separation": sep}


def markdown(a: dict[str, Any]) -> str:
    runs = a["runs"]
    nf = sum(bool(r["failed"]) for r in runs)
    out = [
        f"What separates failing shapes-world runs (world: shapes, 60 steps, {len(runs)} runs of "
        f"the sweep's records: {nf} failed, {len(runs) - nf} learned by the {a['split']} rule), "
        "figures from the first "
        f"{a['by']} steps unless named over the run. AUC: the share of (failed, learned) pairs "
        "ordered failed > learned (0.5: no separation).",
        "",
        "| figure | runs with it | failed (mean) | learned (mean) | AUC |",
        "|---|---|---|---|---|",
    ]
    for s in a["separation"]:
        out.append(
            f"| {s['figure']} | {s['runs']} | {s['failed_mean']:.4g} | {s['learned_mean']:.4g} | "
            f"{s['auc']:.2f} |"
        )
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--by", type=int, default=20, help="figures from the first BY steps")
    ap.add_argument("--split", choices=("gain", "sweep"), default="gain", help="what fails a run")
    ap.add_argument("--out", default="bench/results_why_seeds_fail.json")
    ap.add_argument("--markdown", default=None, help="also write the table here")
    a = ap.parse_args()
    result = analyse(shapes_records(), a.by, a.split)
    md = markdown(result)
    print(md)
    Path(a.out).write_text(json.dumps(result, indent=1, default=float) + "\n")
    if a.markdown:
        Path(a.markdown).write_text(md)


if __name__ == "__main__":
    main()
