"""Alarms that see collapse: every probe compared with the base's probe (docs/monitors.md).

The probe set is judged at step 0 twice, with the probe's own seeds (draw A, the seeds every later
probe uses) and with other seeds (draw B). Per probe prompt ``p`` the two draws give a
difference ``d_p = A_p - B_p`` of each figure (the prompt's mean over its samples); the base's
standard error of a probe figure is ``se = max(sd(d) / sqrt(P), 1 / (P * S))`` (P prompts, S
samples each: the second term is the figure's resolution, so two draws that happen to agree
leave a finite unit). ``sd(d) / sqrt(P)`` is the spread of the difference of two independent
probes; a later probe uses draw A's seeds, so its noise against A is smaller: the unit is
conservative. Every world calibrates itself: a judge in [0, 1], a CLIP logit, a 0-6 bit entropy.

Figures (``metrics.jsonl``, at probe steps): ``probe/<fig>`` (the probe's mean), at step 0 also
``probe/base_b/<fig>`` (draw B) and ``probe/se/<fig>`` (the unit), and at every probe
``probe/z/<fig>``: ``(probe - base) / se`` for the judge, the reward and the diversity;
``(probe - base) / spread`` for the image statistics, ``spread`` being the standard deviation
of the base's per-prompt means over both draws (the base's spread of that statistic across
prompts and draws). The alarms (``monitor/alarm/<name>``, 1.0 at a probe step where the rule
holds) are functions of those rows: :func:`probe_alarm_flags` for one probe,
:func:`replay_alarms` for a whole recorded run. One more rule reads the in-run evaluation
instead of the probe (:func:`eval_alarm_flags`: its diversity against the base evaluation's).

Pure functions on floats and on a run's rows; no torch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

JUDGE, REWARD, DIVERSITY, KL, ENTROPY = "judge", "reward", "diversity", "kl", "entropy"
IMAGE = ("colour_entropy", "dark", "saturated", "edges", "malformed")  # image/<name>
# the probe figure -> the evaluation's key (``evaluation.generation.summarize``)
EVAL_KEYS = {
    REWARD: "eval_reward",
    JUDGE: "eval_accuracy",
    DIVERSITY: "eval_diversity/pairwise",
    KL: "eval_kl",
    ENTROPY: "eval_entropy",
    **{name: f"eval_image/{name}" for name in IMAGE},
}
SE_FIGURES = (JUDGE, REWARD, DIVERSITY)  # compared in standard errors of the base
PROBE_ALARMS = ("judge_drop", "reward_drop", "diversity_loss", "probe_drift", "kl_excess")
EVAL_ALARMS = ("eval_diversity_loss",)  # rules on the in-run evaluation (eval.every_steps)
ALL_ALARMS = ("hacking", "probe_hacking", "drift", *PROBE_ALARMS, *EVAL_ALARMS)  # every alarm
ALARM = "monitor/alarm/"
BASE_B, SE, Z = "probe/base_b/", "probe/se/", "probe/z/"
EVAL_KEPT = "monitor/eval_diversity_kept"  # the evaluation's diversity / the base evaluation's


@dataclass(frozen=True)
class ProbeRules:
    """The probe alarms' thresholds (``logging.monitors``; docs/monitors.md)."""

    judge_drop_se: float = 3.0  # judge below base by more than this many base se
    reward_drop_se: float = 3.0  # reward below base by more than this many base se
    diversity_share: float = 0.75  # diversity below this share of the base's ...
    diversity_drop_se: float = 2.0  # ... and below it by more than this many base se
    drift_z: float = 2.5  # |image statistic - base| beyond this many base spreads
    kl_share: float = 1.75  # KL to the base above this share of the base's entropy per token
    persist_probes: int = 2  # consecutive probes a rule must hold to trip
    eval_diversity_share: float = 0.8  # the evaluation's diversity below this share of the base's


# --------------------------------------------------------------------------- the base


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs)


def _sd(xs: Sequence[float]) -> float:
    """Sample standard deviation (n - 1); NaN with fewer than two values."""
    if len(xs) < 2:
        return math.nan
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def per_prompt(out: Mapping[str, float], labels: Sequence[str | None], key: str) -> list[float]:
    """``key``'s value per probe prompt from an evaluation summarised with one tag per prompt
    (``out[f"{key}/{label}"]``), NaN where missing."""
    return [float(out.get(f"{key}/{label}", math.nan)) for label in labels]


