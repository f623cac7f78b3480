"""``reward.refresh`` in a run: which component trains, when, on what, and what evaluation and
checkpoints see (Adv-GRPO's online reward, arXiv 2511.20256; the loss is the component's own,
e.g. :mod:`maskgrpo_ray.worlds.shapes.reward_refresh`).

After step ``s``'s update, when ``(s + 1) % every_steps == 0``, the component trains on step
``s``'s scored samples (the trained groups' images and prompts), with the seed ``(run.seed, s)``;
the steps collected after that are scored with it (a step submitted ahead, with
``rollout.max_policy_lag`` >= 1, was scored before). Held-out evaluation (and the monitors' probe)
scores with a frozen copy of the component taken before the first refresh, so ``eval_reward``
stays one yardstick across a run and across runs. A checkpoint holds the refreshed weights and
the optimiser's state (:meth:`RewardRefresher.state_dict`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from maskgrpo_ray.config import Config
from maskgrpo_ray.config.kinds import load_plugins
from maskgrpo_ray.config.refresh import RewardRefreshConfig
from maskgrpo_ray.errors import UserError
from maskgrpo_ray.pipeline.messages import RolloutBatch
from maskgrpo_ray.pipeline.settings import component_name
from maskgrpo_ray.rewards.base import (
    CompositeReward,
    RefreshableReward,
    Reward,
    reward_refreshes,
)

STATE_FILE = "reward_refresh.pt"  # in a checkpoint folder: the refreshed reward and optimiser


def check_reward_refresh(cfg: Config) -> None:
    """Before anything starts: ``reward.refresh.component`` is of a kind that can refresh
    (``register_reward(..., refreshes=True)``). Raises a one-line :class:`UserError`."""
    r = cfg.reward.refresh
    if not r.enabled:
        return
    load_plugins(cfg.model.plugins)  # a plugin may register reward kinds
    for c in cfg.reward.components:
        if component_name(c) == r.component and not reward_refreshes(c.kind):
            raise UserError(
                f"reward.refresh.component={r.component!r} is a {c.kind!r} reward, which cannot "
                "keep training during RL (only kinds registered with refreshes=True can: "
                "shapes_clip); name such a component, or set reward.refresh.enabled false"
            )


class RewardRefresher:
    """The refreshed component of a run's reward, its frozen original and its schedule."""

    def __init__(
        self, settings: RewardRefreshConfig, reward: CompositeReward, run_seed: int
    ) -> None:
        part = reward.rewards.get(settings.component)
        if not isinstance(part, RefreshableReward):
            raise UserError(
                f"reward.refresh.component={settings.component!r}: no refreshable component of "
                f"that name in the reward (parts: {sorted(reward.rewards)})"
            )
        self.settings: RewardRefreshConfig = settings
        self.run_seed: int = run_seed
        self.part: RefreshableReward = part
        self.frozen: Reward = part.frozen_copy()  # before any refresh: what evaluation scores with
        part.start_refresh(settings)

    def due(self, step: int) -> bool:
        return (step + 1) % self.settings.every_steps == 0

    def __call__(self, step: int, rollout: RolloutBatch) -> dict[str, float]:
        """Refresh on ``rollout``'s images when ``step`` is due; the figures as
        ``refresh/<name>`` (empty when not due)."""
        if not self.due(step):
            return {}
        prompts = [p for p in rollout.prompts for _ in range(rollout.group_size)]
        figures = self.part.refresh(rollout.images, prompts, (self.run_seed, step))
        return {f"refresh/{k}": v for k, v in figures.items()}

    def eval_reward(self, reward: CompositeReward) -> CompositeReward:
        """``reward`` with the refreshed component replaced by its frozen original."""
        parts = [
            (self.frozen if r is self.part else r, reward.weights[n])
            for n, r in reward.rewards.items()
        ]
        return CompositeReward(
            parts,
            diversity_embedding=reward.diversity_embedding,
            train_embedding=reward.train_embedding,
            ensemble=reward.ensemble,
            judge=reward.judge,
        )

    def state_dict(self) -> dict[str, Any]:
        return self.part.refresh_state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.part.load_refresh_state(state)


def make_refresher(cfg: Config, reward: Any) -> RewardRefresher | None:
    """The run's refresher (``reward.refresh.enabled``), else None; the kind checked first."""
    if not cfg.reward.refresh.enabled:
        return None
    check_reward_refresh(cfg)
    if not isinstance(reward, CompositeReward):
        raise UserError("reward.refresh needs the run's composed reward (build_reward)")
    return RewardRefresher(cfg.reward.refresh, reward, cfg.run.seed)


def refresh_state_path(folder: Path) -> Path:
    """The refreshed reward's state file in checkpoint ``folder``; a one-line
    :class:`UserError` when the checkpoint was written without ``reward.refresh``."""
    path = folder / STATE_FILE
    if not path.is_file():
        raise UserError(
            f"reward.refresh.enabled=true but the checkpoint {folder} has no {STATE_FILE}: it "
            "was written by a run without the refresh; resume it with reward.refresh.enabled "
            "false, or start a new run"
        )
    return path
