"""Staleness and on-policy checks of every run, asynchronous or not (the driver's, so the local
and the Ray backend log the same figures from the same code).

Before an update the driver knows, for each kept group, the policy version that generated it
(``RolloutBatch.policy_version`` in one process, each chunk's ``RolloutMeta`` on Ray). Its
*lag* is the learner's version minus that; a group whose lag exceeds ``rollout.max_policy_lag``
is dropped before the update (the loop's submission rules should make that impossible, so a
drop is a bug made visible, not a silent off-policy update). Per step:

* ``staleness/lag_mean``, ``staleness/lag_max``: the mean and the worst lag of the samples
  trained (every group has ``G`` samples, so the sample mean is the group mean);
* ``staleness/samples_dropped``: samples dropped for staleness.

On-policy check: when every sample trained has lag 0, the learner's weights are the rollout's,
so the first pass's importance ratio ``exp(log pi - log pi_old)`` against the rollout's cached
log-probs must be 1 up to float round-off. The learner reports ``first_ratio_abs_dev_max``
(``max |ratio - 1|`` over every micro-batch of its first pass, worst over ranks) and
``onpolicy_measured_share``, the share of the pairs it measured: all of them, or under
trajectory shrinkage the block starts only (``t % s == 0``, scored from their own state; the
other steps are scored from an earlier state, so their ratio says nothing about the weights).
The driver logs them as ``onpolicy/first_ratio_max_abs_dev`` and ``onpolicy/measured_share`` at
lag 0 only (at lag >= 1 the ratio is meant to differ from 1), the figure NaN when nothing was
measured (never 0: a check that did not look does not pass), and warns, naming the step, when a
measured figure exceeds ``train.onpolicy_ratio_tolerance``.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from maskgrpo_ray.pipeline.data_plane import RolloutRefs

log = logging.getLogger(__name__)

LEARNER_FIRST_RATIO = "first_ratio_abs_dev_max"  # the learner's metric (reduced by max)
ONPOLICY_FIRST_RATIO = "onpolicy/first_ratio_max_abs_dev"  # the driver's row key
LEARNER_MEASURED = "onpolicy_measured_share"  # the learner's metric (reduced by mean)
ONPOLICY_MEASURED = "onpolicy/measured_share"  # the driver's row key


def group_versions(rollout: Any) -> torch.Tensor:
    """The policy version that generated each group: long ``[B]``. A ``RolloutRefs`` knows it
    per chunk (its pieces); an in-process ``RolloutBatch`` has one (the oldest of its chunks:
    in one process a step's chunks are all generated with the same weights)."""
    if isinstance(rollout, RolloutRefs):
        return torch.tensor(
            [p.meta.policy_version for p in rollout.pieces for _ in p.groups], dtype=torch.long
        )
    return torch.full((len(rollout.prompts),), int(rollout.policy_version), dtype=torch.long)


def staleness_check(
    versions: torch.Tensor, learner_version: int, max_lag: int, group_size: int, step: int
) -> tuple[torch.Tensor, dict[str, float]]:
    """Which groups stay (bool ``[B]``: lag <= ``max_lag``) and the step's staleness figures.

    Args:
        versions: long ``[B]``, each group's generating version (:func:`group_versions`).
        learner_version: the learner's version before this update.
        max_lag: ``rollout.max_policy_lag``.
        group_size: ``G``.
        step: the driver step (named in the warning when groups are dropped).
    """
    lag = learner_version - versions  # [B]
    keep = (lag <= max_lag) & (lag >= 0)
    dropped = int((~keep).sum()) * group_size
    if dropped:
        log.warning(
            "step %d: %d samples dropped for staleness (lags %s, rollout.max_policy_lag=%d)",
            step,
            dropped,
            sorted(set(lag[~keep].tolist())),
            max_lag,
        )
    kept = lag[keep].float()
    figures = {
        "staleness/lag_mean": float(kept.mean()) if kept.numel() else 0.0,
        "staleness/lag_max": float(kept.max()) if kept.numel() else 0.0,
        "staleness/samples_dropped": float(dropped),
    }
    return keep, figures


def check_rollout(
    rollout: Any, learner_version: int, max_policy_lag: int, step: int, row: dict[str, Any]
) -> torch.Tensor:
    """:func:`staleness_check` of a step's kept rollout against ``rollout.max_policy_lag``,
    its figures into ``row``; the groups that stay, bool ``[B]``."""
    keep, figures = staleness_check(
        group_versions(rollout),
        learner_version,
        max_policy_lag,
        rollout.group_size,
        step,
    )
    row.update(figures)
    return keep


def onpolicy_check(row: dict[str, Any], step: int, tolerance: float) -> None:
    """Turn the learner's first-pass ratio deviation in ``row`` into the on-policy figures when
    the samples trained were all at lag 0 (``row["staleness/lag_max"] == 0``), with a WARNING
    naming the step when it exceeds ``tolerance``; drop them otherwise. A learner that measured
    no pair (``onpolicy_measured_share`` 0) gives the figure NaN, and no warning."""
    dev = row.pop(LEARNER_FIRST_RATIO, None)
    share = row.pop(LEARNER_MEASURED, None)
    if (dev is None and share is None) or row.get("staleness/lag_max", 1.0) != 0.0:
        return
    row[ONPOLICY_FIRST_RATIO] = float("nan") if dev is None else float(dev)
    if share is not None:
        row[ONPOLICY_MEASURED] = float(share)
    if dev is not None and not dev <= tolerance:  # NaN warns too
        log.warning(
            "step %d: on-policy check failed: the first pass's ratio is off 1 by %.3g "
            "(tolerance train.onpolicy_ratio_tolerance=%.3g) although every sample trained was "
            "generated with the learner's weights (lag 0): the rollout's and the learner's "
            "log-probs disagree (precision, a different transition definition, or weights "
            "out of sync)",
            step,
            dev,
            tolerance,
        )
