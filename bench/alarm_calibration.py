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

The ``kl_excess`` rule measures the probe's KL to the base in the base's own entropy per token
(``probe/entropy`` at step 0), which runs log since it was added; records made before lack it.
For those, the replay takes the base's entropy on the record's seed from
``--base-entropy`` (``bench/results_base_entropy.json``), measured by the same step-0 probe of
the shipped config on that seed (``--measure-base-entropy 0-4,10-19``: a one-step run per seed,
about two minutes each) and says how many records it filled. The transition and guidance of a
record's own recipe are not applied there (the shipped default's are): for a recipe that
changes the trained likelihood (p_theta2) the filled value is the default's.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import subprocess
import sys
import tempfile
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from bench import recipe_sweep as rs
from bench import toy_lab as lab
from bench import why_seeds_fail as why
from maskgrpo_ray.runlog.probe_alarms import (
    EVAL_ALARMS,
    EVAL_KEYS,
    PROBE_ALARMS,
    ProbeRules,
    Z,
    base_row,
    probe_z,
    replay_alarms,
)

GRID = {
    "judge_drop_se": (2.0, 2.5, 3.0, 4.0, 5.0),
    "reward_drop_se": (2.0, 3.0, 4.0, 5.0),
    "diversity_share": (0.0, 0.75, 0.85),  # 0: the probe's rule off
    "eval_diversity_share": (0.0, 0.75, 0.8, 0.85),  # 0: the evaluation's rule off
    "drift_z": (2.5, 4.0),
    "kl_share": (1.0, 1.5, 1.75, 2.0, 3.0, 1e9),  # 1e9: the rule off
    "persist_probes": (1, 2),
}
BASE_ENTROPY = "bench/results_base_entropy.json"
EVAL_DIV = EVAL_KEYS["diversity"]  # the in-run evaluation's figure eval_diversity_loss reads
READ = ("step", EVAL_DIV)
# How clear a run's verdict is, fixed before looking at the alarms: a clear failure fails by more
# than its measurement's noise (recipe_sweep.failed_clearly: two standard errors below its base
# on the judge or the learned reward, or the diversity two of its own noise below the 75% line); a
# clear success gains at least one standard error, its reward does not fall and its diversity is
# two of its noise above the line. The rest sit within the verdict's own noise of the line.
CLEAR_GAIN_SE = 1.0
PROBE_STEPS = (10, 20, 30, 40, 50)  # the shapes config's probes after the base (every 10 steps)
CLASSES = ("clear failure", "borderline failure", "borderline healthy", "clear healthy")


def measure_base_entropy(seeds: list[int]) -> dict[str, Any]:
    """The shipped shapes config's step-0 probe on each seed (a one-step run with the lab's
    settings, ``toy_lab.COMMON``): the base's entropy per token, both draws."""
    out: dict[str, Any] = {"config": rs.CONFIG, "figure": "probe/entropy (draw A), nats per token",
                           "seeds": {}}  # fmt: skip
    for seed in seeds:
        with tempfile.TemporaryDirectory() as d:
            over = [*lab.COMMON, f"run.seed={seed}", "train.steps=1"]
            argv = [sys.executable, "-m", "maskgrpo_ray.cli", "train", "--config", rs.CONFIG,
                    "--run-dir", d, *[a for o in over for a in ("--set", o)]]  # fmt: skip
            subprocess.run(argv, check=True, capture_output=True)
            row = json.loads((Path(d) / "metrics.jsonl").read_text().splitlines()[0])
        out["seeds"][str(seed)] = {"a": row["probe/entropy"], "b": row["probe/base_b/entropy"]}
        print(f"seed {seed}: base entropy {row['probe/entropy']:.4f} nats per token", flush=True)
    return out


