"""``reward.ensemble`` (docs/monitors.md, Defenses): the combination by hand, the composite's
total, the config's rules, and the shapes world's reward models of other seeds."""

from __future__ import annotations

import math

import pytest
import torch

from maskgrpo_ray.config import ConfigError, load_config
from maskgrpo_ray.pipeline.build import build_reward_from_settings
from maskgrpo_ray.pipeline.settings import settings_from_config
from maskgrpo_ray.rewards.base import CompositeReward, EnsembleSpec

NAN = float("nan")


def test_mean_minus_std_and_min_by_hand():
    parts = {
        "a": torch.tensor([1.0, 0.0, 5.0]),
        "b": torch.tensor([3.0, 0.0, NAN]),
        "c": torch.tensor([2.0, 3.0, 5.0]),
    }
    # sample 0: 1, 3, 2: mean 2, population std sqrt((1 + 1 + 0) / 3) = sqrt(2/3);
    # sample 1: 0, 0, 3: mean 1, std sqrt((1 + 1 + 4) / 3) = sqrt(2); sample 2: a NaN member
    e = EnsembleSpec(("a", "b", "c"), "mean_minus_std", std_coef=1.5)
    got = e.combine(parts)
    assert got[:2].tolist() == pytest.approx([2 - 1.5 * math.sqrt(2 / 3), 1 - 1.5 * math.sqrt(2)])
    assert math.isnan(got[2].item())
    got = EnsembleSpec(("a", "b", "c"), "min").combine(parts)
    assert got[:2].tolist() == [1.0, 0.0] and math.isnan(got[2].item())
    # k = 0 is the members' mean; two members only: the others are not read
    assert EnsembleSpec(("a", "c"), std_coef=0.0).combine(parts).tolist() == [1.5, 1.5, 5.0]


class _Const:
    def __init__(self, name: str, values: list[float]) -> None:
        self.name, self.values = name, torch.tensor(values)

    def __call__(self, images, prompts):
        return self.values


def test_the_composite_adds_the_weighted_ensemble_term():
    # total = 1 * x + 0 * a + 0 * b + 2 * min(a, b) = [1 + 2 * 1, 0 + 2 * (-1)] = [3, -2]
    x, a, b = _Const("x", [1.0, 0.0]), _Const("a", [1.0, 4.0]), _Const("b", [2.0, -1.0])
    comp = CompositeReward(
        [(x, 1.0), (a, 0.0), (b, 0.0)], ensemble=EnsembleSpec(("a", "b"), "min", weight=2.0)
    )
    images = torch.zeros(2, 4, 4, 3, dtype=torch.uint8)
    total, parts = comp.score(images, ["p", "q"])
    assert total.tolist() == [3.0, -2.0] and set(parts) == {"x", "a", "b"}
    with pytest.raises(ValueError, match="no reward part"):
        CompositeReward([(x, 1.0)], ensemble=EnsembleSpec(("x", "y")))


TWO_RULES = [
    "reward.components=[{kind: toy_rules, weight: 0.0, args: {name: part_score, terms: score}},"
    " {kind: toy_rules, weight: 0.0, args: {name: part_correct, terms: correct}}]",
]


def test_the_config_builds_the_ensemble_the_reward_actors_use():
    cfg = load_config(
        "configs/toy.yaml",
        [*TWO_RULES, "reward.ensemble={members: [part_score, part_correct], rule: min}"],
    )
    reward = build_reward_from_settings(settings_from_config(cfg).reward)
    from maskgrpo_ray.worlds.toy.world import PALETTE

    g = torch.Generator().manual_seed(0)
    cells = torch.randint(0, len(PALETTE), (6, 4, 4), generator=g)
    images = torch.tensor(PALETTE, dtype=torch.uint8)[cells].repeat_interleave(8, 1)
    images = images.repeat_interleave(8, 2)  # [6, 32, 32, 3], 8 px cells
    prompts = ["one red dot on the left"] * 6
    total, parts = reward.score(images, prompts)
    assert torch.equal(total, torch.minimum(parts["part_score"], parts["part_correct"]))


@pytest.mark.parametrize(
    ("sets", "match"),
    [
        (["reward.ensemble={members: [part_score, nope]}"], "names 'nope' \\(no component\\)"),
        (
            [
                "reward.components=[{kind: toy_rules, weight: 1.0, args: {name: part_score}},"
                " {kind: toy_rules, weight: 0.0, args: {name: part_correct}}]",
                "reward.ensemble={members: [part_score, part_correct]}",
            ],
            "names 'part_score' \\(weight 1.0\\)",
        ),
        (["reward.ensemble={members: [part_score]}"], "at least 2"),
        (
            [
                "reward.ensemble={members: [part_score, part_correct]}",
                "train.advantage=gdpo",
            ],
            "gdpo.*ensemble",
        ),
    ],
)
def test_the_config_refuses_a_bad_ensemble(sets, match):
    with pytest.raises(ConfigError, match=match):
        load_config("configs/toy.yaml", [*TWO_RULES, *sets])


def test_a_shapes_reward_model_of_another_seed_is_another_cached_model(monkeypatch):
    from maskgrpo_ray.worlds.shapes import rewards as shapes_rewards
    from maskgrpo_ray.worlds.shapes.reward_model import ShapesClip

    seen = []
    monkeypatch.setattr(
        shapes_rewards, "load_or_train", lambda spec: seen.append(spec) or ShapesClip(spec)
    )
    shapes_rewards.build_shapes_clip(seed=0)
    shapes_rewards.build_shapes_clip(seed=0, model_seed=3)
    default, other = seen
    assert default.seed == 0 and default.world.seed == 0  # the default: the world's seed
    assert other.seed == 3 and other.world == default.world  # same world, another model
    assert other.cache_key() != default.cache_key()
