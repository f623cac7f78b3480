"""Monitors: reward hacking and collapse seen as they start (docs/monitors.md).

Pure functions on tensors and on a run's rows (``metrics.jsonl``); the driver's phase is
``loop.monitoring``. Four kinds of figure:

* **image statistics** of every training sample (:func:`image_statistics`, computed where the
  images are: beside the reward, so the Ray and the local backend log the same): colour entropy,
  the share of dark and of saturated pixels, edge density. They see a collapse that no reward
  sees (a policy drifting to blobs, to one colour, to empty canvases).
* **reward agreement**: where several reward components are scored (weight 0 ones too, such as
  a judge), the mean Spearman rank correlation of each pair within the groups
  (:func:`reward_agreement`): GRPO trains on ranks within a group, so this is the agreement that
  matters.
* **reward versus judge**: the trend of the reward and of the judge (the reward's ``accuracy``,
  whatever the evaluation uses for it) over a window of steps and of probe evaluations
  (:func:`trend`, :func:`monitor_figures`): the reward keeps rising while the judge stalls.
* **alarms**: a rule on those figures, per step (:func:`monitor_figures`), tripping once per
  run with one log line (the driver's).

Imports torch only (matplotlib inside :func:`monitors_figure`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from maskgrpo_ray.runlog.probe_alarms import ALL_ALARMS

ENTROPY = "image/colour_entropy"
DARK = "image/dark"
SATURATED = "image/saturated"
EDGES = "image/edges"
IMAGE_STATS = (ENTROPY, DARK, SATURATED, EDGES)
MALFORMED = "image/malformed"  # a detector's share of malformed objects (the shapes judge)
MAX_SIDE = 128  # images are subsampled (every k-th pixel) to at most this many pixels a side
DARK_LUMA = 0.15  # a pixel is dark when its luma (BT.601, 0-1) is below this
SATURATED_CHROMA = 0.5  # ... saturated when (max - min) / 255 of its channels is at least this
EDGE_STEP = 64  # ... two neighbours make an edge when a channel differs by more than this

ALARMS = ALL_ALARMS
ALARM = "monitor/alarm/"  # + an alarm's name: 1.0 on the steps where its rule holds


# --------------------------------------------------------------------------- image statistics


def image_statistics(images: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-sample statistics of ``images`` uint8 ``[N, H, W, 3]``, each float ``[N]``:

    * ``image/colour_entropy``: Shannon entropy (bits) of the image's colour histogram with
      each channel cut into 4 levels (``value // 64``; 64 colours, so 0 to 6 bits);
    * ``image/dark``: share of pixels with luma ``(0.299 R + 0.587 G + 0.114 B) / 255`` below
      :data:`DARK_LUMA`;
    * ``image/saturated``: share of pixels whose chroma ``(max - min) / 255`` is at least
      :data:`SATURATED_CHROMA`;
    * ``image/edges``: share of horizontally and vertically adjacent pixel pairs whose largest
      channel difference exceeds :data:`EDGE_STEP` (NaN for a 1x1 image: no pairs).

    An image larger than :data:`MAX_SIDE` a side is read at every ``k``-th pixel first (its
    own colours, no blending; ``k = ceil(max(H, W) / MAX_SIDE)``).
    """
    if images.dim() != 4 or images.shape[-1] != 3 or images.dtype != torch.uint8:
        raise ValueError(f"image_statistics needs uint8 [N, H, W, 3], got {tuple(images.shape)}")
    k = max(1, math.ceil(max(images.shape[1], images.shape[2]) / MAX_SIDE))
    u = images[:, ::k, ::k].cpu()  # [N, h, w, 3] uint8
    x = u.to(torch.int16)  # differences fit
    n, h, w, _ = x.shape
    q = u >> 6  # [N, h, w, 3] in 0..3 (value // 64)
    bins = ((q[..., 0] << 4) | (q[..., 1] << 2) | q[..., 2]).reshape(n, -1).long()  # [N, h*w]
    counts = torch.zeros(n, 64).scatter_add_(1, bins, torch.ones(bins.shape))
    p = counts / max(h * w, 1)  # [N, 64]
    entropy = -(p * torch.log2(p.clamp(min=1e-30))).sum(-1)  # 0 log 0 = 0
    xi = x.to(torch.int32)  # luma in integer thousandths: 299 R + 587 G + 114 B
    luma = 299 * xi[..., 0] + 587 * xi[..., 1] + 114 * xi[..., 2]  # [N, h, w]
    chroma = u.amax(-1) - u.amin(-1)  # [N, h, w], 0..255 (max >= min: no wrap)
    dh = (x[:, :, 1:] - x[:, :, :-1]).abs().amax(-1) > EDGE_STEP  # [N, h, w-1]
    dv = (x[:, 1:] - x[:, :-1]).abs().amax(-1) > EDGE_STEP  # [N, h-1, w]
    pairs = h * (w - 1) + (h - 1) * w
    edges = (dh.flatten(1).sum(-1) + dv.flatten(1).sum(-1)).float()
    return {
        ENTROPY: entropy.float(),
        DARK: (luma < DARK_LUMA * 255 * 1000).flatten(1).float().mean(-1),
        SATURATED: (chroma >= SATURATED_CHROMA * 255).flatten(1).float().mean(-1),
        EDGES: edges / pairs if pairs else torch.full((n,), float("nan")),
    }