def with_base_entropy(records: list[dict[str, Any]], table: dict[str, Any]) -> int:
    """Fill ``probe/entropy`` into the base row of each record that lacks it, from ``table``
    (:func:`measure_base_entropy`'s) on the record's seed; how many were filled."""
    filled = 0
    for r in records:
        base = next((row for row in r["rows"] if any(k.startswith("probe/se/") for k in row)), None)
        got = table.get("seeds", {}).get(str(r["seed"]))
        if base is not None and "probe/entropy" not in base and got is not None:
            base["probe/entropy"] = got["a"]
            filled += 1
    return filled


def judged(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records logged with the probe alarms (their base drawn twice)."""
    return [r for r in records if any(k.startswith("probe/se/") for row in r["rows"] for k in row)]


def clarity(x: dict[str, Any], noise: float) -> str:
    """One of :data:`CLASSES` for a run's verdict figures (``recipe_sweep.per_run``); ``noise``:
    the diversity's (``recipe_sweep.diversity_noise``)."""
    if rs.failed_clearly(x, noise):
        return CLASSES[0]
    if x["failed"]:
        return CLASSES[1]
    if (
        x["gain"] >= CLEAR_GAIN_SE * x["gain_se"]
        and x["reward_change"] >= 0
        and x["diversity_kept"] >= rs.diversity_band(noise)[1]
    ):
        return CLASSES[3]
    return CLASSES[2]


def by_clarity(runs: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """Per class of :func:`clarity`: runs, those with an alarm before ``ALARM_BY``, with any."""
    out = {c: {"runs": 0, "timely": 0, "any": 0} for c in CLASSES}
    for x in runs:
        o = out[x["clarity"]]
        o["runs"] += 1
        o["timely"] += any(v < rs.ALARM_BY for v in x["alarms"].values())
        o["any"] += bool(x["alarms"])
    return out


def score(
    records: list[dict[str, Any]], rules: ProbeRules, noise: float = math.nan
) -> dict[str, Any]:
    """Today's or a grid's ``rules`` replayed on ``records``: failed runs caught in time, healthy
    runs alarmed, and every run's verdict class (:func:`clarity`, with the diversity's
    ``noise``)."""
    caught = false = n_failed = n_healthy = 0
    per_run = []
    for r in records:
        verdict = rs.per_run(r)
        failed = bool(verdict["failed"])
        replay = replay_alarms(_probe_rows(r), rules, r.get("base"))
        first = {k: v for k, v in replay.items() if v is not None}
        timely = any(v < rs.ALARM_BY for v in first.values())
        n_failed += failed
        n_healthy += not failed
        caught += failed and timely
        false += (not failed) and bool(first)
        per_run.append({"variant": r["variant"], "seed": r["seed"], "failed": failed,
                        "clarity": clarity(verdict, noise), "alarms": first})  # fmt: skip
    return {"rules": asdict(rules), "caught": caught, "failed": n_failed, "false": false,
            "healthy": n_healthy, "runs": per_run}  # fmt: skip


def _probe_rows(r: dict[str, Any]) -> list[dict[str, Any]]:
    """The record's probe and evaluation rows with only what the rules read (step,
    ``probe/*``, the evaluation's diversity), kept on the record: the grid replays each run a
    few thousand times."""
    if "_probe_rows" not in r:
        r["_probe_rows"] = [
            {k: v for k, v in row.items() if k in READ or k.startswith("probe/")}
            for row in r["rows"]
            if any(isinstance(row.get(k), int | float) for k in ("probe/reward", EVAL_DIV))
        ]
    return r["_probe_rows"]


def _brief(s: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in s.items() if k != "runs"}


def calibrate(
    records: list[dict[str, Any]], confirm: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """Today's rules and the grid's Pareto front on ``records``; with ``confirm`` (other
    seeds' runs), every row scored on those too (``row["confirm"]``)."""
    noise = rs.diversity_noise([*records, *(confirm or [])])[0]
    today = score(records, ProbeRules(), noise)
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
    out: dict[str, Any] = {
        "today": today,
        "front": sorted(uniq.values(), key=lambda g: (-g["caught"], g["false"])),
    }
    out["alone"] = alone(today["runs"])
    out["clarity"] = by_clarity(today["runs"])
    out["diversity_noise"] = noise
    out["separability"] = separability(records, PROBE_STEPS)
    if confirm is not None:
        out["confirm_today"] = score(confirm, ProbeRules(), noise)
        today["confirm"] = _brief(out["confirm_today"])
        out["confirm_alone"] = alone(out["confirm_today"]["runs"])
        out["confirm_clarity"] = by_clarity(out["confirm_today"]["runs"])
        for g in out["front"]:
            g["confirm"] = _brief(score(confirm, ProbeRules(**g["rules"])))
        held = [youden(score(confirm, ProbeRules(**g["rules"]))) for g in grid]
        out["confirm_separability"] = separability(confirm, PROBE_STEPS)
        out["transfer"] = {"sets": len(grid), "r": pearson([youden(g) for g in grid], held)}
    return out


SEPARATE = ("judge", "reward", "diversity", "kl")  # the probe figures :func:`separability` ranks
# the in-run evaluation's (the final's prompts and seeds, 40 prompts; the sweep's runs evaluate
# every 20 steps): the judge's gain, the learned reward's change, log(diversity kept)
EVAL_SEPARATE = {"eval judge": "eval_accuracy/tag_mean", "eval reward": "eval_reward",
                 "eval diversity": "eval_diversity/pairwise"}  # fmt: skip
EVAL_STEPS = (20, 40)


def early_signal(r: dict[str, Any], step: int) -> dict[str, float]:
    """A run's probe at ``step`` in the rules' own units: the judge's, the reward's and the
    diversity's z against the base, and the KL to the base in the base's entropy per token
    (sign turned so that, like the z's, lower is worse); ``{}`` where no probe ran then."""
    rows = _probe_rows(r)
    base = base_row(rows)
    row = next((x for x in rows if x.get("step") == step), None)
    if base is None or row is None or row is base:
        return {}
    z = probe_z(row, base)
    out = {f: z[Z + f] for f in SEPARATE if Z + f in z}
    kl, h0 = row.get("probe/kl"), base.get("probe/entropy")
    if isinstance(kl, int | float) and isinstance(h0, int | float) and h0 > 0:
        out["kl"] = -float(kl) / float(h0)
    return {k: v for k, v in out.items() if math.isfinite(v)}


def eval_signal(r: dict[str, Any], step: int) -> dict[str, float]:
    """A run's in-run evaluation at ``step`` against its base (:data:`EVAL_SEPARATE`), lower
    worse; ``{}`` where it did not evaluate then."""
    curve = {int(c["step"]): c for c in r.get("curve", [])}
    if step not in curve or 0 not in curve:
        return {}
    now, base = curve[step], curve[0]
    out = {}
    for name, key in EVAL_SEPARATE.items():
        a, b = now.get(key), base.get(key)
        if isinstance(a, int | float) and isinstance(b, int | float):
            out[name] = math.log(a / b) if "diversity" in name and a > 0 < b else a - b
    return {k: v for k, v in out.items() if math.isfinite(v)}


def separability(records: list[dict[str, Any]], steps: tuple[int, ...]) -> dict[str, Any]:
    """How well each probe figure at each probe step tells the runs that end failed from those
    that end healthy, whatever the threshold (the AUC per figure and step: the chance that a
    failed run's figure is below a healthy run's, ties half): a rule that thresholds that figure
    there can only trade catches for false alarms along this ranking."""
    verdict = [(bool(rs.per_run(r)["failed"]), r) for r in records]
    out: dict[str, Any] = {}
    figs = [*SEPARATE, *EVAL_SEPARATE]
    for step in sorted({*steps, *EVAL_STEPS}):
        sig = [(y, {**early_signal(r, step), **eval_signal(r, step)}) for y, r in verdict]
        # why.auc(a, b): P(a > b); here P(a healthy run's figure > a failed run's)
        auc = {f: why.auc([s[f] for y, s in sig if not y and f in s],
                          [s[f] for y, s in sig if y and f in s]) for f in figs}  # fmt: skip
        out[str(step)] = {f: v for f, v in auc.items() if math.isfinite(v)}
    return out


def youden(s: dict[str, Any]) -> float:
    """Caught share minus false-alarm share: 1 a perfect alarm, 0 one that fires at random."""
    return s["caught"] / max(s["failed"], 1) - s["false"] / max(s["healthy"], 1)


def pearson(x: list[float], y: list[float]) -> float:
    mx, my = sum(x) / len(x), sum(y) / len(y)
    sxy = sum((a - mx) * (b - my) for a, b in zip(x, y, strict=True))
    sxx, syy = sum((a - mx) ** 2 for a in x), sum((b - my) ** 2 for b in y)
    return sxy / (sxx * syy) ** 0.5 if sxx > 0 and syy > 0 else float("nan")


def alone(runs: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """Each alarm on its own under the same rules: the failed runs it catches before step
    ``ALARM_BY`` and the healthy runs it fires on (``score``'s per-run first steps)."""
    out = {}
    for name in (*PROBE_ALARMS, *EVAL_ALARMS):
        caught = sum(x["failed"] and x["alarms"].get(name, 99) < rs.ALARM_BY for x in runs)
        false = sum(not x["failed"] and name in x["alarms"] for x in runs)
        out[name] = {"caught": caught, "false": false}
    return out


def clarity_lines(c: dict[str, Any]) -> list[str]:
    """Today's rules by how clear each run's verdict is (:func:`clarity`)."""
    sets = [("", c["clarity"])]
    if "confirm_clarity" in c:
        sets.append((", held out", c["confirm_clarity"]))
    sd = c.get("diversity_noise", math.nan)
    lost, kept = rs.diversity_band(sd)
    out = ["", (f"Today's rules by how clear the verdict is (clear failure: more than "
                f"{rs.NOISE_SE:g} standard errors below the base on the judge or the learned "
                f"reward, or under {lost:.1%} of the diversity, {rs.NOISE_SE:g} of its noise "
                f"({sd:.3f} in log(kept), from the base's two probe draws) below the 75% line; "
                f"clear healthy: a gain of at least {CLEAR_GAIN_SE:g} standard error, the reward "
                f"not falling, {kept:.1%} of the diversity kept; borderline: the rest, on either "
                f"side of the sweep's line). Runs with an alarm before step {rs.ALARM_BY} / with "
                "any alarm:"), "",
           "| verdict | " + " | ".join(f"runs{t} | alarm by {rs.ALARM_BY}{t} | any alarm{t}"
                                      for t, _ in sets) + " |",
           "|---|" + "---|---|---|" * len(sets)]  # fmt: skip
    for k in CLASSES:
        cells = [f"{d[k]['runs']} | {d[k]['timely']} | {d[k]['any']}" for _, d in sets]
        out.append(f"| {k} | " + " | ".join(cells) + " |")
    return out


def separability_lines(c: dict[str, Any]) -> list[str]:
    """:func:`separability`'s table: per step, each figure's AUC on the chosen seeds and,
    where there are any, the held-out ones."""
    sets = [("", c["separability"])]
    if "confirm_separability" in c:
        sets.append((", held out", c["confirm_separability"]))
    figs = [*SEPARATE, *EVAL_SEPARATE]
    out = ["", ("How well each probe figure tells a run that ends failed from one that ends "
                "healthy, whatever the threshold (AUC: the chance that a failed run's figure is "
                "worse than a healthy run's; 0.5 none, 1 always; KL in the base's entropy per "
                "token; eval: the run's own evaluation on the final's 40 prompts, every 20 "
                "steps). A threshold on one figure at one step can only trade catches for "
                "false alarms along this ranking:"), "",
           "| step | " + " | ".join(f"{f}{t}" for t, _ in sets for f in figs) + " |",
           "|---|" + "---|" * (len(figs) * len(sets))]  # fmt: skip
    for step in sets[0][1]:
        cells = [f"{d[step][f]:.2f}" if f in d[step] else "" for _, d in sets for f in figs]
        out.append(f"| {step} | " + " | ".join(cells) + " |")
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
    if c.get("entropy_filled"):
        out[0] += (f" {c['entropy_filled']} records predate the base's logged entropy: their "
                   f"kl_excess rule uses the base's entropy measured on their seed ({BASE_ENTROPY}).")  # fmt: skip
    head = ("| rules | judge se | reward se | diversity share | eval diversity share | drift z | "
            "KL share | persist | caught | false |")  # fmt: skip
    out += ["", head + (" caught, held out | false, held out |" if held else ""),
            "|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if held else "")]  # fmt: skip
    for name, g in [("today", t), *[("front", g) for g in c["front"]]]:
        r = g["rules"]
        kl = "off" if r["kl_share"] >= 1e8 else f"{r['kl_share']:g}"
        div, ev = (f"{r[k]:g}" if r[k] > 0 else "off"
                   for k in ("diversity_share", "eval_diversity_share"))  # fmt: skip
        row = (f"| {name} | {r['judge_drop_se']:g} | {r['reward_drop_se']:g} | {div} | {ev} | "
               f"{r['drift_z']:g} | {kl} | {r['persist_probes']} | "
               f"{g['caught']}/{g['failed']} | {g['false']}/{g['healthy']} |")  # fmt: skip
        if held:
            h = g["confirm"]
            row += f" {h['caught']}/{h['failed']} | {h['false']}/{h['healthy']} |"
        out.append(row)
    out += [
        "",
        "Each of today's rules on its own (caught, false"
        + ("; held out: caught, false):" if held else "):"),
        "",
    ]
    for name, a in c["alone"].items():
        line = f"- `{name}`: {a['caught']}/{t['failed']}, {a['false']}/{t['healthy']}"
        if held:
            h, ct = c["confirm_alone"][name], c["confirm_today"]
            line += f"; {h['caught']}/{ct['failed']}, {h['false']}/{ct['healthy']}"
        out.append(line)
    out += clarity_lines(c)
    if "transfer" in c:
        tr = c["transfer"]
        out += ["", f"Does a threshold set chosen on these seeds carry to the held-out ones? Over the "
                    f"grid's {tr['sets']} sets, the correlation of each set's caught share minus "
                    f"false-alarm share on the two seed sets is r = {tr['r']:+.2f}."]  # fmt: skip
    if "separability" in c:
        out += separability_lines(c)
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
    ap.add_argument("--base-entropy", default=BASE_ENTROPY, help="the base's entropy per seed")
    ap.add_argument("--measure-base-entropy", default="", help="seeds: measure it, write it, stop")
    a = ap.parse_args()
    if a.measure_base_entropy:
        table = measure_base_entropy(lab.seeds_of(a.measure_base_entropy))
        Path(a.base_entropy).write_text(json.dumps(table, indent=1) + "\n")
        return
    runs = judged(why.shapes_records())
    path = Path(a.base_entropy)
    filled = with_base_entropy(runs, json.loads(path.read_text())) if path.exists() else 0
    pick = set(lab.seeds_of(a.choose_seeds)) if a.choose_seeds else {r["seed"] for r in runs}
    hold = set(lab.seeds_of(a.confirm_seeds)) if a.confirm_seeds else None
    c = calibrate([r for r in runs if r["seed"] in pick],
                  None if hold is None else [r for r in runs if r["seed"] in hold])  # fmt: skip
    c["choose_seeds"], c["confirm_seeds"] = a.choose_seeds or "all", a.confirm_seeds
    c["entropy_filled"] = filled
    md = markdown(c)
    print(md)
    Path(a.out).write_text(json.dumps(c, indent=1) + "\n")
    if a.markdown:
        Path(a.markdown).write_text(md)


if __name__ == "__main__":
    main()
