"""``sim_cost``: the reward actors' time on a simulated accelerator (``model.kind: sim``).

SIMULATION. Scores nothing (zeros; give it weight 0) and lasts ``seconds_per_image x n x
time_scale`` per call: the time the cost profile's reward model (CLIP ViT-H-14 for the Show-o
profiles) takes on the target accelerator. The sim model kind fills both numbers from its
profile (``models.sim``); the other components of ``reward.components`` score the images.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from maskgrpo_ray.rewards.base import register_reward


class SimCostReward:
    """``reward(images [N, H, W, 3], prompts) -> zeros [N]``, taking the simulated time."""

    name = "sim_cost"

    def __init__(self, seconds_per_image: float, time_scale: float) -> None:
        if seconds_per_image < 0 or time_scale <= 0:
            raise ValueError(
                f"sim_cost: seconds_per_image={seconds_per_image} must be >= 0 and "
                f"time_scale={time_scale} > 0"
            )
        self.seconds_per_image, self.time_scale = seconds_per_image, time_scale

    def __call__(self, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        began = time.perf_counter()
        out = torch.zeros(images.shape[0], dtype=torch.float32)
        left = began + images.shape[0] * self.seconds_per_image * self.time_scale
        time.sleep(max(0.0, left - time.perf_counter()))
        return out


@register_reward("sim_cost")
def build_sim_cost(
    seconds_per_image: float = 0.0, time_scale: float = 1.0, name: str = "sim_cost"
) -> SimCostReward:
    """Factory for ``build_reward`` (the sim model kind gives both numbers)."""
    r = SimCostReward(seconds_per_image, time_scale)
    r.name = name
    return r