def base_figures(
    draw_a: Mapping[str, Sequence[float]], draw_b: Mapping[str, Sequence[float]], samples: int
) -> dict[str, float]:
    """Step 0's calibration from the two draws' per-prompt values (figure -> ``[P]``, same
    prompt order): ``probe/<fig>`` (draw A's mean), ``probe/base_b/<fig>``, ``probe/se/<fig>``
    (:data:`SE_FIGURES` and KL: the difference's standard error; image statistics: their spread
    over the prompts of both draws; either at least ``1 / (P * S)``, the figure's resolution).
    A figure with fewer than two finite prompt pairs has no unit (left out)."""
    out: dict[str, float] = {}
    for fig, a in draw_a.items():
        b = draw_b.get(fig, [])
        pairs = [(x, y) for x, y in zip(a, b, strict=False) if _finite(x) and _finite(y)]
        fa = [x for x in a if _finite(x)]
        if fa:
            out[f"probe/{fig}"] = _mean(fa)
        if len(pairs) < 2:
            continue
        out[BASE_B + fig] = _mean([y for _, y in pairs])
        n = len(pairs)
        if fig in IMAGE:
            spread = _sd([v for xy in pairs for v in xy])
        else:
            spread = _sd([x - y for x, y in pairs]) / math.sqrt(n)
        spread = max(spread, 1.0 / (n * samples))  # the figure's resolution, at least
        if math.isfinite(spread) and spread > 0:
            out[SE + fig] = spread
    return out


