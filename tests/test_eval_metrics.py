"""Evaluation metrics on tiny random weights: FID/KID equal to torch-fidelity's own figure on the
same folders, PickScore equal to its model card's computation, CLIP score's convention, and
errors that name the file, the field and the fix."""

import json
import os

os.environ["HF_HUB_OFFLINE"] = "1"

import numpy as np
import pytest
import torch
from PIL import Image

from maskgrpo_ray.evaluation.metrics import (
    FidKid,
    MetricSpec,
    MetricWeightsMissingError,
    build_sample_metric,
    check_metric_files,
)


@pytest.fixture(scope="module")
def inception_weights(tmp_path_factory) -> str:
    """A random-weights Inception file of the right shapes, made without a download: build the
    module with its weight loading skipped, then save its (random) state."""
    from torch_fidelity import feature_extractor_inceptionv3 as fe

    path = tmp_path_factory.mktemp("inception") / "random_inception.pth"
    mp = pytest.MonkeyPatch()
    mp.setattr(fe.torch, "load", lambda *a, **k: None)
    mp.setattr(fe.FeatureExtractorInceptionV3, "load_state_dict", lambda self, sd: None)
    torch.manual_seed(0)
    model = fe.FeatureExtractorInceptionV3("inception-v3-compat", ["2048"], "unused")
    mp.undo()
    torch.save(model.state_dict(), path)
    return str(path)


def write_images(folder, n: int, seed: int, bright: bool) -> None:
    folder.mkdir(parents=True)
    g = np.random.default_rng(seed)
    for i in range(n):
        base = 160 if bright else 40
        arr = np.clip(g.normal(base, 50, (40, 40, 3)), 0, 255).astype(np.uint8)
        Image.fromarray(arr).save(folder / f"{i:03d}.png")


def test_fid_kid_equal_torch_fidelity_on_the_same_folders(tmp_path, inception_weights):
    import torch_fidelity

    a, b = tmp_path / "a", tmp_path / "b"
    write_images(a, 12, seed=1, bright=True)
    write_images(b, 14, seed=2, bright=False)
    spec = MetricSpec(
        kind="fid", weights=inception_weights, reference_dir=str(b), kid_subset_size=10
    )
    ours = FidKid(spec)(a)
    theirs = torch_fidelity.calculate_metrics(
        input1=str(a),
        input2=str(b),
        fid=True,
        kid=True,
        kid_subset_size=10,
        feature_extractor_weights_path=inception_weights,
        cuda=False,
        verbose=False,
        save_cpu_ram=True,
    )
    # the same features (the library's extractor on the same pixels) and the same formulas:
    # equal up to float32 batching noise
    assert ours["fid"] == pytest.approx(theirs["frechet_inception_distance"], rel=1e-4)
    assert ours["kid_mean"] == pytest.approx(theirs["kernel_inception_distance_mean"], rel=1e-4)
    assert ours["kid_std"] == pytest.approx(theirs["kernel_inception_distance_std"], rel=1e-3)
    assert ours["fid"] > 0
    # in-memory images give the same figure as their folder
    arrays = np.stack([np.asarray(Image.open(p)) for p in sorted(a.iterdir())])
    assert FidKid(spec)(torch.from_numpy(arrays))["fid"] == pytest.approx(ours["fid"], rel=1e-6)


def test_fid_errors_name_file_field_and_fix(tmp_path, inception_weights):
    spec = MetricSpec(kind="fid", weights=str(tmp_path / "none.pth"), reference_dir=str(tmp_path))
    with pytest.raises(MetricWeightsMissingError, match=r"eval\.metrics\[2\]\.weights: no file"):
        check_metric_files(spec, "eval.metrics[2]")
    empty = tmp_path / "empty"
    empty.mkdir()
    spec = MetricSpec(kind="fid", weights=inception_weights, reference_dir=str(empty))
    with pytest.raises(MetricWeightsMissingError, match=r"reference_dir: .*empty is not a folder"):
        check_metric_files(spec, "eval.metrics[0]")
    with pytest.raises(ValueError, match="reference_dir"):
        MetricSpec(kind="fid", weights=inception_weights)
    with pytest.raises(ValueError, match="field 'model'"):
        MetricSpec(kind="clip_score", weights=inception_weights)


def test_clip_score_is_100_times_the_clipped_cosine(tmp_path):
    from maskgrpo_ray.rewards.clip import ClipReward
    from maskgrpo_ray.rewards.tiny import register_tiny_clip

    name = register_tiny_clip(str(tmp_path))
    torch.manual_seed(0)
    weights = tmp_path / "clip.pt"
    torch.save(ClipReward(name, None, device="cpu").model.state_dict(), weights)
    spec = MetricSpec(kind="clip_score", model=name, weights=str(weights))
    check_metric_files(spec, "eval.metrics[0]")
    metric = build_sample_metric(spec, torch.device("cpu"))
    images = torch.randint(0, 256, (5, 64, 64, 3), dtype=torch.uint8)
    prompts = ["a red cat", "a dog", "two cups", "a car", "a tree"]
    cos = ClipReward(name, str(weights), score="cosine", device="cpu")(images, prompts)
    got = metric(images, prompts)
    assert torch.allclose(got, 100 * cos.clamp_min(0), atol=1e-4)
    assert metric.name == "clip_score" and metric.higher_is_better


