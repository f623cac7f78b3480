"""The run's figures as Ray metrics (``ray.util.metrics``), for the dashboard's metrics view.

Every name starts with ``maskgrpo_``. Ray exports them on each node's metrics port, where
Prometheus scrapes them and the dashboard (with Grafana) plots them. The same figures also go
to ``metrics.jsonl``; this module only mirrors them. Metric objects are created lazily, once
per process, and never raise: a metrics failure must not stop training.
"""

from __future__ import annotations

import logging
import math
from typing import Any

log = logging.getLogger(__name__)

# seconds: 1 ms .. 5 min
LATENCY_BOUNDARIES = [0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300]

GAUGES = {
    "maskgrpo_policy_version": "learner policy version (updates applied)",
    "maskgrpo_accuracy": "share of the last step's generated samples (every group) the (rule) reward counts correct",
    "maskgrpo_accuracy_kept": "share of the last step's trained samples the (rule) reward counts correct",
    "maskgrpo_policy_version_lag": "learner version minus the version of the rollout behind the last batch",
    "maskgrpo_images_per_second": "generated images per second of step wall time",
    "maskgrpo_filter_drop_rate": "share of groups the std-history filter dropped (cumulative)",
    "maskgrpo_effective_groups": "groups trained in the last step (effective batch size, groups)",
    "maskgrpo_reward_mean": "mean reward of every group generated in the last step (finite values)",
    "maskgrpo_reward_mean_kept": "mean reward of the groups trained on in the last step",
    "maskgrpo_rollout_actors": "live rollout actors",
    "maskgrpo_queue_pending_chunks": "prompt chunks waiting for an idle rollout actor",
    "maskgrpo_queue_inflight_rollouts": "chunks being generated",
    "maskgrpo_queue_inflight_rewards": "chunks being scored",
    "maskgrpo_weight_bytes": "bytes moved per weight sync (per rollout actor); tag what: weights (full fine-tuning) or adapter (LoRA: the adapter only)",
    "maskgrpo_reward_actors": "live reward actors",
    "maskgrpo_learner_busy_fraction": "share of the last step's wall time the learner updated",
    "maskgrpo_step_bytes": "bytes one data-plane hop moved in the last step, by hop (rollouts, driver_received, driver_sent, learner_fetch)",
    "maskgrpo_driver_bytes_fraction": "the driver's data-plane bytes over the rollout bytes, last step",
    "maskgrpo_actor_recovery_seconds": "seconds the last actor replacement took (start + weights)",
    "maskgrpo_eval_reward": "mean training reward of the last held-out evaluation (fixed seeds)",
    "maskgrpo_eval_accuracy": "share of the last held-out evaluation's images the (rule) reward counts correct",
    "maskgrpo_eval_metric": "a `maskgrpo eval` figure: mean per metric, model and GenEval tag ('all': every prompt)",
}
GAUGE_TAGS = {
    "maskgrpo_eval_metric": ("metric", "model", "tag"),
    "maskgrpo_step_bytes": ("hop",),
    "maskgrpo_weight_bytes": ("what",),
}
COUNTERS = {
    "maskgrpo_steps_total": "training steps finished",
    "maskgrpo_images_total": "images generated",
    "maskgrpo_groups_dropped_total": "groups dropped by the filter",
    "maskgrpo_groups_invalid_total": "groups skipped for a NaN or failed reward",
    "maskgrpo_chunks_reissued_total": "prompt chunks re-issued after a rollout actor died",
    "maskgrpo_reward_failures_total": "samples whose reward component score was lost, by component and kind (raised, nonfinite, bad_shape)",
    "maskgrpo_actors_lost_total": "rollout, reward or filter actors lost, by role and why (died, hung)",
    "maskgrpo_actor_restarts_total": "lost actors replaced by a fresh one, by role",
    "maskgrpo_learner_fallbacks_total": "learner groups restarted from the rollout actors' weights with fresh optimizer state (no checkpoint to restore)",
}
COUNTER_TAGS = {
    "maskgrpo_reward_failures_total": ("component", "kind"),
    "maskgrpo_actors_lost_total": ("role", "why"),
    "maskgrpo_actor_restarts_total": ("role",),
}
HISTOGRAMS = {
    "maskgrpo_phase_seconds": ("latency of a driver phase", ("phase",)),
    "maskgrpo_weight_sync_seconds": ("learner -> rollout weight sync latency", ()),
    "maskgrpo_generate_seconds": ("one rollout chunk's generation latency", ("actor",)),
    "maskgrpo_score_seconds": ("one reward batch's scoring latency", ("actor",)),
}


