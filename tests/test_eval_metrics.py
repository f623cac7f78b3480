"""Evaluation metrics on tiny random weights, each against an independent computation:
FID/KID against ``torch_fidelity.calculate_metrics`` on the same folders, PickScore against the
model's own contrastive logits, CLIP score against open_clip's embeddings, ImageReward against
the reward; and errors that name the file, the field and the fix."""

import json
import os

os.environ["HF_HUB_OFFLINE"] = "1"

import numpy as np
import pytest
import torch
from PIL import Image
from pydantic import ValidationError

from maskgrpo_ray.config.metrics import MetricSpec
from maskgrpo_ray.evaluation.fid import FidKid, same_shape_runs
from maskgrpo_ray.evaluation.metric_files import MetricWeightsMissingError, check_metric_files
from maskgrpo_ray.evaluation.metrics import build_sample_metric

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def inception_weights(tmp_path_factory) -> str:
    """A random Inception file of torch-fidelity's shapes, made without a download."""
    from maskgrpo_ray.evaluation.tiny import random_inception_file

    return random_inception_file(tmp_path_factory.mktemp("inception") / "random_inception.pth")


def write_images(folder, n: int, seed: int, base: int, size=(40, 40)) -> list[np.ndarray]:
    folder.mkdir(parents=True)
    g = np.random.default_rng(seed)
    arrays = [np.clip(g.normal(base, 50, (*size, 3)), 0, 255).astype(np.uint8) for _ in range(n)]
    for i, a in enumerate(arrays):
        Image.fromarray(a).save(folder / f"{i:03d}.png")
    return arrays


def test_fid_kid_equal_torch_fidelity_on_the_same_folders(tmp_path, inception_weights):
    import torch_fidelity

    a, b = tmp_path / "a", tmp_path / "b"
    arrays = write_images(a, 5, seed=1, base=160)
    write_images(b, 6, seed=2, base=60)
    theirs = torch_fidelity.calculate_metrics(
        input1=str(a),
        input2=str(b),
        fid=True,
        kid=True,
        kid_subset_size=4,
        feature_extractor_weights_path=inception_weights,
        cuda=False,
        cache=False,
        verbose=False,
        save_cpu_ram=True,  # no DataLoader worker processes (forked workers slow later BLAS calls)
    )
    # ours: batches of 2 (theirs: one batch of 64), generated images as a tensor, the
    # reference as a folder; subset 4 < 5 images, so KID also checks that the features come in
    # the same (sorted path) order as theirs, since subsets are drawn by index
    spec = MetricSpec(
        kind="fid",
        weights=inception_weights,
        reference_dir=str(b),
        kid_subset_size=4,
        batch_size=2,
    )
    fid = FidKid(spec)
    ours = fid(torch.from_numpy(np.stack(arrays)))
    # the same features, formulas and KID seed: measured bitwise equal (batches of 2 vs 64 give
    # the same float32 features here); the tolerance leaves room for other BLAS builds, and is
    # 800x tighter than the KID change from feeding the same images in reverse order (8e-4)
    assert ours["fid"] == pytest.approx(theirs["frechet_inception_distance"], rel=1e-6)
    assert ours["kid_mean"] == pytest.approx(theirs["kernel_inception_distance_mean"], rel=1e-6)
    assert ours["kid_std"] == pytest.approx(theirs["kernel_inception_distance_std"], rel=1e-5)
    assert ours["kid_subset_size"] == 4 and ours["fid"] > 1.0  # bright vs dark: far apart

    # a folder of 3 images: subset 4 capped at 3, the reference features come from the cache
    c = tmp_path / "c"
    write_images(c, 3, seed=3, base=160)
    seen = []
    features = fid.features
    fid.features = lambda x: seen.append(len(x)) or features(x)  # type: ignore[method-assign]
    small = fid(str(c))
    assert seen == [2, 1]  # only c's 3 images in batches of 2, none of b's 6
    assert small["kid_subset_size"] == 3 and np.isfinite(small["fid"])


def test_fid_folder_of_mixed_sizes_keeps_file_order(tmp_path, inception_weights):
    """Images of different sizes go through the extractor in separate runs, in path order
    (a stand-in extractor returns each image's mean pixel, so the expectation is exact)."""
    folder = tmp_path / "mixed"
    folder.mkdir()
    sizes = [(8, 8), (8, 8), (6, 10), (8, 8), (6, 10)]
    arrays = [np.full((*s, 3), 10 * i, np.uint8) for i, s in enumerate(sizes)]
    for i, arr in enumerate(arrays):
        Image.fromarray(arr).save(folder / f"{i}.png")
    spec = MetricSpec(kind="fid", weights=inception_weights, reference_dir=str(folder))
    fid = FidKid(spec)
    fid.extractor = lambda x: (x.float().mean((1, 2, 3))[:, None].expand(-1, 2048),)
    got = fid.folder_features(folder)[:, 0]
    assert got.tolist() == [10.0 * i for i in range(5)]
    assert [len(r) for r in same_shape_runs(arrays)] == [2, 1, 1, 1]


