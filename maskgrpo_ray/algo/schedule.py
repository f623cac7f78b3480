"""Show-o's schedules: how many image tokens stay masked after each unmasking step, and how
the Gumbel temperature of the remasking noise anneals.

At step ``t`` of ``S`` (0-based) Show-o keeps ``floor(L * cos(pi/2 * (t+1)/S))`` tokens masked,
clamped so that at least one token is committed and at least one stays masked, and at the last
step everything is committed (showlab/Show-o ``models/modeling_showo.py``, ``t2i_generate``).
The cosine is evaluated on a float32 tensor exactly as the reference does, so floors agree with
it bit for bit. The sampler takes both as arguments (:data:`MaskSchedule`, :data:`GumbelAnneal`) so that a model can bring its own;
these are the defaults.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

MaskSchedule = Callable[[int, int, int, int], int]
"""``(step t, num_steps S, num_tokens L, num_masked before) -> m_t``, masked after the step."""

GumbelAnneal = Callable[[float, int, int], float]
"""``(tau_{t-1}, step t, num_steps S) -> tau_t``, the Gumbel temperature step ``t`` uses."""


def cosine_mask_ratio(step: int, num_steps: int) -> float:
    """``cos(pi/2 * (step+1)/num_steps)`` computed in float32 like Show-o's ``cosine_schedule``."""
    r = torch.tensor((step + 1) / num_steps, dtype=torch.float32)
    return float(torch.cos(r * math.pi * 0.5))


def num_masked_after_step(step: int, num_steps: int, num_tokens: int, num_masked: int) -> int:
    """Tokens still masked after ``step`` (the paper's ``m_t``).

    Args:
        step: 0-based step index ``t``.
        num_steps: ``S``.
        num_tokens: ``L``, the image length (Show-o uses ``L``, not the initial masked count).
        num_masked: masked tokens before the step.

    Returns:
        ``0`` at the last step (everything committed); otherwise
        ``max(1, min(num_masked - 1, floor(L * cos(pi/2 * (t+1)/S))))``.
    """
    if step >= num_steps - 1:
        return 0
    ratio = torch.tensor(cosine_mask_ratio(step, num_steps), dtype=torch.float32)
    m = int(torch.floor(num_tokens * ratio))
    return max(1, min(num_masked - 1, m))


def tokens_per_step(num_tokens: int, num_steps: int) -> list[int]:
    """How many tokens each step commits when starting fully masked; sums to ``num_tokens``."""
    if num_steps < 1 or num_tokens < 1:
        raise ValueError(f"need num_steps >= 1 and num_tokens >= 1, got {num_steps}, {num_tokens}")
    masked, out = num_tokens, []
    for t in range(num_steps):
        after = num_masked_after_step(t, num_steps, num_tokens, masked)
        out.append(masked - after)
        masked = after
    return out


def compounding_anneal(tau: float, step: int, num_steps: int) -> float:
    """Show-o's Gumbel anneal ``tau_t = tau_{t-1} * (1 - (t+1)/S)`` (it compounds: ``tau_{-1}``
    is ``tau_0`` and every step multiplies the previous step's temperature)."""
    return tau * (1.0 - (step + 1) / num_steps)