class RayMetrics:
    """Lazily created gauges, counters and histograms with the names above."""

    def __init__(self) -> None:
        self._m: dict[str, Any] = {}
        self._broken = False

    def _get(self, name: str) -> Any:
        if name in self._m:
            return self._m[name]
        from ray.util import metrics as rm

        m: Any
        if name in GAUGES:
            m = rm.Gauge(name, description=GAUGES[name], tag_keys=GAUGE_TAGS.get(name))
        elif name in COUNTERS:
            m = rm.Counter(name, description=COUNTERS[name], tag_keys=COUNTER_TAGS.get(name))
        else:
            desc, tags = HISTOGRAMS[name]
            m = rm.Histogram(name, description=desc, boundaries=LATENCY_BOUNDARIES, tag_keys=tags)
        self._m[name] = m
        return m

    def _safe(self, fn: Any) -> None:
        if self._broken:
            return
        try:
            fn()
        except Exception as err:  # noqa: BLE001 - metrics must never stop training
            self._broken = True
            log.warning("Ray metrics disabled after an error: %s", err)

    def gauge(self, name: str, value: float, tags: dict[str, str] | None = None) -> None:
        if value is None or (isinstance(value, float) and not math.isfinite(value)):
            return
        self._safe(lambda: self._get(name).set(float(value), tags=tags or None))

    def count(self, name: str, value: float = 1.0, tags: dict[str, str] | None = None) -> None:
        if value and value > 0:
            self._safe(lambda: self._get(name).inc(float(value), tags=tags or None))

    def observe(self, name: str, seconds: float, tags: dict[str, str] | None = None) -> None:
        self._safe(lambda: self._get(name).observe(float(seconds), tags=tags or None))

    def record_step(self, row: dict[str, Any], group_size: int) -> None:
        """Mirror one ``metrics.jsonl`` row (the driver's step figures)."""
        self.count("maskgrpo_steps_total")
        self.gauge("maskgrpo_accuracy", row.get("accuracy", float("nan")))
        self.gauge("maskgrpo_accuracy_kept", row.get("accuracy_kept", float("nan")))
        self.gauge("maskgrpo_policy_version_lag", row.get("policy_version_lag", float("nan")))
        busy = row.get("learner_busy_fraction", float("nan"))
        self.gauge("maskgrpo_learner_busy_fraction", busy)
        self.count("maskgrpo_images_total", row.get("groups_generated", 0.0) * group_size)
        self.count("maskgrpo_groups_dropped_total", row.get("groups_dropped", 0.0))
        self.count("maskgrpo_groups_invalid_total", row.get("groups_invalid", 0.0))
        self.gauge("maskgrpo_images_per_second", row.get("samples_per_second", float("nan")))
        self.gauge("maskgrpo_filter_drop_rate", row.get("filter_drop_rate", float("nan")))
        self.gauge("maskgrpo_effective_groups", row.get("groups_trained", float("nan")))
        self.gauge("maskgrpo_reward_mean", row.get("reward_mean", float("nan")))
        self.gauge("maskgrpo_reward_mean_kept", row.get("reward_mean_kept", float("nan")))
        self.gauge("maskgrpo_eval_reward", row.get("eval_reward", float("nan")))
        self.gauge("maskgrpo_eval_accuracy", row.get("eval_accuracy", float("nan")))
        for hop in ("rollouts", "driver_received", "driver_sent", "learner_fetch"):
            if f"bytes/{hop}" in row:
                self.gauge("maskgrpo_step_bytes", row[f"bytes/{hop}"], {"hop": hop})
        if "driver_bytes_fraction" in row:
            self.gauge("maskgrpo_driver_bytes_fraction", row["driver_bytes_fraction"])
        for k, v in row.items():
            if k.startswith("time/"):
                self.observe("maskgrpo_phase_seconds", v, {"phase": k[5:]})


_PROCESS_METRICS: RayMetrics | None = None


def process_metrics() -> RayMetrics:
    """The one ``RayMetrics`` of this process."""
    global _PROCESS_METRICS
    if _PROCESS_METRICS is None:
        _PROCESS_METRICS = RayMetrics()
    return _PROCESS_METRICS