# --------------------------------------------------------------------------- reward agreement


def average_ranks(x: torch.Tensor) -> torch.Tensor:
    """1-based ranks along the last dimension, ties sharing their mean rank: for ``x [..., G]``
    the rank of ``x_i`` is ``#{j: x_j < x_i} + (#{j: x_j = x_i} + 1) / 2``."""
    less = (x.unsqueeze(-1) > x.unsqueeze(-2)).sum(-1).float()  # [..., G]: x_j < x_i
    equal = (x.unsqueeze(-1) == x.unsqueeze(-2)).sum(-1).float()  # x_i itself included
    return less + (equal + 1.0) / 2.0


def group_spearman(a: torch.Tensor, b: torch.Tensor, group_size: int) -> torch.Tensor:
    """Spearman's rank correlation of ``a`` and ``b`` (``[N]``, groups of ``group_size``
    consecutive samples) within each group: float ``[B]``, the Pearson correlation of the two
    groups' average ranks; NaN for a group with a non-finite value or a constant side (no
    ranking to agree with)."""
    ra = average_ranks(a.double().view(-1, group_size))
    rb = average_ranks(b.double().view(-1, group_size))
    ca, cb = ra - ra.mean(-1, keepdim=True), rb - rb.mean(-1, keepdim=True)
    den = (ca.square().sum(-1) * cb.square().sum(-1)).sqrt()
    rho = (ca * cb).sum(-1) / den
    finite = torch.isfinite(a.view(-1, group_size)).all(-1) & torch.isfinite(
        b.view(-1, group_size)
    ).all(-1)
    return torch.where(finite & (den > 0), rho, torch.full_like(rho, float("nan"))).float()


def reward_agreement(parts: Mapping[str, torch.Tensor], group_size: int) -> dict[str, float]:
    """``agreement/<a>_vs_<b>``: the mean over groups of :func:`group_spearman` for each pair
    of reward components (in the composition's order), and ``agreement/mean`` over the pairs;
    ``{}`` with fewer than two components or groups of one. A pair with no group to rank is
    NaN (left out of the mean)."""
    names = list(parts)
    if len(names) < 2 or group_size < 2:
        return {}
    out: dict[str, float] = {}
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            rho = group_spearman(parts[a], parts[b], group_size)
            rho = rho[torch.isfinite(rho)]
            out[f"agreement/{a}_vs_{b}"] = float(rho.mean()) if rho.numel() else math.nan
    pairs = [v for v in out.values() if math.isfinite(v)]
    out["agreement/mean"] = sum(pairs) / len(pairs) if pairs else math.nan
    return out


# --------------------------------------------------------------------------- the rules


@dataclass(frozen=True)
class MonitorRules:
    """The alarms' thresholds (``logging.monitors``; docs/monitors.md)."""

    window_steps: int = 10  # steps the training trends are fitted over
    probe_window: int = 3  # probe evaluations the probe trends are fitted over
    reward_rise: float = 0.5  # reward rise over a window, in the first step's reward std
    judge_rise: float = 0.0  # a judge rise at or below this is a stall
    persist_steps: int = 3  # steps the training rule must hold in a row
    baseline_steps: int = 5  # the first steps' mean is the image statistics' baseline
    entropy_drift_bits: float = 1.0  # |colour entropy - baseline| that trips the drift alarm
    share_drift: float = 0.2  # |dark, saturated or edge share - baseline| that trips it


def trend(xs: Sequence[float], ys: Sequence[float]) -> float:
    """The rise of ``ys`` over the span of ``xs``: the least-squares slope times
    ``max(xs) - min(xs)``, over the finite points; NaN with fewer than two distinct ``xs``."""
    pts = [(float(x), float(y)) for x, y in zip(xs, ys, strict=True) if _finite(y)]
    if len({x for x, _ in pts}) < 2:
        return math.nan
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    slope = sum((x - mx) * (y - my) for x, y in pts) / sxx
    return slope * (max(x for x, _ in pts) - min(x for x, _ in pts))