def _finite(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def base_row(rows: Sequence[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    """The row that holds the base's calibration (the first with a ``probe/se/*``)."""
    return next((r for r in rows if any(k.startswith(SE) for k in r)), None)


# --------------------------------------------------------------------------- the rules


def probe_z(row: Mapping[str, Any], base: Mapping[str, Any]) -> dict[str, float]:
    """``probe/z/<fig>`` of a probe ``row`` against the ``base`` row, for every figure both
    have with a unit (KL has none: it is 0 at the base by definition; it is logged, not
    scored)."""
    out: dict[str, float] = {}
    for key, se in base.items():
        if not key.startswith(SE) or not _finite(se) or se <= 0:
            continue
        fig = key[len(SE) :]
        now, then = row.get(f"probe/{fig}", math.nan), base.get(f"probe/{fig}", math.nan)
        if fig != KL and _finite(now) and _finite(then):
            out[Z + fig] = (float(now) - float(then)) / float(se)
    return out


def probe_rule_flags(
    row: Mapping[str, Any], base: Mapping[str, Any], rules: ProbeRules
) -> dict[str, float]:
    """Which probe rules hold at this probe (1.0 / 0.0, before persistence), from its
    ``probe/z/*`` and the base: ``judge_drop`` (the judge's z below ``-judge_drop_se``),
    ``reward_drop`` (the reward's below ``-reward_drop_se``), ``diversity_loss`` (the
    diversity below ``diversity_share`` of the base's and its z below ``-diversity_drop_se``),
    ``probe_drift`` (an image statistic's |z| beyond ``drift_z``), ``kl_excess`` (the KL to the
    base per token above ``kl_share`` of the base's own entropy per token, both in nats: the
    policy has moved that share of its base's uncertainty away). A rule whose figure is absent
    is left out."""
    z = {k[len(Z) :]: float(v) for k, v in row.items() if k.startswith(Z) and _finite(v)}
    out: dict[str, float] = {}
    if JUDGE in z:
        out["judge_drop"] = float(z[JUDGE] < -rules.judge_drop_se)
    if REWARD in z:
        out["reward_drop"] = float(z[REWARD] < -rules.reward_drop_se)
    div, div0 = row.get(f"probe/{DIVERSITY}", math.nan), base.get(f"probe/{DIVERSITY}", math.nan)
    if DIVERSITY in z and _finite(div) and _finite(div0):
        low = float(div) < rules.diversity_share * float(div0)
        out["diversity_loss"] = float(low and z[DIVERSITY] < -rules.diversity_drop_se)
    images = [abs(z[f]) for f in IMAGE if f in z]
    if images:
        out["probe_drift"] = float(max(images) > rules.drift_z)
    kl, h0 = row.get(f"probe/{KL}", math.nan), base.get(f"probe/{ENTROPY}", math.nan)
    if _finite(kl) and _finite(h0) and float(h0) > 0:
        out["kl_excess"] = float(float(kl) > rules.kl_share * float(h0))
    return out


def probe_alarm_flags(
    history: Sequence[Mapping[str, Any]], row: Mapping[str, Any], rules: ProbeRules
) -> dict[str, float]:
    """The probe figures and alarms of probe ``row`` after the run's earlier rows: its
    ``probe/z/*``, ``monitor/probe_rule/<name>`` (the rule at this probe) and
    ``monitor/alarm/<name>`` (the rule held at the last ``persist_probes`` probes). ``{}``
    at a row that is no probe or with no calibrated base; the base's own row gets its z (0)
    but no alarm."""
    if not _finite(row.get(f"probe/{REWARD}")):
        return {}
    base = base_row([*history, row])
    if base is None:
        return {}
    out = probe_z(row, base)
    if base is row:
        return out
    flags = probe_rule_flags({**row, **out}, base, rules)
    for name, flag in flags.items():
        out[f"monitor/probe_rule/{name}"] = flag
        earlier = [
            h[f"monitor/probe_rule/{name}"]
            for h in history
            if _finite(h.get(f"monitor/probe_rule/{name}"))
        ]
        held = [*earlier, flag][-rules.persist_probes :]
        out[ALARM + name] = float(len(held) == rules.persist_probes and all(held))
    return out


def eval_alarm_flags(
    row: Mapping[str, Any], base_eval: Mapping[str, Any], rules: ProbeRules
) -> dict[str, float]:
    """At an in-run evaluation (a row with ``eval_diversity/pairwise``): the share of the base
    evaluation's pairwise diversity it keeps (:data:`EVAL_KEPT`; ``base_eval``: the run's
    evaluation of its base model, same prompts and seeds) and ``eval_diversity_loss``, that
    share below ``eval_diversity_share`` (0: the rule off). Unlike the probe's 8 prompts, the
    evaluation's (``eval.prompts`` x ``eval.samples_per_prompt``) measure the diversity with
    little noise of their own, so the rule needs no standard error. ``{}`` at a row that is no
    evaluation or without the base's diversity."""
    now, then = row.get(EVAL_KEYS[DIVERSITY], math.nan), base_eval.get(EVAL_KEYS[DIVERSITY], 0)
    if not (_finite(now) and _finite(then)) or float(then) <= 0:
        return {}
    kept = float(now) / float(then)
    return {EVAL_KEPT: kept, ALARM + EVAL_ALARMS[0]: float(kept < rules.eval_diversity_share)}


def replay_alarms(
    rows: Sequence[Mapping[str, Any]],
    rules: ProbeRules | None = None,
    base_eval: Mapping[str, Any] | None = None,
) -> dict[str, int | None]:
    """The probe alarms' first steps over a recorded run (``metrics.jsonl``'s rows, any
    order) under ``rules`` (default: today's thresholds): the rules re-evaluated from the
    probes' raw figures and the base's calibration the rows hold, so thresholds can be
    checked against finished runs without running them again; with ``base_eval`` (the run's
    base evaluation, ``summary.json``'s), the evaluation's rules too. None: the alarm never
    trips."""
    rules = rules or ProbeRules()
    keep = (ALARM, "monitor/probe_rule/", Z)
    history: list[dict[str, Any]] = []
    first: dict[str, int | None] = dict.fromkeys((*PROBE_ALARMS, *EVAL_ALARMS))
    for r in sorted(rows, key=lambda r: int(r["step"])):
        flags = {} if base_eval is None else eval_alarm_flags(r, base_eval, rules)
        for name in EVAL_ALARMS:
            if flags.get(ALARM + name) == 1.0 and first[name] is None:
                first[name] = int(r["step"])
    probes = [r for r in rows if _finite(r.get(f"probe/{REWARD}"))]  # the rest carry no alarm
    for r in sorted(probes, key=lambda r: int(r["step"])):
        row = {k: v for k, v in r.items() if not k.startswith(keep)}
        row.update(probe_alarm_flags(history, row, rules))
        for name in PROBE_ALARMS:
            if row.get(ALARM + name) == 1.0 and first[name] is None:
                first[name] = int(row["step"])
        history.append(row)
    return first