def test_fid_errors_name_file_field_and_fix(tmp_path, inception_weights):
    spec = MetricSpec(kind="fid", weights=str(tmp_path / "none.pth"), reference_dir=str(tmp_path))
    with pytest.raises(MetricWeightsMissingError) as err:
        FidKid(spec, where="eval.metrics[2]")
    msg = str(err.value)
    assert msg.startswith(f"eval.metrics[2].weights: {tmp_path / 'none.pth'} is not a file")
    assert "weights-inception-2015-12-05-6726825d.pth" in msg
    assert isinstance(err.value, FileNotFoundError)

    spec = MetricSpec(kind="fid", weights=inception_weights, reference_dir=str(tmp_path / "no"))
    with pytest.raises(MetricWeightsMissingError, match=r"\[0\]\.reference_dir: .*no is not a"):
        check_metric_files(spec, "eval.metrics[0]")
    (tmp_path / "empty" / "sub").mkdir(parents=True)
    (tmp_path / "empty" / "sub" / "notes.txt").write_text("not an image")
    spec = MetricSpec(kind="fid", weights=inception_weights, reference_dir=str(tmp_path / "empty"))
    with pytest.raises(MetricWeightsMissingError, match=r"empty holds no images .*fill it"):
        check_metric_files(spec, "eval.metrics[0]")

    wrong = tmp_path / "wrong.pth"
    torch.save({"fc.weight": torch.zeros(2, 2)}, wrong)
    write_images(tmp_path / "ref", 2, seed=0, base=100)
    spec = MetricSpec(kind="fid", weights=str(wrong), reference_dir=str(tmp_path / "ref"))
    with pytest.raises(ValueError, match=r"metric 'fid'\.weights: .*wrong\.pth is not torch-fid"):
        FidKid(spec)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"kind": "fid", "weights": "w.pth"}, "field 'reference_dir' is None"),
        ({"kind": "clip_score", "weights": "c.bin"}, "field 'model' is None"),
        ({"kind": "pickscore"}, "field 'weights' is None; .*PickScore_v1"),
        ({"kind": "pickscore", "weights": "p", "model": "ViT-L-14"}, "only read by kind=clip"),
        ({"kind": "fid", "weights": "w", "reference_dir": "r", "args": {"x": 1}}, "'args'"),
        ({"kind": "imagereward", "weights": "w", "args": {"device": "cuda"}}, "\\['device'\\]"),
        ({"kind": "imagereward", "weights": "w", "name": "reward"}, "field 'name' = 'reward'"),
        ({"kind": "imagereward", "weights": "w", "kid_subset_size": 1}, "kid_subset_size"),
        ({"kind": "hpsv2", "weights": "w"}, "kind"),
        ({"kind": "imagereward", "weights": "w", "extra": 1}, "extra"),
    ],
)
def test_spec_rejects_with_field_and_fix(fields, message):
    with pytest.raises(ValidationError, match=message):
        MetricSpec(**fields)


def test_spec_is_frozen_and_labels_default_to_kind():
    spec = MetricSpec(kind="imagereward", weights="ImageReward.pt")
    assert spec.label == "imagereward" and spec.model_copy(update={"name": "ir"}).label == "ir"
    with pytest.raises(ValidationError):
        spec.batch_size = 2  # type: ignore[misc]


@pytest.mark.parametrize("kind", ["clip_score", "imagereward", "pickscore"])
def test_builders_refuse_missing_weights(tmp_path, kind):
    extra = {"model": "ViT-B-32"} if kind == "clip_score" else {}
    spec = MetricSpec(kind=kind, weights=str(tmp_path / "absent"), **extra)
    with pytest.raises(MetricWeightsMissingError, match=r"eval\.metrics\[3\]\.weights: .*absent"):
        build_sample_metric(spec, CPU, where="eval.metrics[3]")


def test_clip_score_is_100_times_the_clipped_cosine(tmp_path):
    import open_clip

    from maskgrpo_ray.rewards.clip import ClipReward
    from maskgrpo_ray.rewards.tiny import register_tiny_clip

    name = register_tiny_clip(str(tmp_path))
    torch.manual_seed(1)  # weights under which these images' cosines take both signs
    weights = tmp_path / "clip.pt"
    torch.save(ClipReward(name, None, device="cpu").model.state_dict(), weights)
    spec = MetricSpec(kind="clip_score", model=name, weights=str(weights), batch_size=2)
    with pytest.raises(ValueError, match=r"\.model: 'ViT-Nope' is not an open_clip"):
        check_metric_files(spec.model_copy(update={"model": "ViT-Nope"}), "eval.metrics[0]")
    metric = build_sample_metric(spec, CPU)
    g = torch.Generator().manual_seed(1)
    images = torch.randint(0, 256, (6, 64, 48, 3), dtype=torch.uint8, generator=g)
    images[:3] //= 8  # three dark images
    prompts = ["a red cat", "a dog", "two cups", "a car", "a tree", "a red cat"]
    got = metric(images, prompts)
    # the definition straight from open_clip, one image at a time with its own transform
    model, _, transform = open_clip.create_model_and_transforms(name, pretrained=str(weights))
    tokenizer = open_clip.get_tokenizer(name)
    with torch.no_grad():
        cos = torch.stack(
            [
                torch.nn.functional.cosine_similarity(
                    model.encode_image(transform(Image.fromarray(img.numpy()))[None]),
                    model.encode_text(tokenizer([p])),
                )[0]
                for img, p in zip(images, prompts, strict=True)
            ]
        )
    assert (cos < 0).any() and (cos > 0).any()  # both branches of max(cos, 0) are exercised
    torch.testing.assert_close(got, 100 * cos.clamp_min(0), atol=1e-4, rtol=0)
    assert metric.name == "clip_score" and metric.higher_is_better


