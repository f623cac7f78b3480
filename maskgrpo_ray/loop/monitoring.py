"""The driver's monitors phase (``logging.monitors``; docs/monitors.md): the fixed probe set
judged before a step's update, the rules over the run's rows after it, one log line per alarm
that trips (``monitors.png``: ``RunLog.plot_reward_curve``, with the rules in
``RunLog.monitor_rules``).

The figures are functions of the rows ``metrics.jsonl`` holds (:mod:`maskgrpo_ray.runlog.monitors`),
so a resumed run, which keeps the rows before its checkpoint, computes what the run it continues
would have: no state of their own to checkpoint.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

from maskgrpo_ray.config import Config
from maskgrpo_ray.loop.executor import Executor
from maskgrpo_ray.loop.held_out import BaseDigest, evaluate_base
from maskgrpo_ray.runlog.monitors import MonitorRules, monitor_figures, newly_tripped
from maskgrpo_ray.runlog.probe_alarms import (
    EVAL_ALARMS,
    EVAL_KEPT,
    EVAL_KEYS,
    PROBE_ALARMS,
    ProbeRules,
    Z,
    base_figures,
    eval_alarm_flags,
    per_prompt,
    probe_alarm_flags,
)

log = logging.getLogger(__name__)

__all__ = ["Monitor", "probe_set"]


def probe_set(
    prompts: Sequence[str], tags: Sequence[str | None] | None, n: int
) -> tuple[list[str], list[str | None] | None]:
    """The fixed probe set: ``n`` held-out prompts, the first of each GenEval tag in turn (tags
    in order of first appearance), then the next of each, ...; without tags the first ``n``."""
    if tags is None or all(t is None for t in tags):
        return list(prompts[:n]), None
    order: dict[str | None, list[int]] = {}
    for i, t in enumerate(tags):
        order.setdefault(t, []).append(i)
    picked: list[int] = []
    depth = 0
    while len(picked) < min(n, len(prompts)):
        for idx in order.values():
            if depth < len(idx) and len(picked) < n:
                picked.append(idx[depth])
        depth += 1
    return [prompts[i] for i in picked], [tags[i] for i in picked]


class Monitor:
    """The monitors of one run: its probe set, its rules, the alarms it has logged."""

    def __init__(
        self, cfg: Config, ex: Executor, eval_prompts: Any, digest: BaseDigest | None = None
    ) -> None:
        """``eval_prompts``: the run's held-out prompts, a list or a ``held_out.EvalSet`` (its
        ``prompts`` and their ``tags``); ``digest``: the run's base digest, shared with its
        held-out evaluation (its own otherwise)."""
        m = cfg.logging.monitors
        prompts = getattr(eval_prompts, "prompts", eval_prompts)
        tags = getattr(eval_prompts, "tags", None)
        self.cfg, self.ex = cfg, ex
        self.digest = digest if digest is not None else BaseDigest(ex.policy_state)
        self.tripped: list[str] = []
        self.rules = MonitorRules(
            window_steps=m.window_steps,
            probe_window=m.probe_window,
            reward_rise=m.reward_rise,
            judge_rise=m.judge_rise,
            persist_steps=m.persist_steps,
            baseline_steps=m.baseline_steps,
            entropy_drift_bits=m.entropy_drift_bits,
            share_drift=m.share_drift,
        )
        self.probe_rules = ProbeRules(
            judge_drop_se=m.judge_drop_se,
            reward_drop_se=m.reward_drop_se,
            diversity_share=m.diversity_share,
            diversity_drop_se=m.diversity_drop_se,
            drift_z=m.drift_z,
            kl_share=m.kl_share,
            persist_probes=m.persist_probes,
            eval_diversity_share=m.eval_diversity_share,
        )
        self.stop_on = set(m.stop_on)
        self.every = m.probe_every_steps if m.probe_prompts else 0
        self.prompts, self.tags = probe_set(prompts, tags, m.probe_prompts)
        self.unit, self.samples = cfg.eval.prompts_per_unit, cfg.eval.samples_per_prompt
        self.reused: bool | None = None  # the base's probe read back (None: not drawn here)

    def probe(self, step: int) -> dict[str, float]:
        """At a probe step (``step % probe_every_steps == 0``, before its update: step 0 is the
        base model): the fixed probe set under the evaluation's sampler and seeds,
        ``probe/<fig>`` (the mean of its prompts' means; ``probe/judge`` where the reward
        defines an accuracy, ``probe/kl`` where the backend holds the base) and, at step 0, a
        second draw with other seeds: the base's calibration (``runlog.probe_alarms``), kept
        and reused across runs with ``eval.reuse_base_evaluation`` (``held_out.key_of``)."""
        if not self.every or step % self.every or not self.prompts:
            return {}
        t0 = time.perf_counter()
        if step == 0:
            row, self.reused = evaluate_base(self.cfg, self.digest, lambda: self._draw(0), "probe")
        else:
            row = self._draw(step)
        row["time/monitor_probe"] = time.perf_counter() - t0
        return row

    def _draw(self, step: int) -> dict[str, float]:
        """The probe set under the evaluation's sampler: its figures (and at step 0 the second
        draw's standard errors)."""
        prompts, n = list(self.prompts), len(self.prompts)
        labels_a: list[str | None] = [f"a{i}" for i in range(n)]
        labels_b: list[str | None] = [f"b{i}" for i in range(n)]
        if step == 0 and n % self.unit == 0:  # draw B in the units after A's: other seeds
            out = self.ex.evaluate(prompts * 2, [*labels_a, *labels_b], probe=True)
            draw_b = {f: per_prompt(out, labels_b, key) for f, key in EVAL_KEYS.items()}
        else:
            out = self.ex.evaluate(prompts, list(labels_a), probe=True)
            draw_b = {}
            if step == 0:  # draw A's last unit is partial: draw B after a filler, on a boundary
                fill = (prompts * self.unit)[: (-n) % self.unit]
                labels: list[str | None] = [*labels_a, *(f"x{i}" for i in range(len(fill)))]
                labels += labels_b
                more = self.ex.evaluate([*prompts, *fill, *prompts], labels, probe=True)
                draw_b = {f: per_prompt(more, labels_b, key) for f, key in EVAL_KEYS.items()}
        draw_a = {f: per_prompt(out, labels_a, key) for f, key in EVAL_KEYS.items()}
        return base_figures(draw_a, draw_b, self.samples)

    def observe(
        self,
        rows: Sequence[Mapping[str, Any]],
        row: dict[str, Any],
        base_eval: Mapping[str, Any] | None = None,
    ) -> dict[str, float]:
        """The rules' figures for ``row`` after the run's earlier ``rows`` (``base_eval``: the
        base model's evaluation, for the rules on the in-run evaluation); a WARNING line for
        each alarm that trips here for the first time in the run."""
        t0 = time.perf_counter()
        history = sorted((r for r in rows if r.get("step", -1) < row["step"]), key=_step)
        figs = monitor_figures(history, row, self.rules)
        figs.update(probe_alarm_flags(history, {**row, **figs}, self.probe_rules))
        if base_eval is not None:
            figs.update(eval_alarm_flags(row, base_eval, self.probe_rules))
        self.tripped = newly_tripped(history, figs)
        for name in self.tripped:
            log.warning(
                "monitor alarm %r tripped at step %d: %s",
                name,
                row["step"],
                _why(name, {**row, **figs}),
            )
        figs["time/monitors"] = time.perf_counter() - t0
        return figs

    def stops(self) -> str | None:
        """The first alarm that tripped at the last observed step and that
        ``logging.monitors.stop_on`` names (the run then stops as if preempted), else None."""
        return next((a for a in self.tripped if a in self.stop_on), None)


