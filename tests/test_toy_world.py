"""The toy world: grammar, scenes, the palette round trip and the pixel rule reward."""

from __future__ import annotations

import pytest
import torch

from maskgrpo_ray.prompts.loading import PromptStream, keep_valid_prompts, load_prompts
from maskgrpo_ray.worlds.toy import world as toyworld
from maskgrpo_ray.worlds.toy.rewards import ToyRuleReward, judge
from maskgrpo_ray.worlds.toy.world import Caption


def test_caption_round_trip_and_bad_prompt():
    for cap in toyworld.all_captions():
        assert Caption.parse(cap.text) == cap
    with pytest.raises(ValueError, match="not of the toy grammar"):
        Caption.parse("a photo of a cat")


def test_split_is_disjoint_and_deterministic():
    train, held = toyworld.split_captions()
    assert len(train) == 72 and len(held) == 24 and not set(train) & set(held)
    assert toyworld.split_captions() == (train, held)


@pytest.mark.parametrize("grid", [4, 8])
def test_rule_reward_on_rendered_scenes(grid):
    g = torch.Generator().manual_seed(0)
    caps = toyworld.all_captions()[::5]
    for corrupt, expect in ((None, 1.0), ("count", 0.0), ("place", 0.0), ("extra", 0.0)):
        scenes = torch.stack([toyworld.render_scene(c, grid, g, corrupt).view(-1) for c in caps])
        images = toyworld.decode_palette(scenes, grid, cell_px=3)
        j = judge(images, [c.text for c in caps], grid)
        if corrupt == "place":  # a misplaced dot fails position but keeps count and colour
            assert (j["count_ok"] == 1).all() and (j["position_ok"] == 0).all()
        assert (j["correct"] == expect).all(), corrupt


def test_rule_reward_values_and_nan_for_bad_prompt():
    grid = 4
    scene = torch.zeros(1, grid * grid, dtype=torch.long)
    scene[0, 0] = 1  # one red dot at top-left
    images = toyworld.decode_palette(scene.repeat(3, 1), grid, 8)
    r = ToyRuleReward(grid)(
        images, ["one red dot on the left", "two red dots on the left", "no such prompt"]
    )
    assert float(r[0]) == pytest.approx(2.0)  # (1 + 1 + 1)/3 + 1 (correct)
    assert float(r[1]) == pytest.approx((0.5 + 1 + 1) / 3)  # one dot short: count term 0.5
    assert torch.isnan(r[2])


def test_pixels_survive_small_noise():
    grid = 4
    g = torch.Generator().manual_seed(1)
    scenes = torch.randint(0, len(toyworld.PALETTE), (5, grid * grid), generator=g)
    images = toyworld.decode_palette(scenes, grid, 8).int()
    noisy = (
        (images + torch.randint(-20, 21, images.shape, generator=g)).clamp(0, 255).to(torch.uint8)
    )
    assert torch.equal(toyworld.pixels_to_cells(noisy, grid).view(5, -1), scenes)


def test_prompt_stream_is_deterministic_and_resumable():
    prompts = load_prompts("toy")
    a = PromptStream(prompts, seed=3)
    first = a.take(100)[0]
    b = PromptStream(prompts, seed=3)
    b.take(40)
    c = PromptStream(prompts, seed=3)
    c.load_state_dict(b.state_dict())
    assert c.take(60)[0] == first[40:]
    # one epoch covers every prompt once
    assert sorted(PromptStream(prompts, seed=0).take(len(prompts))[0]) == sorted(prompts)


def test_prompt_files(tmp_path):
    (tmp_path / "p.txt").write_text("a cat\n\na dog\n")
    (tmp_path / "p.json").write_text('[{"caption": "a cat"}, "a dog"]')
    (tmp_path / "p.jsonl").write_text('{"prompt": "a cat"}\n"a dog"\n')
    for name in ("p.txt", "p.json", "p.jsonl"):
        assert load_prompts(str(tmp_path / name)) == ["a cat", "a dog"]
    with pytest.raises(FileNotFoundError, match="data.prompts"):
        load_prompts(str(tmp_path / "missing.txt"))


def test_bad_prompts_are_counted_and_skipped():
    valid, bad = keep_valid_prompts(["one red dot on the left", "hello world"], Caption.parse)
    assert valid == ["one red dot on the left"] and bad == 1
