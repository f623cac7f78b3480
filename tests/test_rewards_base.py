"""Reward contract, weighted composition, factory registry, batched preprocessing."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import numpy as np
import pytest
import torch

from maskgrpo_ray.rewards import base, weights
from maskgrpo_ray.rewards.base import (
    CompositeReward,
    Reward,
    RewardSpec,
    build_reward,
    check_reward_inputs,
    register_reward,
    reward_stats,
)
from maskgrpo_ray.rewards.preprocess import ImagePreprocess, pixels_from_uint8


class MeanPixel:
    """Reward = mean pixel value / 255 + scale * len(prompt): easy to derive by hand."""

    def __init__(self, scale: float = 0.0, name: str = "mean_pixel", device=None) -> None:
        self.name, self.scale, self.device, self.calls = name, scale, device, 0

    def __call__(self, images, prompts):
        self.calls += 1
        lengths = torch.tensor([len(p) for p in prompts], dtype=torch.float32)
        return images.float().mean(dim=(1, 2, 3)) / 255.0 + self.scale * lengths

    def stats(self):
        return {"calls": float(self.calls)}


@pytest.fixture
def registry(monkeypatch):
    """A private copy of the registry with two test kinds."""
    monkeypatch.setattr(base, "REWARD_REGISTRY", dict(base.REWARD_REGISTRY))
    monkeypatch.setattr(base, "_TAKES_DEVICE", set(base._TAKES_DEVICE))
    register_reward("mean_pixel")(MeanPixel)
    register_reward("mean_pixel_dev", takes_device=True)(MeanPixel)
    return base.REWARD_REGISTRY


def _images(values):
    """One constant image per value: mean pixel / 255 = value / 255."""
    return torch.stack([torch.full((4, 5, 3), v, dtype=torch.uint8) for v in values])


def test_reward_protocol_is_structural():
    assert isinstance(MeanPixel(), Reward)
    assert not isinstance(object(), Reward)


def test_composite_is_the_weighted_sum_and_reports_each_part():
    # images 0 and 255 -> a = [0, 1]; prompts "ab", "abcd" -> b = 0.5 * [2, 4] + a = [1, 3]
    # total = 2 * a - 0.5 * b = [0 - 0.5, 2 - 1.5] = [-0.5, 0.5]
    a, b = MeanPixel(name="a"), MeanPixel(scale=0.5, name="b")
    composite = CompositeReward([(a, 2.0), (b, -0.5)])
    total, parts = composite.score(_images([0, 255]), ["ab", "abcd"])
    torch.testing.assert_close(parts["a"], torch.tensor([0.0, 1.0]), rtol=0, atol=1e-6)
    torch.testing.assert_close(parts["b"], torch.tensor([1.0, 3.0]), rtol=0, atol=1e-6)
    torch.testing.assert_close(total, torch.tensor([-0.5, 0.5]), rtol=0, atol=1e-6)
    assert total.dtype == torch.float32
    torch.testing.assert_close(composite(_images([0, 255]), ["ab", "abcd"]), total)
    assert composite.stats() == {"a/calls": 2.0, "b/calls": 2.0}
    assert composite.weights == {"a": 2.0, "b": -0.5}


def test_composite_rejects_repeated_names_and_empty():
    with pytest.raises(ValueError, match="distinct"):
        CompositeReward([(MeanPixel(), 1.0), (MeanPixel(), 1.0)])
    with pytest.raises(ValueError, match="at least one"):
        CompositeReward([])


def test_build_reward_from_specs_and_tuples(registry):
    composite = build_reward(
        [
            RewardSpec("mean_pixel", 1.0),
            ("mean_pixel", 3.0, {"scale": 1.0, "name": "with_len"}),
            RewardSpec("mean_pixel_dev", 0.0, name="dev"),
        ],
        device="cpu",
    )
    assert list(composite.rewards) == ["mean_pixel", "with_len", "dev"]
    assert composite.rewards["dev"].device == "cpu"  # passed only to kinds that take it
    assert composite.rewards["mean_pixel"].device is None
    # image 255, prompt "xyz": 1 * 1 + 3 * (1 + 3) + 0 = 13
    torch.testing.assert_close(composite(_images([255]), ["xyz"]), torch.tensor([13.0]))


def test_build_reward_unknown_kind_names_the_known_ones(registry):
    with pytest.raises(ValueError, match=r"unknown reward kind 'nope'.*mean_pixel"):
        build_reward([("nope", 1.0, {})])


def test_register_twice_is_an_error(registry):
    with pytest.raises(ValueError, match="registered twice"):
        register_reward("mean_pixel")(lambda **kw: MeanPixel())


def test_builtin_kinds_register_on_first_use():
    from maskgrpo_ray.rewards.base import _factory
    from maskgrpo_ray.rewards.clip import ClipReward

    assert _factory("clip") is ClipReward
    assert "clip" in base._TAKES_DEVICE


@pytest.mark.parametrize(
    "images, prompts, match",
    [
        (torch.zeros(2, 4, 4, 3), ["a", "b"], "uint8"),
        (torch.zeros(2, 3, 4, 4, dtype=torch.uint8), ["a", "b"], "channels last"),
        (torch.zeros(2, 4, 4, 3, dtype=torch.uint8), ["a"], "2 images, 1 prompts"),
        (torch.zeros(1, 4, 4, 3, dtype=torch.uint8), "a", "single str"),
    ],
)
def test_check_reward_inputs(images, prompts, match):
    with pytest.raises(ValueError, match=match):
        check_reward_inputs(images, prompts)


def test_reward_stats_without_stats_is_empty():
    assert reward_stats(lambda images, prompts: None) == {}


def test_hf_hub_offline_reads_the_environment(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert weights.hf_hub_offline()


def _open_clip_pil(images, size=224):
    import open_clip
    from PIL import Image

    transform = open_clip.image_transform(size, is_train=False)
    return torch.stack([transform(Image.fromarray(a)) for a in images.numpy()])


@pytest.mark.parametrize("height, width", [(224, 224), (512, 512), (300, 500), (96, 64)])
def test_tensor_preprocessing_matches_open_clip_pil_transform(height, width):
    rng = np.random.default_rng(0)
    images = torch.from_numpy(rng.integers(0, 256, (3, height, width, 3), dtype=np.uint8))
    ours = pixels_from_uint8(images, ImagePreprocess())
    ref = _open_clip_pil(images)
    assert ours.shape == ref.shape == (3, 3, 224, 224)
    # Differences in uint8 levels: both round the resized image to uint8; torchvision's tensor
    # kernel is PIL's antialiased bicubic, so they differ by at most one level at a few pixels
    # (two when upsampling, where the cubic overshoots are clamped differently).
    std = torch.tensor(ImagePreprocess().std).view(1, 3, 1, 1)
    levels = ((ours - ref) * std * 255).abs()
    if (height, width) == (224, 224):
        assert levels.max() < 1e-3  # no resize: only float rounding
    else:
        assert levels.max() <= 2.0 + 1e-3
        assert levels.mean() < 0.02


def test_squash_preprocessing_resizes_without_crop():
    images = torch.zeros(1, 10, 20, 3, dtype=torch.uint8)
    images[:, :, 10:] = 255  # right half white
    cfg = ImagePreprocess(size=(8, 8), resize_mode="squash", mean=(0, 0, 0), std=(1, 1, 1))
    pixels = pixels_from_uint8(images, cfg)  # [1, 3, 8, 8], the whole width kept
    assert pixels[0, 0, 0, 0] == 0.0 and pixels[0, 0, 0, -1] == 1.0
    shortest = pixels_from_uint8(images, ImagePreprocess(size=(8, 8), mean=(0,) * 3, std=(1,) * 3))
    assert shortest.shape == (1, 3, 8, 8)  # centre crop of the 8 x 16 resize: a half-and-half
    assert shortest[0, 0, 0, 0] == 0.0 and shortest[0, 0, 0, -1] == 1.0


def test_preprocess_config_is_checked():
    with pytest.raises(ValueError, match="resize_mode"):
        ImagePreprocess(resize_mode="longest")
    with pytest.raises(ValueError, match="square"):
        ImagePreprocess(size=(224, 256))