def _step(r: Mapping[str, Any]) -> int:
    return int(r["step"])


def _why(name: str, figs: Mapping[str, float]) -> str:
    """The figures behind an alarm, for its log line (docs/monitors.md has the rules)."""
    if name in PROBE_ALARMS:
        z = ", ".join(f"{k.removeprefix(Z)} {v:+.2f}" for k, v in figs.items() if k.startswith(Z))
        kl = figs.get("probe/kl", math.nan)
        return (
            f"the probe moved from the base's probe (in the base's standard errors): {z}; "
            f"KL to the base {kl:.3f} nats per token"
        )
    if name in EVAL_ALARMS:
        kept = figs.get(EVAL_KEPT, math.nan)
        return (
            f"the in-run evaluation keeps {kept:.1%} of the base model's pairwise diversity "
            "(its samples are growing alike: diversity collapse)"
        )
    if name == "drift":
        parts = [
            f"{k.removeprefix('monitor/drift/')} {v:+.3f}"
            for k, v in figs.items()
            if k.startswith("monitor/drift/")
        ]
        return "image statistics moved from the first steps' values: " + ", ".join(parts)
    prefix = "monitor/probe_" if name == "probe_hacking" else "monitor/"
    r, j = figs.get(prefix + "reward_trend", math.nan), figs.get(prefix + "judge_trend", math.nan)
    return (
        f"the reward rose {r:+.2f} reward std over the window while the judge moved {j:+.3f} "
        "(reward hacking: the reward is paid for something the judge does not see)"
    )