def tiny_pickscore(folder) -> None:
    """A tiny random ``CLIPModel`` with a character-level CLIP tokenizer and a 32 px image
    processor, saved as a Hugging Face folder (the layout of PickScore_v1 + its processor)."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor, CLIPTokenizer

    folder.mkdir(parents=True)
    letters = "abcdefghijklmnopqrstuvwxyz"
    vocab = ["<|startoftext|>", "<|endoftext|>", *letters, *(c + "</w>" for c in letters)]
    (folder / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(vocab)}))
    (folder / "merges.txt").write_text("#version: 0.2\n")
    tok = CLIPTokenizer(str(folder / "vocab.json"), str(folder / "merges.txt"))
    proc = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    CLIPProcessor(image_processor=proc, tokenizer=tok).save_pretrained(folder)
    torch.manual_seed(0)
    cfg = CLIPConfig(
        text_config={
            "vocab_size": len(vocab),
            "hidden_size": 32,
            "intermediate_size": 37,
            "num_attention_heads": 4,
            "num_hidden_layers": 2,
            "max_position_embeddings": 77,
            "bos_token_id": 0,
            "eos_token_id": 1,
            "pad_token_id": 1,
        },
        vision_config={
            "hidden_size": 32,
            "intermediate_size": 37,
            "num_attention_heads": 4,
            "num_hidden_layers": 2,
            "image_size": 32,
            "patch_size": 8,
        },
        projection_dim=16,
    )
    CLIPModel(cfg).save_pretrained(folder)


def test_pickscore_equals_the_model_card_computation(tmp_path):
    from transformers import AutoProcessor, CLIPModel

    folder = tmp_path / "pickscore"
    tiny_pickscore(folder)
    spec = MetricSpec(kind="pickscore", weights=str(folder), batch_size=2)
    check_metric_files(spec, "eval.metrics[0]")
    metric = build_sample_metric(spec, torch.device("cpu"))
    g = torch.Generator().manual_seed(3)
    images = torch.randint(0, 256, (3, 48, 48, 3), dtype=torch.uint8, generator=g)
    prompts = ["a red cat", "two dogs", "a blue car on the left"]
    got = metric(images, prompts)  # batches of 2: padding differs per batch
    # the model card: one image and its prompt at a time, normalised embeddings, scaled dot
    processor = AutoProcessor.from_pretrained(folder)
    model = CLIPModel.from_pretrained(folder).eval()
    want = []
    with torch.no_grad():
        for img, prompt in zip(images, prompts):
            px = processor(images=[Image.fromarray(img.numpy())], return_tensors="pt")
            tx = processor(
                text=[prompt], padding=True, truncation=True, max_length=77, return_tensors="pt"
            )
            ie = model.get_image_features(**px)
            te = model.get_text_features(**tx)
            ie = ie if isinstance(ie, torch.Tensor) else ie.pooler_output
            te = te if isinstance(te, torch.Tensor) else te.pooler_output
            ie, te = ie / ie.norm(dim=-1, keepdim=True), te / te.norm(dim=-1, keepdim=True)
            want.append(float(model.logit_scale.exp() * (ie * te).sum()))
    assert torch.allclose(got, torch.tensor(want), atol=1e-4), (got, want)
    assert got.std() > 0


def test_pickscore_missing_folder_names_field_and_fix(tmp_path):
    spec = MetricSpec(kind="pickscore", weights=str(tmp_path / "PickScore_v1"))
    with pytest.raises(MetricWeightsMissingError) as err:
        check_metric_files(spec, "eval.metrics[1]")
    msg = str(err.value)
    assert "eval.metrics[1].weights" in msg and "PickScore_v1" in msg and "copy them here" in msg


def test_imagereward_metric_is_the_reward(tmp_path):
    from maskgrpo_ray.rewards.imagereward import ImageRewardReward
    from maskgrpo_ray.rewards.tiny import spread_imagereward_head, tiny_imagereward_kwargs

    kwargs = tiny_imagereward_kwargs(str(tmp_path))
    kwargs.pop("checkpoint")
    torch.manual_seed(0)
    reward = ImageRewardReward(None, device="cpu", **kwargs)
    spread_imagereward_head(reward)  # a random head scores every input the same
    weights = tmp_path / "ImageReward.pt"
    torch.save(reward.model.state_dict(), weights)
    spec = MetricSpec(kind="imagereward", weights=str(weights), args=kwargs)
    metric = build_sample_metric(spec, torch.device("cpu"))
    images = torch.randint(0, 256, (2, 64, 64, 3), dtype=torch.uint8)
    prompts = ["a red cat", "a dog"]
    want = ImageRewardReward(str(weights), device="cpu", **kwargs)(images, prompts)
    got = metric(images, prompts)
    assert torch.allclose(got, want, atol=1e-5) and got.std() > 0
