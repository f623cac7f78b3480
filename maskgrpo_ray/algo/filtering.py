"""Sample filtering by the history of group reward std (paper Section 3.3).

"We set a dynamic filtering threshold based on the history standard deviation of the rewards
within each group. If a newly generated group has a reward standard deviation below the
threshold, then we resample the group. In practice, we set it as the lowest 10th percentile of
the history standard deviation." Every newly generated group's std enters the history (kept or
not), the decision is taken against the history *before* the new value is added, and nothing is
dropped until the history holds ``warmup_groups`` values.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile with linear interpolation (NumPy's default ``linear`` method)."""
    if not values:
        raise ValueError("percentile of an empty history")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass
class StdHistoryFilter:
    """Pure state + decision for the std-history filter.

    Attributes:
        percentile_q: the percentile of the history under which a group is dropped (10).
        warmup_groups: history length before any group is dropped.
        max_history: the history is a sliding window of the most recent this many groups.
    """

    percentile_q: float = 10.0
    warmup_groups: int = 32
    max_history: int = 4096
    history: deque[float] = field(default_factory=deque)
    seen: int = 0
    dropped: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.percentile_q <= 100.0:
            raise ValueError(f"percentile_q must be in [0, 100], got {self.percentile_q}")
        if self.max_history < 1 or self.warmup_groups < 0:
            raise ValueError("max_history must be >= 1 and warmup_groups >= 0")
        self.history = deque(self.history, maxlen=self.max_history)

    @property
    def warm(self) -> bool:
        return len(self.history) >= max(self.warmup_groups, 1)

    def threshold(self) -> float | None:
        """Current threshold, or None while warming up."""
        return percentile(list(self.history), self.percentile_q) if self.warm else None

    def decide(self, std: float) -> bool:
        """Keep (True) or drop (False) a new group with reward std ``std``; records it."""
        thr = self.threshold()
        keep = thr is None or not std < thr
        self.history.append(float(std))
        self.seen += 1
        if not keep:
            self.dropped += 1
        return keep

    def stats(self) -> dict[str, float]:
        thr = self.threshold()
        return {
            "filter_seen": float(self.seen),
            "filter_dropped": float(self.dropped),
            "filter_drop_rate": self.dropped / self.seen if self.seen else 0.0,
            "filter_threshold": thr if thr is not None else float("nan"),
            "filter_history": float(len(self.history)),
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            "percentile_q": self.percentile_q,
            "warmup_groups": self.warmup_groups,
            "max_history": self.max_history,
            "history": list(self.history),
            "seen": self.seen,
            "dropped": self.dropped,
        }

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> StdHistoryFilter:
        return cls(
            percentile_q=float(state["percentile_q"]),
            warmup_groups=int(state["warmup_groups"]),
            max_history=int(state["max_history"]),
            history=deque(float(x) for x in state["history"]),
            seen=int(state["seen"]),
            dropped=int(state["dropped"]),
        )