def tiny_pickscore(folder) -> None:
    """A tiny random ``CLIPModel`` with a character-level CLIP tokenizer (vocab.json of single
    letters, no merges) and a 32 px image processor, saved as one Hugging Face folder (the
    layout of PickScore_v1 plus its processor)."""
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
    layer = {"hidden_size": 32, "intermediate_size": 37, "num_attention_heads": 4}
    cfg = CLIPConfig(
        text_config={
            **layer,
            "num_hidden_layers": 2,
            "vocab_size": len(vocab),
            "max_position_embeddings": 77,
            "bos_token_id": 0,
            "eos_token_id": 1,
            "pad_token_id": 1,
        },
        vision_config={**layer, "num_hidden_layers": 2, "image_size": 32, "patch_size": 8},
        projection_dim=16,
    )
    CLIPModel(cfg).save_pretrained(folder)


def test_pickscore_equals_the_models_own_logits(tmp_path):
    from transformers import AutoProcessor, CLIPModel

    folder = tmp_path / "pickscore"
    tiny_pickscore(folder)
    spec = MetricSpec(kind="pickscore", weights=str(folder), batch_size=2)
    metric = build_sample_metric(spec, CPU, where="eval.metrics[0]")
    g = torch.Generator().manual_seed(3)
    images = torch.randint(0, 256, (5, 48, 40, 3), dtype=torch.uint8, generator=g)
    prompts = ["a red cat", "two dogs", "a blue car on the left", "a red cat", "sky"]
    got = metric(images, prompts)  # batches of 2, texts padded together, repeats encoded once
    # PickScore's model card: exp(logit_scale) * cos of one image and its prompt, which is
    # CLIPModel's own logits_per_image for that pair (its forward, not our feature path)
    processor = AutoProcessor.from_pretrained(folder)
    model = CLIPModel.from_pretrained(folder).eval()
    want = []
    with torch.no_grad():
        for img, prompt in zip(images, prompts, strict=True):
            inputs = processor(
                text=[prompt],
                images=[Image.fromarray(img.numpy())],
                padding=True,
                truncation=True,
                max_length=77,
                return_tensors="pt",
            )
            want.append(model(**inputs).logits_per_image[0, 0])
    torch.testing.assert_close(got, torch.stack(want), atol=1e-5, rtol=1e-5)
    assert got.dtype == torch.float32 and got.std() > 0


def test_pickscore_missing_files_name_field_and_fix(tmp_path):
    spec = MetricSpec(kind="pickscore", weights=str(tmp_path / "PickScore_v1"))
    with pytest.raises(MetricWeightsMissingError) as err:
        check_metric_files(spec, "eval.metrics[1]")
    msg = str(err.value)
    assert msg.startswith("eval.metrics[1].weights: ") and "PickScore_v1/config.json" in msg
    assert "copy the whole Hugging Face folder of yuvalkirstain/PickScore_v1" in msg
    folder = tmp_path / "pick"
    tiny_pickscore(folder)
    spec = MetricSpec(kind="pickscore", weights=str(folder), processor=str(tmp_path))
    with pytest.raises(MetricWeightsMissingError, match=r"\[1\]\.processor: .*CLIP-ViT-H-14"):
        check_metric_files(spec, "eval.metrics[1]")


def test_imagereward_metric_is_the_reward_in_float32_pil(tmp_path):
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
    metric = build_sample_metric(spec, CPU)
    images = torch.randint(0, 256, (3, 64, 48, 3), dtype=torch.uint8)
    prompts = ["a red cat", "a dog", "two cars"]
    want = ImageRewardReward(str(weights), device="cpu", preprocess="pil", **kwargs)(
        images, prompts
    )
    got = metric(images, prompts)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    assert got.std() > 0
    no_vocab = tmp_path / "no_vocab"
    no_vocab.mkdir()
    spec = spec.model_copy(update={"args": {**kwargs, "tokenizer": str(no_vocab)}})
    with pytest.raises(MetricWeightsMissingError, match=r"\.args\.tokenizer: .*no_vocab has no"):
        check_metric_files(spec, "eval.metrics[0]")
