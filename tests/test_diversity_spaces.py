"""Diversity measured where it is a fair judge (issue 40): the embedding the figures are measured
in (``reward.diversity_embedding``, and ``train.diversity.embedding`` beside it), distinct
detected layouts (``diversity/layouts``) and the toy's ceiling of ``diversity/distinct``."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from maskgrpo_ray.algo.diversity import (
    DISTINCT,
    LAYOUTS,
    NEAREST,
    PAIRWISE,
    expected_distinct_fraction,
    first_of_kind,
    group_diversity,
    reward_diversity,
)
from maskgrpo_ray.config import load_config
from maskgrpo_ray.errors import UserError
from maskgrpo_ray.rewards.base import CompositeReward
from maskgrpo_ray.worlds.toy import world as toyworld
from maskgrpo_ray.worlds.toy.rewards import ToyRuleReward, judge

GRID, PX = 4, 8


def _toy_images(cells: list[list[int]], grid: int = GRID, px: int = PX) -> torch.Tensor:
    return toyworld.decode_palette(torch.tensor(cells, dtype=torch.long), grid, px)


class _Part:
    """A reward part that scores zeros, embeds every image as ``features[i]`` (a fixed table)
    and records its embed calls."""

    def __init__(self, name: str, features: list[list[float]] | None) -> None:
        self.name, self.calls = name, 0
        if features is not None:
            table = torch.tensor(features)

            def embed(images: torch.Tensor) -> torch.Tensor:
                self.calls += 1
                return table[: images.shape[0]]

            self.embed = embed

    def __call__(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        return torch.zeros(images.shape[0])


# ----------------------------------------------------------------------------- the embedding


def _parts() -> tuple[_Part, _Part, _Part]:
    # one group of 3. "heavy": samples 0 and 1 the same direction, 2 orthogonal to both:
    #   1 - cos: d01 = 0, d02 = d12 = 1 -> pairwise [1/2, 1/2, 1], nn [0, 0, 1]
    # "light": 0 and 2 the same, 1 at 60 degrees to both (cos 1/2):
    #   d02 = 0, d01 = d12 = 1/2 -> pairwise [1/4, 1/2, 1/4], nn [0, 1/2, 0]
    heavy = _Part("heavy", [[1.0, 0.0], [2.0, 0.0], [0.0, 3.0]])
    light = _Part("light", [[1.0, 0.0], [0.5, math.sqrt(3) / 2], [1.0, 0.0]])
    return heavy, light, _Part("blind", None)


def test_the_named_component_is_the_one_whose_embed_is_called():
    images = _toy_images([[1] * 16, [2] * 16, [3] * 16])
    heavy, light, blind = _parts()
    default = CompositeReward([(light, 0.0), (heavy, 1.0), (blind, 5.0)])
    out = reward_diversity(default, images, 3)
    assert (heavy.calls, light.calls) == (1, 0)  # the heaviest that embeds (blind does not)
    torch.testing.assert_close(out[PAIRWISE], torch.tensor([0.5, 0.5, 1.0]), rtol=0, atol=1e-6)
    torch.testing.assert_close(out[NEAREST], torch.tensor([0.0, 0.0, 1.0]), rtol=0, atol=1e-6)

    heavy, light, blind = _parts()
    judged = CompositeReward(
        [(light, 0.0), (heavy, 1.0), (blind, 5.0)], diversity_embedding="light"
    )
    out = reward_diversity(judged, images, 3)
    assert (heavy.calls, light.calls) == (0, 1)
    torch.testing.assert_close(out[PAIRWISE], torch.tensor([0.25, 0.5, 0.25]), rtol=0, atol=1e-6)
    torch.testing.assert_close(out[NEAREST], torch.tensor([0.0, 0.5, 0.0]), rtol=0, atol=1e-6)
    assert not any(k.startswith("diversity_train/") for k in out)
    assert out[DISTINCT].tolist() == [1.0, 1.0, 1.0]  # pixels, whatever the embedding


def test_train_diversity_keeps_its_own_space_beside_the_judges():
    images = _toy_images([[1] * 16, [2] * 16, [3] * 16])
    heavy, light, _ = _parts()
    both = CompositeReward(
        [(heavy, 1.0), (light, 0.0)], diversity_embedding="light", train_embedding="heavy"
    )
    out = reward_diversity(both, images, 3)
    assert (heavy.calls, light.calls) == (1, 1)
    torch.testing.assert_close(out[NEAREST], torch.tensor([0.0, 0.5, 0.0]), rtol=0, atol=1e-6)
    want = torch.tensor([0.0, 0.0, 1.0])
    torch.testing.assert_close(out["diversity_train/nn"], want, rtol=0, atol=1e-6)
    assert "diversity_train/pairwise" in out


def test_a_composite_refuses_a_part_that_does_not_embed():
    heavy, _, blind = _parts()
    with pytest.raises(ValueError, match=r"diversity_embedding='blind' is no reward part"):
        CompositeReward([(heavy, 1.0), (blind, 0.0)], diversity_embedding="blind")
    with pytest.raises(ValueError, match=r"train_embedding='nope' is no reward part"):
        CompositeReward([(heavy, 1.0), (blind, 0.0)], train_embedding="nope")


TWO_TOY = (
    "reward.components=[{kind: toy_rules, args: {name: reward}}, "
    "{kind: toy_rules, weight: 0, args: {name: judge}}]"
)


def test_settings_carry_the_spaces_to_every_reward_built_from_them():
    from maskgrpo_ray.pipeline.build import build_reward_from_settings
    from maskgrpo_ray.pipeline.settings import settings_from_config

    default = settings_from_config(load_config("configs/toy.yaml", []))
    assert (default.reward.diversity_embedding, default.reward.train_embedding) == (None, None)
    assert default.advantage.measure == "diversity/nn"

    judged = ["reward.diversity_embedding=judge", TWO_TOY]
    s = settings_from_config(load_config("configs/toy.yaml", judged))
    assert (s.reward.diversity_embedding, s.reward.train_embedding) == ("judge", None)
    built = build_reward_from_settings(s.reward)
    assert built.diversity_embedding == "judge" and built.train_embedding is None

    # gardo keeps the reward's own space (the heaviest: "reward"), not the judge's
    gardo = judged + ["train.diversity.kind=gardo"]
    s = settings_from_config(load_config("configs/toy.yaml", gardo))
    assert s.reward.train_embedding == "reward"
    assert s.advantage.measure == "diversity_train/nn"
    # ... unless it is told to measure where the judge does: then one set of figures serves
    s = settings_from_config(
        load_config("configs/toy.yaml", gardo + ["train.diversity.embedding=judge"])
    )
    assert s.reward.train_embedding is None and s.advantage.measure == "diversity/nn"
    # naming the heaviest explicitly is the default's space: nothing extra
    s = settings_from_config(
        load_config("configs/toy.yaml", [TWO_TOY, "train.diversity.kind=gardo"])
    )
    assert s.reward.train_embedding is None


@pytest.mark.parametrize(
    ("overrides", "field", "value"),
    [
        (["reward.diversity_embedding=nope"], "reward.diversity_embedding", "nope"),
        (
            [
                "reward.components=[{kind: toy_rules}, {kind: sim_cost, weight: 0}]",
                "reward.diversity_embedding=sim_cost",
            ],
            "reward.diversity_embedding",
            "sim_cost",
        ),
        (
            ["train.diversity.kind=gardo", "train.diversity.embedding=judge"],
            "train.diversity.embedding",
            "judge",
        ),
    ],
)
def test_preflight_refuses_an_unknown_or_blind_component(overrides, field, value):
    from maskgrpo_ray.pipeline.settings import check_diversity_spaces

    cfg = load_config("configs/toy.yaml", overrides)
    with pytest.raises(UserError) as err:
        check_diversity_spaces(cfg)
    msg = str(err.value)
    assert "\n" not in msg and f"{field}={value!r}" in msg, msg
    assert "the components that have one: ['toy_rules']" in msg, msg


def test_a_bad_diversity_embedding_ends_the_cli_in_one_line(tmp_path, capsys):
    from maskgrpo_ray.cli import main

    cfg = ["--set", "reward.diversity_embedding=nope"]
    assert main(["validate", "--config", "configs/toy.yaml", *cfg]) == 2
    assert main(["eval", "--out", str(tmp_path / "e"), "--backend", "local", *cfg]) == 2
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("maskgrpo:")]
    assert len(lines) == 2 and all("reward.diversity_embedding='nope'" in x for x in lines)


# ----------------------------------------------------------------------------- layouts


class _Detector(_Part):
    def __init__(self, keys: list[object]) -> None:
        super().__init__("detector", None)
        self.keys = keys

    def layouts(self, images: torch.Tensor) -> list[object]:
        return self.keys[: images.shape[0]]


def test_layouts_count_the_first_of_each_detected_layout_in_its_group():
    # two groups of 4; pixels all differ, layouts do not:
    # group 0: A, B, A, A -> first A, first B, repeat, repeat: 2 of 4 distinct
    # group 1: A, C, D, C -> A is new in this group (groups are apart): 3 of 4
    keys = ["A", "B", "A", "A", "A", "C", "D", "C"]
    images = _toy_images([[i % 7] + [0] * 15 for i in range(8)])
    out = reward_diversity(CompositeReward([(_Detector(keys), 0.0)]), images, 4)
    assert out[LAYOUTS].tolist() == [1, 1, 0, 0, 1, 1, 1, 0]
    assert out[LAYOUTS].view(2, 4).mean(-1).tolist() == [0.5, 0.75]
    assert out[DISTINCT].tolist() == [1.0] * 8
    assert first_of_kind([], 3).numel() == 0
    broken = _Detector(keys[:3])  # fewer keys than images: the figure is left out, logged
    assert LAYOUTS not in reward_diversity(CompositeReward([(broken, 1.0)]), images, 4)


def test_the_toy_layout_is_its_palette_cells_so_layouts_equal_distinct():
    a, b = [1] + [0] * 15, [0, 1] + [0] * 14
    images = _toy_images([a, b, a, b, b, a])
    r = ToyRuleReward(GRID)
    assert r.layouts(images)[0] == tuple(a) and r.layouts(images)[1] == tuple(b)
    out = group_diversity(images, 3, r.embed, r.layouts)
    # groups (a, b, a) and (b, b, a): first a, first b, repeat; first b, repeat, first a
    assert out[LAYOUTS].tolist() == [1, 1, 0, 1, 0, 1] == out[DISTINCT].tolist()


def test_the_shapes_judge_keys_the_detected_objects_not_the_pixels():
    from maskgrpo_ray.worlds.shapes import scenes
    from maskgrpo_ray.worlds.shapes.policy import WorldSpec
    from maskgrpo_ray.worlds.shapes.rewards import ShapesJudgeReward

    w = WorldSpec()
    one = [scenes.Obj("circle", "red", 0, 0, 2)]
    moved = [scenes.Obj("circle", "red", 0, 3, 2)]
    two = [*one, scenes.Obj("square", "blue", 4, 4, 3)]
    pics = np.stack([scenes.render(o, w.grid, w.patch_px) for o in (one, moved, one, two)])
    images = torch.from_numpy(pics)
    holed = images[2].clone()  # the circle's box is pixels 1-6: one pixel inside it lost,
    holed[3, 3] = torch.tensor(scenes.PALETTE[0])  # which the detector tolerates
    images = torch.cat([images, holed[None]])
    r = ShapesJudgeReward(w.patch_px)
    keys = r.layouts(images)
    assert keys[0] == keys[2] != keys[1] and len(keys[3]) == 2
    assert keys[0] == (("circle", "red", (1, 1, 6, 6)),)
    assert not torch.equal(images[4], images[2]) and keys[4] == keys[2]
    out = reward_diversity(CompositeReward([(r, 0.0)]), images, 5)
    assert out[LAYOUTS].tolist() == [1, 1, 0, 1, 0]  # 3 layouts among 5 images
    assert out[DISTINCT].tolist() == [1, 1, 0, 1, 1]  # 4 distinct images


# ----------------------------------------------------------------------------- the ceiling


@pytest.mark.parametrize(("m", "n"), [(1, 1), (1, 4), (2, 3), (3, 4), (4, 2), (5, 5)])
def test_expected_distinct_fraction_is_the_mean_over_every_draw(m, n):
    # every one of the m^n equally likely sequences of n draws from m values, exactly
    total = sum(Fraction(len(set(seq)), n) for seq in itertools.product(range(m), repeat=n))
    assert expected_distinct_fraction(m, n) == pytest.approx(float(total / m**n), abs=1e-12)


def test_expected_distinct_fraction_limits():
    assert expected_distinct_fraction(1, 32) == 1 / 32  # one correct image, drawn 32 times
    assert expected_distinct_fraction(10**9, 32) == pytest.approx(1.0, abs=1e-6)
    with pytest.raises(ValueError):
        expected_distinct_fraction(0, 32)


def _count_correct(grid: int, cap: toyworld.Caption, colours: tuple[int, ...]) -> int:
    """Every grid of ``colours`` decoded to pixels and judged by the toy reward."""
    cells = torch.tensor(list(itertools.product(colours, repeat=grid * grid)))
    images = toyworld.decode_palette(cells, grid, 1)
    return int(judge(images, [cap.text] * len(cells), grid)["correct"].sum())


def test_correct_layouts_count_every_correct_image_of_a_small_grid():
    every_colour = tuple(range(len(toyworld.PALETTE)))
    for count, position in itertools.product(range(1, 5), toyworld.POSITIONS):
        cap = toyworld.Caption(count, 2, position)  # 2x2: a half holds 2 cells, all 7^4 grids
        assert toyworld.correct_layouts(cap, 2) == _count_correct(2, cap, every_colour)
    for count, position in itertools.product(range(1, 5), toyworld.POSITIONS):
        cap = toyworld.Caption(count, 4, position)  # 3x3: halves of 3 and 6 cells
        want = _count_correct(3, cap, (0, 4))  # (another colour is never correct: above)
        assert toyworld.correct_layouts(cap, 3) == want, (cap, want)
    cap = toyworld.Caption(2, 3, "top")  # the default 4x4 grid: C(8, 2) = 28
    assert toyworld.correct_layouts(cap, 4) == _count_correct(4, cap, (0, 3)) == 28


def test_the_toy_eval_ceiling_is_the_mean_over_its_prompts():
    from maskgrpo_ray.evaluation.generation import ceiling_figures
    from maskgrpo_ray.worlds.toy.model import toy_prompt_metadata, toy_prompts

    cfg = load_config("configs/toy.yaml", [])
    prompts = toy_prompts("eval")
    # a k-dot caption has C(8, k) correct images on the 4x4 grid: 8, 28, 56, 70
    per_count = {k: expected_distinct_fraction(m, 32) for k, m in zip(range(1, 5), (8, 28, 56, 70))}
    counts = [toyworld.Caption.parse(p).count for p in prompts]
    tags = [str(toy_prompt_metadata(p)["tag"]) for p in prompts]
    got = ceiling_figures(cfg.model, prompts, 32, tags)
    want = sum(per_count[k] for k in counts) / len(counts)
    assert got["eval_diversity/distinct_ceiling"] == pytest.approx(want, rel=1e-6)
    assert got["eval_diversity/distinct_ceiling/single_object"] == pytest.approx(
        per_count[1], rel=1e-6
    )  # the one-dot prompts: at most 8 of 32 distinct, 0.2465 expected
    assert per_count[1] == pytest.approx(0.2465, abs=1e-4)
    shapes = load_config("configs/toy.yaml", ["model.kind=shapes"]).model
    assert ceiling_figures(shapes, prompts, 32) == {}  # a world that does not count: nothing
