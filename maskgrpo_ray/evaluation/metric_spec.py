"""Moved to :mod:`maskgrpo_ray.config_metrics` (the config family, which the config tree
imports without reaching up into the evaluation); this path keeps importing for one release."""

from maskgrpo_ray.config_metrics import METRICS_DOCS, RESERVED_NAMES, WHERE_FROM, MetricSpec

__all__ = ["METRICS_DOCS", "RESERVED_NAMES", "WHERE_FROM", "MetricSpec"]
