"""Issue 53, item 4: the probe alarms' thresholds against the shapes sweep's finished runs, by
replaying the rules on the committed records (``bench/records``; no run is made here).

    .venv/bin/python -m bench.alarm_calibration [--markdown docs/alarm_calibration.md]

Every record of ``configs/shapes.yaml`` at 60 steps that was logged with the probe alarms (its
rows hold ``probe/se/*``, the base's two draws) is one run, *failed* or *healthy* by the sweep's
rule (``recipe_sweep.per_run``). For each threshold set of a small grid around today's
(``runlog.probe_alarms.ProbeRules``), :func:`~maskgrpo_ray.runlog.probe_alarms.replay_alarms`
re-evaluates the rules from the rows' raw probe figures: a failed run is *caught* when any alarm
trips before step 40, a healthy run is *falsely alarmed* when any trips at all. The table lists
today's rules first, then the grid's sets that catch the most failed runs with the fewest false
alarms (the Pareto front).
"""

from __future__ import annotations

import argparse
import itertools
import json
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from bench import recipe_sweep as rs
from bench import why_seeds_fail as why
from maskgrpo_ray.runlog.probe_alarms import ProbeRules, replay_alarms

GRID = {
    "judge_drop_se": (2.0, 2.5, 3.0, 4.0),
    "reward_drop_se": (2.0, 3.0, 4.0),
    "diversity_share": (0.75, 0.85),
    "drift_z": (2.5, 3.0, 4.0),
    "persist_probes": (1, 2),
}


def judged(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records logged with the probe alarms (their base drawn twice)."""
    return [r for r in records if any(k.startswith("probe/se/") for row in r["rows"] for k in row)]


def score(records: list[dict[str, Any]], rules: ProbeRules) -> dict[str, Any]:
    caught = false = n_failed = n_healthy = 0
    per_run = []
    for r in records:
        failed = bool(rs.per_run(r)["failed"])
        first = {k: v for k, v in replay_alarms(r["rows"], rules).items() if v is not None}
        timely = any(v < rs.ALARM_BY for v in first.values())
        n_failed += failed
        n_healthy += not failed
        caught += failed and timely
        false += (not failed) and bool(first)
        per_run.append(
            {"variant": r["variant"], "seed": r["seed"], "failed": failed, "alarms": first}
        )
    return {"rules": asdict(rules), "caught": caught, "failed": n_failed, "false": false,
            "healthy": n_healthy, "runs": per_run}  # fmt: skip


def calibrate(records: list[dict[str, Any]]) -> dict[str, Any]:
    today = score(records, ProbeRules())
    grid = []
    for values in itertools.product(*GRID.values()):
        rules = replace(ProbeRules(), **dict(zip(GRID, values, strict=True)))
        s = score(records, rules)
        grid.append({k: v for k, v in s.items() if k != "runs"})
    front = [
        g for g in grid
        if not any(h["caught"] >= g["caught"] and h["false"] <= g["false"]
                   and (h["caught"], h["false"]) != (g["caught"], g["false"]) for h in grid)
    ]  # fmt: skip
    uniq = {json.dumps([g["caught"], g["false"]]): g for g in front}  # one set per point
    return {
        "today": today,
        "front": sorted(uniq.values(), key=lambda g: (-g["caught"], g["false"])),
    }


def markdown(c: dict[str, Any]) -> str:
    t = c["today"]
    out = [
        f"Probe alarms replayed on the shapes sweep's judged runs (world: shapes, 60 steps): "
        f"{t['failed']} failed, {t['healthy']} healthy by the sweep's rule. Caught: a failed run "
        f"with an alarm before step {rs.ALARM_BY}; false: a healthy run with any alarm.",
        "",
        "| rules | judge se | reward se | diversity share | drift z | persist | caught | false |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, g in [("today", t), *[("front", g) for g in c["front"]]]:
        r = g["rules"]
        out.append(
            f"| {name} | {r['judge_drop_se']:g} | {r['reward_drop_se']:g} | "
            f"{r['diversity_share']:g} | {r['drift_z']:g} | {r['persist_probes']} | "
            f"{g['caught']}/{g['failed']} | {g['false']}/{g['healthy']} |"
        )
    out += ["", "Today's rules per run (alarm: first step):", ""]
    for x in t["runs"]:
        out.append(f"- {x['variant']} seed {x['seed']}: {'failed' if x['failed'] else 'healthy'}, "
                   f"{x['alarms'] or 'no alarm'}")  # fmt: skip
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default="bench/results_alarm_calibration.json")
    ap.add_argument("--markdown", default=None, help="also write the table here")
    a = ap.parse_args()
    c = calibrate(judged(why.shapes_records()))
    md = markdown(c)
    print(md)
    Path(a.out).write_text(json.dumps(c, indent=1) + "\n")
    if a.markdown:
        Path(a.markdown).write_text(md)


if __name__ == "__main__":
    main()