def _finite(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _series(rows: Sequence[Mapping[str, Any]], key: str) -> list[tuple[int, float]]:
    return [(int(r["step"]), float(r[key])) for r in rows if _finite(r.get(key))]


def reward_scale(rows: Sequence[Mapping[str, Any]]) -> float:
    """The run's reward unit: the first finite, positive ``reward_std`` (the per-sample spread
    of the reward at the run's first logged step); NaN when none."""
    return next((v for _, v in _series(rows, "reward_std") if v > 0), math.nan)


def _diverging(r: float, j: float, rules: MonitorRules) -> float:
    if not (math.isfinite(r) and math.isfinite(j)):
        return math.nan
    return float(r > rules.reward_rise and j <= rules.judge_rise)


def _trends(
    rows: Sequence[Mapping[str, Any]], reward: str, judge: str, n: int, scale: float
) -> tuple[float, float]:
    """The reward's rise (in ``scale``) and the judge's over the last ``n`` rows that have
    both (NaN, NaN until there are ``n``)."""
    pts = [r for r in rows if _finite(r.get(reward)) and _finite(r.get(judge))][-n:]
    if len(pts) < n:
        return math.nan, math.nan
    steps = [r["step"] for r in pts]
    return (
        trend(steps, [r[reward] for r in pts]) / scale,
        trend(steps, [r[judge] for r in pts]),
    )


def monitor_figures(
    history: Sequence[Mapping[str, Any]], row: Mapping[str, Any], rules: MonitorRules
) -> dict[str, float]:
    """The monitors' figures for ``row`` (a step's figures) after ``history`` (the run's
    earlier rows, oldest first): the trends, the image statistics' drift and the alarms'
    flags (``monitor/alarm/<name>``, 1.0 where the rule holds at this step):

    * ``hacking``: over the last ``window_steps`` steps the reward (``reward_mean``) rose by
      more than ``reward_rise`` reward units (:func:`reward_scale`) while the judge
      (``accuracy``) rose by at most ``judge_rise``, at each of the last ``persist_steps``
      steps;
    * ``probe_hacking``: the same rule over the last ``probe_window`` probe evaluations
      (``probe/reward``, ``probe/judge``), at a step that probes;
    * ``drift``: the mean of an image statistic over the last ``baseline_steps`` steps moved
      from its mean over the run's first ``baseline_steps`` by more than ``entropy_drift_bits``
      (colour entropy) or ``share_drift`` (the shares), once the two windows are apart.
    """
    rows = [*history, row]
    scale = reward_scale(rows)
    out: dict[str, float] = {}
    r, j = _trends(rows, "reward_mean", "accuracy", rules.window_steps, scale)
    if math.isfinite(r) or math.isfinite(j):
        out["monitor/reward_trend"], out["monitor/judge_trend"] = r, j
        out["monitor/diverging"] = _diverging(r, j, rules)
        last = [*(h.get("monitor/diverging") for h in history), out["monitor/diverging"]]
        held = last[-rules.persist_steps :]
        out[ALARM + "hacking"] = float(
            len(held) == rules.persist_steps and all(v == 1.0 for v in held)
        )
    if _finite(row.get("probe/reward")):
        r, j = _trends(rows, "probe/reward", "probe/judge", rules.probe_window, scale)
        if math.isfinite(r):
            out["monitor/probe_reward_trend"], out["monitor/probe_judge_trend"] = r, j
            out[ALARM + "probe_hacking"] = float(_diverging(r, j, rules) == 1.0)
    out.update(_drift(rows, rules))
    return out


def _drift(rows: Sequence[Mapping[str, Any]], rules: MonitorRules) -> dict[str, float]:
    n = rules.baseline_steps
    out: dict[str, float] = {}
    tripped = False
    for key in IMAGE_STATS:
        vals = [v for _, v in _series(rows, key)]
        if len(vals) < 2 * n:
            continue
        d = sum(vals[-n:]) / n - sum(vals[:n]) / n
        out[f"monitor/drift/{key.removeprefix('image/')}"] = d
        limit = rules.entropy_drift_bits if key == ENTROPY else rules.share_drift
        tripped |= abs(d) > limit
    if out:
        out[ALARM + "drift"] = float(tripped)
    return out


def newly_tripped(history: Sequence[Mapping[str, Any]], figures: Mapping[str, float]) -> list[str]:
    """The alarms whose flag is 1.0 in ``figures`` and in no earlier row: each trips once."""
    out = []
    for name in ALARMS:
        key = ALARM + name
        if figures.get(key) == 1.0 and not any(h.get(key) == 1.0 for h in history):
            out.append(name)
    return out


def monitor_summary(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """``summary.json``'s ``monitors``: per alarm its first step and the steps it held (an
    alarm that never tripped: null, 0); empty when no row carries a monitor figure."""
    if not any(k.startswith(("monitor/", "image/", "probe/")) for r in rows for k in r):
        return {}
    alarms: dict[str, Any] = {}
    for name in ALARMS:
        steps = [int(r["step"]) for r in rows if r.get(ALARM + name) == 1.0]
        alarms[name] = {"first_step": steps[0] if steps else None, "steps": len(steps)}
    return {"alarms": alarms, "plot": "monitors.png"}


def monitors_figure(rows: Sequence[Mapping[str, Any]], rules: MonitorRules) -> Any:
    """A matplotlib figure of a run's monitors: the reward against the judge (training steps
    and probes), the image statistics' drift over its threshold (+-1 trips), the reward
    agreement; every alarm's first step as a red line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    agree = sorted({k for r in rows for k in r if k.startswith("agreement/")})
    zs = sorted({k for r in rows for k in r if k.startswith("probe/z/")})
    n = 2 + bool(agree) + bool(zs)
    fig, axes = plt.subplots(n, 1, figsize=(7, 2.6 * n), sharex=True)
    _reward_panel(axes[0], rows)
    _drift_panel(axes[1], rows, rules)
    if agree:
        for key in agree:
            pts = _series(rows, key)
            if pts:
                axes[2].plot(*zip(*pts, strict=True), label=key[len("agreement/") :])
        axes[2].set_ylabel("Spearman in groups")
        if axes[2].get_legend_handles_labels()[0]:
            axes[2].legend(fontsize=7, loc="best")
    if zs:  # every probe against the base's (runlog.probe_alarms)
        for key in zs:
            pts = _series(rows, key)
            if pts:
                axes[-1].plot(*zip(*pts, strict=True), marker="o", label=key[len("probe/z/") :])
        axes[-1].axhline(0.0, color="grey", lw=0.8)
        axes[-1].set_ylabel("probe - base (base se)")
        axes[-1].legend(fontsize=7, loc="best")
    for name, info in monitor_summary(rows).get("alarms", {}).items():
        if info["first_step"] is not None:
            for a in axes:
                a.axvline(info["first_step"], color="red", lw=1.0)
            where = (info["first_step"], 0.02)
            axes[0].annotate(
                name, where, xycoords=("data", "axes fraction"), color="red", rotation=90
            )
    for a in axes:
        a.grid(alpha=0.3)
    axes[-1].set_xlabel("driver step")
    fig.tight_layout()
    return fig


def _reward_panel(ax: Any, rows: Sequence[Mapping[str, Any]]) -> None:
    """The reward (left axis) against the judge (right axis), training steps and probes."""
    twin = ax.twinx()
    for a, key, label, style in (
        (ax, "reward_mean", "reward (training)", {"color": "C0", "lw": 1.2}),
        (ax, "probe/reward", "reward (probe)", {"color": "C0", "marker": "o", "ls": "--"}),
        (twin, "accuracy", "judge (training)", {"color": "C1", "lw": 1.2}),
        (twin, "probe/judge", "judge (probe)", {"color": "C1", "marker": "s", "ls": "--"}),
    ):
        pts = _series(rows, key)
        if pts:
            a.plot(*zip(*pts, strict=True), label=label, **style)
    ax.set_ylabel("reward")
    twin.set_ylabel("judge (accuracy, 0-1)")
    handles = ax.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
    if handles:
        ax.legend(handles=handles, fontsize=7, loc="best")
    ax.set_title("Reward against the judge; image drift; reward agreement", fontsize=10)


def _drift_panel(ax: Any, rows: Sequence[Mapping[str, Any]], rules: MonitorRules) -> None:
    """Each image statistic's drift over its threshold: beyond +-1 the drift alarm trips."""
    for key in IMAGE_STATS:
        name = key.removeprefix("image/")
        limit = rules.entropy_drift_bits if key == ENTROPY else rules.share_drift
        pts = _series(rows, f"monitor/drift/{name}")
        if pts:
            ax.plot([s for s, _ in pts], [v / limit for _, v in pts], label=name)
    for y in (-1.0, 1.0):
        ax.axhline(y, color="red", lw=0.8, ls=":")
    ax.set_ylabel("drift / threshold")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, loc="best")
