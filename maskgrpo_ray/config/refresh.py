"""``reward.refresh``: the online reward refresh of Adv-GRPO (Mao, Chen, Yang, Shou, "The Image
as Its Own Reward: Reinforcement Learning with Adversarial Reward for Image Generation",
arXiv 2511.20256: "an adversarial reward that iteratively updates both the reward model and the
generator ... supervised using reference images as positive samples").

A learned reward component keeps training during RL: every ``every_steps`` driver steps it takes
``updates`` optimiser steps on reference images of that step's prompts (positives) against the
policy's samples of them (negatives), with its own AdamW, and scores the next steps with the
result; held-out evaluation keeps scoring with the frozen original, so runs stay comparable.
The component's kind must be able to refresh (``register_reward(..., refreshes=True)``, checked
before anything starts: :func:`maskgrpo_ray.pipeline.reward_refresh.check_reward_refresh`).

Part of the one config tree (:mod:`maskgrpo_ray.config`, the import point); plain pydantic.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from maskgrpo_ray.config.base import Strict


class RewardRefreshConfig(Strict):
    """The learned reward trained on, during RL, reference renders against the policy's
    samples (docs/shapes_world.md, The reward refresh)."""

    enabled: bool = Field(
        False,
        description="keep training the reward component `component` during RL (Adv-GRPO's "
        "adversarial reward); false: the reward stays as loaded (local backend only)",
    )
    component: str = Field(
        "shapes_clip",
        description="the reward component refreshed (its args.name, else its kind); its kind "
        "must be one that refreshes (shapes_clip)",
    )
    every_steps: int = Field(
        1,
        ge=1,
        description="driver steps between refreshes: after step s's update the reward trains on "
        "step s's samples when (s + 1) is a multiple of it; the steps after it are scored with "
        "the refreshed reward",
    )
    updates: int = Field(
        2, ge=1, description="AdamW steps per refresh, all on the same step's samples"
    )
    learning_rate: float = Field(
        1e-4, gt=0, description="the reward model's own AdamW learning rate (constant)"
    )
    weight_decay: float = Field(0.0, ge=0, description="the reward model's AdamW weight decay")
    renders_per_prompt: int = Field(
        2,
        ge=1,
        description="reference renders drawn per prompt of the step (correct scenes of it, the "
        "world's renderer), each a positive that must outscore the prompt's policy samples",
    )
    replay_weight: float = Field(
        1.0,
        ge=0,
        description="weight of the reward model's original contrastive loss (its pre-training "
        "batch: correct renders, near misses, near-miss prompts) mixed into every update, so "
        "that it keeps the grammar while it learns the policy's samples; 0: none",
    )
    replay_prompts: int = Field(
        32,
        ge=2,
        description="distinct prompts in each update's replay batch (replay_weight > 0)",
    )


def refresh_rules(cfg: Any) -> None:
    """``reward.refresh`` against the rest of the config (``cfg``: the whole
    :class:`maskgrpo_ray.config.Config`): the component is one of ``reward.components``, and
    the backend is the local one. Raises a one-line ``ValueError`` naming the field."""
    r = cfg.reward.refresh
    if not r.enabled:
        return
    names = [str(c.args.get("name", c.kind)) for c in cfg.reward.components]
    if r.component not in names:
        raise ValueError(
            f"reward.refresh.component={r.component!r} is no reward component (the components: "
            f"{names}); name one of them (its args.name, else its kind), or set "
            "reward.refresh.enabled false"
        )
    if cfg.run.backend != "local":
        raise ValueError(
            f"reward.refresh.enabled=true with run.backend={cfg.run.backend!r}: the reward "
            "refresh runs only in the single-process loop (the Ray reward actors would each "
            "hold their own copy of the reward); use run.backend=local, or set "
            "reward.refresh.enabled false"
        )
