"""ImageReward reward from the image-reward package's own classes, on a tiny random configuration."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import dataclasses
import subprocess
import sys
import warnings

import pytest
import torch
from PIL import Image

from maskgrpo_ray.rewards import _imagereward_compat as compat
from maskgrpo_ray.rewards.base import build_reward
from maskgrpo_ray.rewards.imagereward import MAX_PROMPT_TOKENS, ImageRewardReward
from maskgrpo_ray.rewards.tiny import (
    register_tiny_clip,
    spread_imagereward_head,
    tiny_imagereward_kwargs,
)
from maskgrpo_ray.rewards.weights import RewardWeightsMissingError

LONG = "a photo of a red cat with two blue dogs on a green tree and a yellow car " * 3
PROMPTS = ["a red cat", "a red cat", "two blue dogs", LONG]


@pytest.fixture(scope="module")
def tiny_kwargs(tmp_path_factory):
    return tiny_imagereward_kwargs(str(tmp_path_factory.mktemp("ir_tokenizer")))


def _build(tiny_kwargs, **overrides):
    torch.manual_seed(0)
    reward = ImageRewardReward(**{**tiny_kwargs, "device": "cpu", **overrides})
    spread_imagereward_head(reward)
    return reward


@pytest.fixture(scope="module")
def reward(tiny_kwargs):
    return _build(tiny_kwargs, preprocess="pil")


@pytest.fixture(scope="module")
def images():
    generator = torch.Generator().manual_seed(1)
    return torch.randint(0, 256, (4, 256, 256, 3), dtype=torch.uint8, generator=generator)


def test_batched_scores_equal_the_package_own_per_image_scoring(reward, images):
    scores = reward(images, PROMPTS)
    assert scores.shape == (4,) and scores.dtype == torch.float32
    # ImageReward.score(prompt, [PIL, ...]) runs one image at a time (inference_rank)
    pil = [Image.fromarray(a) for a in images.numpy()]
    with torch.no_grad():
        expected = [reward.model.score(p, [im, im])[0] for p, im in zip(PROMPTS, pil)]
    torch.testing.assert_close(scores, torch.tensor(expected), rtol=1e-5, atol=1e-5)
    assert torch.unique(scores).numel() == 4


def test_score_formula_is_the_normalised_mlp_of_the_text_cls(reward, images):
    # r = (MLP(BERT(text | ViT(image))[:, 0]) - mean) / std, with ImageReward's constants
    model = reward.model
    text = reward.tokenizer(
        PROMPTS, padding="max_length", truncation=True, max_length=35, return_tensors="pt"
    )
    with torch.no_grad():
        embeds = model.blip.visual_encoder(reward.pixels(images))  # [N, 1 + 196, 32]
        out = model.blip.text_encoder(
            text.input_ids,
            attention_mask=text.attention_mask,
            encoder_hidden_states=embeds,
            encoder_attention_mask=torch.ones(embeds.shape[:2], dtype=torch.long),
            return_dict=True,
        )
        raw = model.mlp(out.last_hidden_state[:, 0, :]).squeeze(-1)
    expected = (raw - 0.16717362830052426) / 1.0333394966054072
    torch.testing.assert_close(reward(images, PROMPTS), expected, rtol=1e-5, atol=1e-5)


def test_deterministic_and_batch_size_independent(tiny_kwargs, reward, images):
    torch.testing.assert_close(reward(images, PROMPTS), reward(images, PROMPTS), rtol=0, atol=0)
    chunked = _build(tiny_kwargs, preprocess="pil", batch_size=3)
    torch.testing.assert_close(chunked(images, PROMPTS), reward(images, PROMPTS))


def test_tensor_preprocessing_scores_close_to_pil(tiny_kwargs, reward, images):
    fast = _build(tiny_kwargs)  # same seed, same weights
    diff = (fast(images, PROMPTS) - reward(images, PROMPTS)).abs().max()
    spread = reward(images, PROMPTS).std()
    assert diff < 0.01 * spread


def test_prompts_over_35_tokens_are_cut_and_counted(tiny_kwargs, images):
    counted = _build(tiny_kwargs)
    ids = counted.tokenizer(LONG)["input_ids"]
    assert len(ids) > MAX_PROMPT_TOKENS
    scores = counted(images, PROMPTS)
    assert counted.stats() == {"prompts_scored": 4.0, "prompts_truncated": 1.0}
    # the cut prompt scores as its first 33 word pieces between [CLS] and [SEP]
    cut = counted.tokenizer.decode(ids[1 : MAX_PROMPT_TOKENS - 1])
    assert counted.count_truncated([cut]) == 0
    torch.testing.assert_close(counted(images[3:], [cut]), scores[3:], rtol=1e-5, atol=1e-5)


def test_empty_batch_scores_nothing(reward):
    scores = reward(torch.zeros(0, 64, 64, 3, dtype=torch.uint8), [])
    assert scores.shape == (0,) and scores.dtype == torch.float32


def test_checkpoint_file_round_trip(tiny_kwargs, reward, images, tmp_path):
    path = tmp_path / "ImageReward.pt"
    torch.save(reward.model.state_dict(), path)
    torch.manual_seed(123)  # different random init, overwritten by the checkpoint
    loaded = ImageRewardReward(
        **{**tiny_kwargs, "checkpoint": str(path), "device": "cpu", "preprocess": "pil"}
    )
    torch.testing.assert_close(loaded(images, PROMPTS), reward(images, PROMPTS), rtol=0, atol=0)


def test_a_checkpoint_without_the_scoring_weights_is_rejected(tiny_kwargs, reward, tmp_path):
    path = tmp_path / "partial.pt"
    state = {k: v for k, v in reward.model.state_dict().items() if not k.startswith("mlp.")}
    torch.save(state, path)
    with pytest.raises(ValueError, match="mlp.layers"):
        ImageRewardReward(**{**tiny_kwargs, "checkpoint": str(path), "device": "cpu"})


def test_missing_weights_fail_at_construction_with_the_file_name(tiny_kwargs, tmp_path):
    with pytest.raises(RewardWeightsMissingError) as err:
        ImageRewardReward(
            **{**tiny_kwargs, "checkpoint": "ImageReward-v1.0"},
            download_root=str(tmp_path / "ir"),
            cache_dir=str(tmp_path / "hf"),
        )
    message = str(err.value)
    assert "'ImageReward.pt'" in message and "THUDM/ImageReward" in message
    assert str(tmp_path / "ir" / "ImageReward.pt") in message
    assert "MASKGRPO_ALLOW_DOWNLOADS" in message
    with pytest.raises(RewardWeightsMissingError, match="no/such/ImageReward.pt"):
        ImageRewardReward(**{**tiny_kwargs, "checkpoint": "no/such/ImageReward.pt"})


def test_missing_tokenizer_names_vocab_txt(tiny_kwargs, tmp_path):
    with pytest.raises(RewardWeightsMissingError, match=r"bert-base-uncased/vocab.txt"):
        ImageRewardReward(
            **{**tiny_kwargs, "tokenizer": "bert-base-uncased"}, cache_dir=str(tmp_path)
        )
    with pytest.raises(RewardWeightsMissingError, match="vocab.txt"):
        ImageRewardReward(**{**tiny_kwargs, "tokenizer": str(tmp_path)})


def test_composition_of_clip_and_imagereward_from_the_factory(tiny_kwargs, images, tmp_path):
    clip_kwargs = {"model_name": register_tiny_clip(str(tmp_path)), "pretrained": None}
    ir_kwargs = {**tiny_kwargs, "vision": dataclasses.asdict(tiny_kwargs["vision"])}  # as YAML
    torch.manual_seed(0)
    composite = build_reward(
        [("clip", 0.25, clip_kwargs), ("imagereward", 2.0, ir_kwargs)], device="cpu"
    )
    spread_imagereward_head(composite.rewards["imagereward"])
    total, parts = composite.score(images, PROMPTS)
    clip_scores = composite.rewards["clip"](images, PROMPTS)
    ir_scores = composite.rewards["imagereward"](images, PROMPTS)
    torch.testing.assert_close(parts["clip"], clip_scores, rtol=0, atol=0)
    torch.testing.assert_close(parts["imagereward"], ir_scores, rtol=0, atol=0)
    torch.testing.assert_close(total, 0.25 * clip_scores + 2.0 * ir_scores, rtol=1e-6, atol=1e-6)
    assert composite.stats()["imagereward/prompts_truncated"] == 2.0  # LONG, scored twice


# ----------------------------------------------------------------------------- the shim


def test_shim_attention_mask_and_head_mask():
    class Fake:
        dtype = torch.float32

    mask = torch.tensor([[1, 0, 1]])
    extended = compat._invert_attention_mask(Fake(), mask)  # keep -> 0, drop -> most negative
    assert extended.shape == (1, 1, 1, 3)
    assert extended.flatten().tolist() == [0.0, torch.finfo(torch.float32).min, 0.0]
    assert compat._get_head_mask(Fake(), None, 3) == [None, None, None]
    with pytest.raises(NotImplementedError):
        compat._get_head_mask(Fake(), torch.ones(2), 3)


def test_shim_patches_only_what_is_missing(reward):
    import transformers.modeling_utils as modeling_utils
    import transformers.pytorch_utils as pytorch_utils

    assert modeling_utils.apply_chunking_to_forward is pytorch_utils.apply_chunking_to_forward
    assert compat._patch_transformers_helpers() == []  # already there: nothing patched again


def test_shim_announces_itself_and_leaves_global_state_alone():
    code = (
        "import logging, sys, warnings, transformers, transformers.modeling_utils\n"
        # what transformers itself loads (it imports accelerate when installed: peft needs it)
        "before = set(sys.modules)\n"
        "logging.basicConfig(level=logging.WARNING)\n"
        "verbosity = transformers.logging.get_verbosity()\n"
        "from maskgrpo_ray.rewards._imagereward_compat import import_imagereward\n"
        "ir = import_imagereward()\n"
        "assert ir.ImageReward.__name__ == 'ImageReward'\n"
        # blip.py runs warnings.filterwarnings("ignore"): that catch-all must not outlive import
        "assert ('ignore', None, Warning, None, 0) not in warnings.filters, 'warnings off'\n"
        "assert transformers.logging.get_verbosity() == verbosity, 'verbosity changed'\n"
        "heavy = [m for m in ('diffusers', 'datasets', 'accelerate', 'clip')\n"
        "         if m in sys.modules and m not in before]\n"
        "assert not heavy, heavy\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "ImageReward compatibility shim patched" in done.stderr
    assert "find_pruneable_heads_and_indices" in done.stderr


@pytest.mark.slow
def test_released_architecture_builds_and_scores_with_random_weights(tiny_kwargs, images):
    # ImageReward's own ViT-L/16 + BERT-base (446M parameters), through the shim, ~10 s on 2 cores
    with warnings.catch_warnings():
        full = ImageRewardReward(
            None,
            tokenizer=tiny_kwargs["tokenizer"],
            med_config={
                **tiny_kwargs["med_config"],
                "num_hidden_layers": 12,
                "intermediate_size": 3072,
                "max_position_embeddings": 512,
            },
            device="cpu",
        )
    n_params = sum(p.numel() for p in full.model.parameters())
    assert n_params > 400e6
    assert full(images[:2], PROMPTS[:2]).shape == (2,)
