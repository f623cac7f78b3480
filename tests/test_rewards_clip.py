"""CLIP reward on a tiny open_clip config with random weights (the real ClipReward code path)."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import open_clip
import pytest
import torch
from open_clip.pretrained import _pcfg

from maskgrpo_ray.rewards.clip import ClipReward
from maskgrpo_ray.rewards.tiny import register_tiny_clip
from maskgrpo_ray.rewards.weights import RewardWeightsMissingError

LONG = "a photo of " + "a red cat and a blue dog on a green tree, " * 12  # ~ 150 tokens
PROMPTS = ["a red cat", "a red cat", "two blue dogs", LONG]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return register_tiny_clip(str(tmp_path_factory.mktemp("clip_cfg")))


@pytest.fixture(scope="module")
def reward(tiny):
    torch.manual_seed(0)
    return ClipReward(tiny, None, device="cpu", preprocess="pil")


@pytest.fixture(scope="module")
def images():
    generator = torch.Generator().manual_seed(1)
    return torch.randint(0, 256, (4, 256, 256, 3), dtype=torch.uint8, generator=generator)


def _direct(model, images, prompts, tokenizer):
    """logits_per_image of the same model, computed as the official code does, diagonal kept."""
    from PIL import Image

    transform = open_clip.image_transform(224, is_train=False)
    pixels = torch.stack([transform(Image.fromarray(a)) for a in images.numpy()])
    with torch.no_grad():
        image_f, text_f, scale = model(pixels, tokenizer(prompts))  # normalised features
    logits_per_image = scale * image_f @ text_f.T  # [N, N]
    return logits_per_image.diagonal(), (image_f * text_f).sum(-1)


def test_score_is_logit_scale_times_cosine(reward, images):
    scores = reward(images, PROMPTS)
    assert scores.shape == (4,) and scores.dtype == torch.float32 and scores.device.type == "cpu"
    logits, cosine = _direct(reward.model, images, PROMPTS, reward.tokenizer)
    torch.testing.assert_close(scores, logits, rtol=1e-5, atol=1e-5)
    # random init: logit_scale = log(1 / 0.07), so the score is cosine / 0.07
    torch.testing.assert_close(scores, cosine / 0.07, rtol=1e-4, atol=1e-5)
    assert torch.unique(scores).numel() == 4  # images differ, so scores do


def test_cosine_option(tiny, reward, images):
    cosine_reward = ClipReward(tiny, None, device="cpu", preprocess="pil", score="cosine")
    cosine_reward.model.load_state_dict(reward.model.state_dict())
    torch.testing.assert_close(
        cosine_reward(images, PROMPTS) * reward.model.logit_scale.exp(),
        reward(images, PROMPTS),
        rtol=1e-5,
        atol=1e-5,
    )


def test_deterministic_across_calls_and_builds(tiny, reward, images):
    torch.testing.assert_close(reward(images, PROMPTS), reward(images, PROMPTS), rtol=0, atol=0)
    torch.manual_seed(0)
    again = ClipReward(tiny, None, device="cpu", preprocess="pil")
    torch.testing.assert_close(again(images, PROMPTS), reward(images, PROMPTS), rtol=0, atol=0)


def test_batched_equals_one_at_a_time(tiny, reward, images):
    # loop over single images vs one batch with deduplicated prompts and chunks of 3
    one_by_one = torch.cat([reward(images[i : i + 1], PROMPTS[i : i + 1]) for i in range(4)])
    chunked = ClipReward(tiny, None, device="cpu", preprocess="pil", batch_size=3)
    chunked.model.load_state_dict(reward.model.state_dict())
    torch.testing.assert_close(chunked(images, PROMPTS), one_by_one, rtol=1e-5, atol=1e-5)


def test_tensor_preprocessing_scores_close_to_pil(tiny, reward, images):
    fast = ClipReward(tiny, None, device="cpu", preprocess="tensor")
    fast.model.load_state_dict(reward.model.state_dict())
    # pixels differ by <= 1/255 at a few places (test_rewards_base); scores of ~cos/0.07 move
    # by far less than the spread between images
    diff = (fast(images, PROMPTS) - reward(images, PROMPTS)).abs().max()
    assert diff < 5e-3


def test_empty_batch_scores_nothing(reward):
    scores = reward(torch.zeros(0, 64, 64, 3, dtype=torch.uint8), [])
    assert scores.shape == (0,) and scores.dtype == torch.float32


def test_long_prompts_are_truncated_and_counted(tiny, images):
    torch.manual_seed(0)
    counted = ClipReward(tiny, None, device="cpu")
    assert len(counted.tokenizer.encode(LONG)) + 2 > 77
    before = counted.stats()["prompts_truncated"]
    scores = counted(images, PROMPTS)
    counted(images[:2], [LONG, LONG])
    assert counted.stats() == {"prompts_scored": 6.0, "prompts_truncated": before + 3.0}
    # a truncated prompt scores as its first 76 tokens + end token
    cut_ids = counted.tokenizer.encode(LONG)[:75]
    cut = counted.tokenizer.decode(cut_ids)
    assert counted.count_truncated([cut]) == 0
    torch.testing.assert_close(counted(images[3:], [cut]), scores[3:], rtol=1e-4, atol=1e-4)


def test_missing_official_weights_fail_at_construction_with_the_file_name(tmp_path):
    with pytest.raises(RewardWeightsMissingError) as err:
        ClipReward(cache_dir=str(tmp_path))  # the default: ViT-H-14 / laion2b_s32b_b79k
    message = str(err.value)
    assert "laion/CLIP-ViT-H-14-laion2B-s32B-b79K/open_clip_pytorch_model.bin" in message
    assert str(tmp_path) in message and "MASKGRPO_ALLOW_DOWNLOADS" in message


def test_no_download_unless_asked_even_with_the_hub_online(tmp_path, monkeypatch):
    """Hub reachable (HF_HUB_OFFLINE off) but no MASKGRPO_ALLOW_DOWNLOADS: missing weights fail
    at construction, before open_clip is asked for anything; with the flag, the download is
    what happens (open_clip's own downloader is called, here a stand-in that records it)."""
    from maskgrpo_ray.rewards import weights

    monkeypatch.setattr(weights, "hf_hub_offline", lambda: False)
    monkeypatch.delenv("MASKGRPO_ALLOW_DOWNLOADS", raising=False)
    asked: list[str] = []

    def create_model(*args, **kwargs):
        asked.append(str(kwargs.get("pretrained")))
        raise RuntimeError("stand-in: no network in tests")

    monkeypatch.setattr(open_clip, "create_model", create_model)
    with pytest.raises(RewardWeightsMissingError, match="MASKGRPO_ALLOW_DOWNLOADS"):
        ClipReward(cache_dir=str(tmp_path))
    assert asked == []
    monkeypatch.setenv("MASKGRPO_ALLOW_DOWNLOADS", "1")
    with pytest.raises(RuntimeError, match="stand-in"):
        ClipReward(cache_dir=str(tmp_path))
    assert asked == ["laion2b_s32b_b79k"]  # the tag: open_clip fetches it from the hub


def test_missing_local_checkpoint_names_the_path(tiny, tmp_path):
    missing = tmp_path / "clip.safetensors"
    with pytest.raises(RewardWeightsMissingError, match="clip.safetensors"):
        ClipReward(tiny, str(missing), device="cpu")


def test_local_checkpoint_file_loads(tiny, reward, images, tmp_path):
    path = tmp_path / "tiny.pt"
    torch.save(reward.model.state_dict(), path)
    loaded = ClipReward(tiny, str(path), device="cpu", preprocess="pil")
    torch.testing.assert_close(loaded(images, PROMPTS), reward(images, PROMPTS), rtol=0, atol=0)


def _fake_hf_cache(cache, repo_id, filename, payload_path):
    """The Hugging Face cache layout: models--org--name/{refs/main, snapshots/<rev>/<file>}."""
    folder = cache / ("models--" + repo_id.replace("/", "--"))
    revision = "0" * 40
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text(revision)
    (folder / "snapshots" / revision).mkdir(parents=True)
    os.link(payload_path, folder / "snapshots" / revision / filename)


def test_pretrained_tag_found_in_hf_cache(tiny, reward, images, tmp_path, monkeypatch):
    tags = {"testtag": _pcfg(hf_hub="test-org/tiny-clip/", quick_gelu=False)}
    monkeypatch.setitem(open_clip.pretrained._PRETRAINED, tiny, tags)
    with pytest.raises(RewardWeightsMissingError, match="test-org/tiny-clip"):
        ClipReward(tiny, "testtag", device="cpu", cache_dir=str(tmp_path / "cache"))
    weights = tmp_path / "w.bin"
    torch.save(reward.model.state_dict(), weights)
    _fake_hf_cache(tmp_path / "cache", "test-org/tiny-clip", "open_clip_pytorch_model.bin", weights)
    cached = ClipReward(
        tiny, "testtag", device="cpu", preprocess="pil", cache_dir=str(tmp_path / "cache")
    )
    torch.testing.assert_close(cached(images, PROMPTS), reward(images, PROMPTS), rtol=0, atol=0)


def test_hub_and_local_dir_models_fail_at_construction(tmp_path):
    with pytest.raises(RewardWeightsMissingError, match="no-org/no-model/open_clip_config.json"):
        ClipReward("hf-hub:no-org/no-model", device="cpu", cache_dir=str(tmp_path))
    with pytest.raises(RewardWeightsMissingError, match="open_clip_config.json"):
        ClipReward(f"local-dir:{tmp_path}", device="cpu")


def test_unknown_tag_lists_the_known_ones():
    with pytest.raises(RewardWeightsMissingError, match="laion2b_s34b_b79k"):
        ClipReward("ViT-B-32", "no-such-tag", device="cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_bf16_close_to_cpu_fp32(tiny, reward, images):
    gpu = ClipReward(tiny, None, device="cuda")
    gpu.model.load_state_dict(reward.model.state_dict())
    assert gpu.dtype == torch.bfloat16
    fast_cpu = ClipReward(tiny, None, device="cpu")
    fast_cpu.model.load_state_dict(reward.model.state_dict())
    scores = gpu(images, PROMPTS)
    assert scores.device.type == "cpu" and scores.dtype == torch.float32
    torch.testing.assert_close(scores, fast_cpu(images, PROMPTS), rtol=0.05, atol=0.05)


def test_embed_is_the_normalised_image_features_the_score_uses(reward, images):
    """The diversity embedding (``maskgrpo_ray.algo.diversity``): the same image features the
    score takes the cosine of, normalised."""
    feats = reward.embed(images)
    assert feats.shape[0] == 4 and feats.device.type == "cpu"
    torch.testing.assert_close(feats.norm(dim=-1), torch.ones(4), rtol=1e-5, atol=1e-5)
    text = reward.model.encode_text(reward.tokenizer(["a red cat"]), normalize=True).float()
    cos = (feats[:2] * text).sum(-1)
    torch.testing.assert_close(
        cos / 0.07, reward(images[:2], ["a red cat"] * 2), rtol=1e-4, atol=1e-4
    )
