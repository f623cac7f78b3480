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

With ``--choose-seeds`` (the sweep's 0-4) the front is chosen on those seeds' runs alone and every
row is also scored on ``--confirm-seeds`` (10-19), runs the choice never saw: a threshold set
is adopted only where it holds there.
"""

from __future__ import annotations

import argparse
import itertools
import json
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from bench import recipe_sweep as rs
from bench import toy_lab as lab
from bench import why_seeds_fail as why
from maskgrpo_ray.runlog.probe_alarms import ProbeRules, replay_alarms

GRID = {
    "judge_drop_se": (2.0, 2.5, 3.0, 4.0, 5.0),
    "reward_drop_se": (2.0, 3.0, 4.0, 5.0),
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


def _brief(s: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in s.items() if k != "runs"}


def calibrate(
    records: list[dict[str, Any]], confirm: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """Today's rules and the grid's Pareto front on ``records``; with ``confirm`` (other
    seeds' runs), every row scored on those too (``row["confirm"]``)."""
    today = score(records, ProbeRules())
    grid = []
    for values in itertools.product(*GRID.values()):
        rules = replace(ProbeRules(), **dict(zip(GRID, values, strict=True)))
        grid.append(_brief(score(records, rules)))
    front = [
        g for g in grid
        if not any(h["caught"] >= g["caught"] and h["false"] <= g["false"]
                   and (h["caught"], h["false"]) != (g["caught"], g["false"]) for h in grid)
    ]  # fmt: skip
    uniq = {json.dumps([g["caught"], g["false"]]): g for g in front}  # one set per point
    out = {"today": today, "front": sorted(uniq.values(), key=lambda g: (-g["caught"], g["false"]))}
    if confirm is not None:
        out["confirm_today"] = score(confirm, ProbeRules())
        today["confirm"] = _brief(out["confirm_today"])
        for g in out["front"]:
            g["confirm"] = _brief(score(confirm, ProbeRules(**g["rules"])))
    return out


def markdown(c: dict[str, Any]) -> str:
    t = c["today"]
    held = "confirm_today" in c
    chosen = f", seeds {c['choose_seeds']}" if held else ""
    out = [
        f"Probe alarms replayed on the shapes sweep's judged runs (world: shapes, 60 "
        f"steps{chosen}): {t['failed']} failed, {t['healthy']} healthy by the sweep's rule. Caught: a "
        f"failed run with an alarm before step {rs.ALARM_BY}; false: a healthy run with any alarm.",
    ]
    if held:
        ct = c["confirm_today"]
        out[0] += (f" The front is chosen on those seeds; the last two columns score each row "
                   f"on seeds {c['confirm_seeds']} ({ct['failed']} failed, {ct['healthy']} "
                   f"healthy), which the choice never saw.")  # fmt: skip
    head = "| rules | judge se | reward se | diversity share | drift z | persist | caught | false |"
    out += ["", head + (" caught, held out | false, held out |" if held else ""),
            "|---|---|---|---|---|---|---|---|" + ("---|---|" if held else "")]  # fmt: skip
    for name, g in [("today", t), *[("front", g) for g in c["front"]]]:
        r = g["rules"]
        row = (f"| {name} | {r['judge_drop_se']:g} | {r['reward_drop_se']:g} | "
               f"{r['diversity_share']:g} | {r['drift_z']:g} | {r['persist_probes']} | "
               f"{g['caught']}/{g['failed']} | {g['false']}/{g['healthy']} |")  # fmt: skip
        if held:
            h = g["confirm"]
            row += f" {h['caught']}/{h['failed']} | {h['false']}/{h['healthy']} |"
        out.append(row)
    for title, runs in [("", t["runs"]), (" held out", c.get("confirm_today", {}).get("runs"))]:
        if runs is None:
            continue
        out += ["", f"Today's rules per run{title} (alarm: first step):", ""]
        for x in runs:
            out.append(f"- {x['variant']} seed {x['seed']}: "
                       f"{'failed' if x['failed'] else 'healthy'}, {x['alarms'] or 'no alarm'}")  # fmt: skip
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default="bench/results_alarm_calibration.json")
    ap.add_argument("--markdown", default=None, help="also write the table here")
    ap.add_argument("--choose-seeds", default="", help="choose the front on these seeds' runs")
    ap.add_argument("--confirm-seeds", default="", help="and score every row on these")
    a = ap.parse_args()
    runs = judged(why.shapes_records())
    pick = set(lab.seeds_of(a.choose_seeds)) if a.choose_seeds else {r["seed"] for r in runs}
    hold = set(lab.seeds_of(a.confirm_seeds)) if a.confirm_seeds else None
    c = calibrate([r for r in runs if r["seed"] in pick],
                  None if hold is None else [r for r in runs if r["seed"] in hold])  # fmt: skip
    c["choose_seeds"], c["confirm_seeds"] = a.choose_seeds or "all", a.confirm_seeds
    md = markdown(c)
    print(md)
    Path(a.out).write_text(json.dumps(c, indent=1) + "\n")
    if a.markdown:
        Path(a.markdown).write_text(md)


if __name__ == "__main__":
    main()
