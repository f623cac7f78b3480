"""``maskgrpo geneval convert-detector``: GenEval's mmdetection checkpoint into transformers'
Mask2Former. The key-and-shape list of mmdetection's own model (``tests/fixtures/
geneval_mmdet_swin_s_keys.json``, written by ``bench/geneval_mmdet_parity.py`` from mmdetection
2.28.2's model definition, which also compares the two forwards: docs/evaluation.md) is turned
into a random checkpoint and converted strictly; the parts that are not renames are checked
against transformers' own modules on hand-made cases."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import nn

from maskgrpo_ray.cli import main
from maskgrpo_ray.prompts.geneval_schema import GENEVAL_CLASSES
from maskgrpo_ray.rewards import geneval_convert as gc
from maskgrpo_ray.rewards.geneval_detector import Mask2FormerDetector, geneval_label_map

FIXTURE = Path(__file__).parent / "fixtures" / "geneval_mmdet_swin_s_keys.json"


def fixture() -> dict:
    return json.loads(FIXTURE.read_text())


def random_checkpoint(path: Path, keys: dict[str, list[int]], seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    state = {k: torch.randn(shape, generator=g) for k, shape in keys.items()}
    for k in state:  # the buffer mmdetection saves: its real values (checked, not copied)
        if k.endswith("relative_position_index"):
            state[k] = mmdet_position_index(7)
    torch.save({"meta": {"CLASSES": tuple(GENEVAL_CLASSES)}, "state_dict": state}, path)
    return state


def mmdet_position_index(w: int) -> torch.Tensor:
    """mmdet/models/backbones/swin.py ``WindowMSA``: ``double_step_seq(2w - 1, w, 1, w)``, plus
    its transpose, flipped left-right."""
    seq = (torch.arange(0, (2 * w - 1) * w, 2 * w - 1)[:, None] + torch.arange(w)[None]).reshape(
        1, -1
    )
    return (seq + seq.T).flip(1)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """The fixture's layout, random, converted by the command into the default folder."""
    root = tmp_path_factory.mktemp("convert")
    ckpt = root / gc.OFFICIAL_FILE
    state = random_checkpoint(ckpt, fixture()["keys"])
    mp = pytest.MonkeyPatch()
    mp.setenv("MASKGRPO_CACHE_DIR", str(root / "cache"))
    try:
        assert main(["geneval", "convert-detector", str(ckpt)]) == 0
        yield root, ckpt, state, gc.official_folder()
    finally:
        mp.undo()


def test_fixture_is_mmdetections_swin_s_instance_layout():
    doc = fixture()
    keys = doc["keys"]
    assert doc["mmdet"].startswith("2.") and len(keys) == 649
    assert keys["panoptic_head.cls_embed.weight"] == [81, 256]  # 80 things + no-object
    assert keys["panoptic_head.query_feat.weight"] == [100, 256]
    stages = {k.split(".")[2] + "." + k.split(".")[4] for k in keys if ".blocks." in k}
    assert len(stages) == 2 + 2 + 18 + 2  # Swin-S depths
    assert len({k.split(".")[3] for k in keys if "transformer_decoder.layers." in k}) == 9
    assert len({k.split(".")[4] for k in keys if "pixel_decoder.encoder.layers." in k}) == 6


def test_every_key_maps_to_transformers_and_the_folder_loads(converted):
    root, ckpt, state, folder = converted
    from safetensors.torch import load_file

    out = load_file(str(folder / "model.safetensors"))
    # values travel: renames exactly, the packed ones split in q, k, v order
    torch.testing.assert_close(
        out["class_predictor.weight"], state["panoptic_head.cls_embed.weight"]
    )
    qkv = state["backbone.stages.2.blocks.17.attn.w_msa.qkv.weight"]
    pre = "model.pixel_level_module.encoder.swin.encoder.layers.2.blocks.17.attention."
    torch.testing.assert_close(torch.cat([out[pre + f"{n}_proj.weight"] for n in "qkv"]), qkv)
    dl = "model.transformer_module.decoder.layers.8.self_attn."
    packed = state["panoptic_head.transformer_decoder.layers.8.attentions.1.attn.in_proj_bias"]
    torch.testing.assert_close(torch.cat([out[dl + f"{n}_proj.bias"] for n in "qkv"]), packed)
    m = "model.transformer_module.decoder.mask_predictor.mask_embedder.2.0.weight"
    torch.testing.assert_close(out[m], state["panoptic_head.mask_embed.4.weight"])
    assert out["criterion.empty_weight"].tolist() == [1.0] * 80 + [pytest.approx(0.1)]
    config = json.loads((folder / "config.json").read_text())
    assert config["geneval_source"]["sha256"] == gc.sha256(ckpt)
    assert config["geneval_source"]["file"] == gc.OFFICIAL_FILE
    assert [config["id2label"][str(i)] for i in range(80)] == list(GENEVAL_CLASSES)
    det = Mask2FormerDetector(folder, GENEVAL_CLASSES, torch.device("cpu"))  # strict load
    torch.testing.assert_close(det.net.class_predictor.bias, state["panoptic_head.cls_embed.bias"])
    assert gc.resolve_detector("official") == str(folder)


def test_geneval_classes_are_mmdetections_label_order():
    """cls_embed's rows are CocoDataset.CLASSES' order; GenEval's object_names.txt is that
    order in its own spellings (mouse -> computer mouse, ...)."""
    coco = fixture()["coco_classes"]
    assert geneval_label_map(dict(enumerate(coco)), GENEVAL_CLASSES) == dict(
        enumerate(GENEVAL_CLASSES)
    )


def test_a_key_left_over_or_missing_stops_the_conversion(tmp_path):
    keys = dict(fixture()["keys"])
    keys["panoptic_head.extra.weight"] = [3]
    random_checkpoint(tmp_path / "extra.pth", keys)
    with pytest.raises(gc.ConvertError, match="not mmdetection 2.x's"):
        gc.convert_detector(tmp_path / "extra.pth", tmp_path / "out1")
    keys = dict(fixture()["keys"])
    del keys["panoptic_head.query_embed.weight"]
    random_checkpoint(tmp_path / "short.pth", keys)
    with pytest.raises(gc.ConvertError, match="queries_embedder"):
        gc.convert_detector(tmp_path / "short.pth", tmp_path / "out2")
    assert not (tmp_path / "out1").exists() and not (tmp_path / "out2").exists()


@dataclass
class NotATensor:
    x: int = 1


def test_a_checkpoint_weights_only_refuses_is_one_line(tmp_path, capsys):
    torch.save({"state_dict": {"a": NotATensor()}}, tmp_path / "code.pth")
    assert main(["geneval", "convert-detector", str(tmp_path / "code.pth"), str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "weights_only=True" in err and len(err.splitlines()) == 1
    assert main(["geneval", "convert-detector", str(tmp_path / "none.pth")]) == 2
    assert "no file" in capsys.readouterr().err


def test_official_before_conversion_names_the_converter(tmp_path, monkeypatch):
    monkeypatch.setenv("MASKGRPO_CACHE_DIR", str(tmp_path))
    with pytest.raises(gc.OfficialDetectorMissing) as err:
        gc.resolve_detector("official", "eval.geneval.detector")
    msg = str(err.value)
    assert "maskgrpo geneval convert-detector" in msg and gc.OFFICIAL_FILE in msg
    assert gc.HUB_DETECTRON2 in msg and "\n" not in msg
    assert gc.resolve_detector("some/folder") == "some/folder"


# ----------------------------------------------------------------------------- the transforms


def mmcv_patch_merging(x: torch.Tensor, norm: nn.LayerNorm, reduction: nn.Linear) -> torch.Tensor:
    """mmcv's ``PatchMerging`` (cnn/bricks/transformer.py) on ``[B, H, W, C]``: ``nn.Unfold``
    with kernel 2, stride 2 (channel ``c * 4 + kh * 2 + kw``), then norm and reduction."""
    b, h, w, c = x.shape
    cols = nn.Unfold(kernel_size=2, stride=2)(x.permute(0, 3, 1, 2))  # [B, 4C, L]
    return reduction(norm(cols.transpose(1, 2)))  # [B, L, 2C]


def mmdet_reorder(weight: torch.Tensor) -> torch.Tensor:
    """mmdetection's ``correct_unfold_reduction_order`` / ``correct_unfold_norm_order``
    (mmdet/models/utils/ckpt_convert.py ``swin_converter``): original Swin -> unfold order."""
    if weight.dim() == 1:
        return weight.reshape(4, -1)[[0, 2, 1, 3], :].transpose(0, 1).reshape(-1)
    out, cin = weight.shape
    return weight.reshape(out, 4, cin // 4)[:, [0, 2, 1, 3], :].transpose(1, 2).reshape(out, cin)


def test_patch_merging_reorder_turns_mmcvs_unfold_into_transformers_swin():
    from transformers.models.swin.modeling_swin import SwinPatchMerging

    torch.manual_seed(0)
    c = 6
    theirs_norm, theirs_red = nn.LayerNorm(4 * c), nn.Linear(4 * c, 2 * c, bias=False)
    nn.init.normal_(theirs_norm.weight)
    nn.init.normal_(theirs_norm.bias)
    ours = SwinPatchMerging(dim=c)
    with torch.no_grad():  # what the converter writes
        ours.reduction.weight.copy_(gc.unfold_to_swin_order(theirs_red.weight))
        ours.norm.weight.copy_(gc.unfold_to_swin_order(theirs_norm.weight))
        ours.norm.bias.copy_(gc.unfold_to_swin_order(theirs_norm.bias))
    x = torch.randn(2, 4, 6, c)
    want = mmcv_patch_merging(x, theirs_norm, theirs_red)
    got = ours(x.reshape(2, 24, c), (4, 6))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # and it is mmdetection's forward reorder undone, for weights and norms alike
    w, v = torch.randn(5, 4 * c), torch.randn(4 * c)
    torch.testing.assert_close(gc.unfold_to_swin_order(mmdet_reorder(w)), w)
    torch.testing.assert_close(gc.unfold_to_swin_order(mmdet_reorder(v)), v)
    assert not torch.equal(gc.unfold_to_swin_order(w), w)  # not the identity


def test_packed_in_proj_splits_as_torchs_multihead_attention_reads_it():
    torch.manual_seed(1)
    d = 8
    mha = nn.MultiheadAttention(d, 1, batch_first=True)
    x = torch.randn(2, 5, d)
    want, _ = mha(x, x, x)
    q, k, v = gc.split_qkv(mha.in_proj_weight)
    bq, bk, bv = gc.split_qkv(mha.in_proj_bias)
    qx, kx, vx = x @ q.T + bq, x @ k.T + bk, x @ v.T + bv
    att = torch.softmax(qx @ kx.transpose(1, 2) / d**0.5, dim=-1) @ vx
    torch.testing.assert_close(mha.out_proj(att), want, rtol=1e-5, atol=1e-5)


def test_mmdets_position_index_is_transformers():
    """The bias tables are copied as they are: both index them the same way (the converter
    also checks every block's buffer against the checkpoint's)."""
    from transformers import SwinConfig
    from transformers.models.swin.modeling_swin import SwinLayer

    layer = SwinLayer(SwinConfig(window_size=7), dim=12, input_resolution=(14, 14), num_heads=2)
    got = [v for k, v in layer.named_buffers() if k.endswith("relative_position_index")]
    assert len(got) == 1
    torch.testing.assert_close(got[0].reshape(-1), mmdet_position_index(7).reshape(-1))


def test_agreement_script_counts_decisions_per_tag(tmp_path, capsys):
    """bench/geneval_agreement.py on tiny models: the official side is our own judgement with
    one decision flipped, so exactly that image differs; paths are found under --images when
    the evaluator ran elsewhere."""
    import numpy as np
    from PIL import Image

    from bench.geneval_agreement import main as agreement
    from maskgrpo_ray.rewards.geneval import GenEvalScorer
    from maskgrpo_ray.rewards.geneval_colour import save_tiny_clip_folder
    from maskgrpo_ray.rewards.geneval_detector import save_tiny_random_mask2former

    d2 = {"computer mouse": "mouse", "tv remote": "remote", "computer keyboard": "keyboard"}
    det = save_tiny_random_mask2former(tmp_path / "det", [d2.get(c, c) for c in GENEVAL_CLASSES])
    clip = save_tiny_clip_folder(tmp_path / "clip")
    g = torch.Generator().manual_seed(3)
    imgs = torch.randint(0, 256, (4, 32, 32, 3), dtype=torch.uint8, generator=g)
    metas = [{"tag": t, "include": [{"class": c, "count": 1}], "prompt": f"a photo of a {c}"}
             for t, c in [("single_object", "dog"), ("single_object", "cat"),
                          ("counting", "dog"), ("counting", "tv")]]  # fmt: skip
    ours = GenEvalScorer(det, clip, None, device="cpu", detector_scale=(64, 48)).judge(imgs, metas)
    lines = []
    for i, (meta, j) in enumerate(zip(metas, ours, strict=True)):
        rel = Path(f"{i:05d}") / "samples" / "0000.png"
        (tmp_path / "images" / rel).parent.mkdir(parents=True)
        Image.fromarray(np.asarray(imgs[i])).save(tmp_path / "images" / rel)
        lines.append({"filename": f"/elsewhere/images/{rel}", "tag": meta["tag"],
                      "correct": j.correct != (i == 2), "reason": "", "metadata": json.dumps(meta)})  # fmt: skip
    (tmp_path / "results.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    report = agreement(["--results", str(tmp_path / "results.jsonl"), "--images",
                        str(tmp_path / "images"), "--detector", det, "--colour-model", clip,
                        "--colour-pretrained", "none", "--detector-scale", "64", "48",
                        "--device", "cpu"])  # fmt: skip
    tab = report["detectors"][det]["per_tag"]
    assert tab["single_object"]["agreement"] == 1.0 and tab["counting"]["differ"] == 1
    assert tab["overall"] == pytest.approx({"images": 4, "agreement": 0.75, "differ": 1,
        "official_accuracy": tab["overall"]["official_accuracy"],
        "ours_accuracy": float(np.mean([j.correct for j in ours]))})  # fmt: skip
    assert [d["filename"].endswith("00002/samples/0000.png")
            for d in report["detectors"][det]["differences"]] == [True]  # fmt: skip
    assert "counting" in capsys.readouterr().out


def test_a_transformers_4_checkpoint_loads_as_the_same_model(tmp_path):
    """The hub's facebook/mask2former-* files were written by transformers 4.x (Swin keys
    ``encoder.encoder.layers.*.attention.self.query``, as transformers' own Mask2Former
    conversion script names them); the detector renames them to the installed 5.x model."""
    import shutil

    from safetensors.torch import load_file, save_file

    from maskgrpo_ray.rewards.geneval_detector import save_tiny_random_mask2former

    d2 = {"computer mouse": "mouse", "tv remote": "remote", "computer keyboard": "keyboard"}
    new = Path(
        save_tiny_random_mask2former(tmp_path / "v5", [d2.get(c, c) for c in GENEVAL_CLASSES])
    )
    sw = "model.pixel_level_module.encoder."
    back = [(".attention.relative_position_bias.relative_position_bias_table",
             ".attention.self.relative_position_bias_table"),
            (".attention.q_proj.", ".attention.self.query."),
            (".attention.k_proj.", ".attention.self.key."),
            (".attention.v_proj.", ".attention.self.value."),
            (".attention.o_proj.", ".attention.output.dense."),
            (".mlp.fc1.", ".intermediate.dense."), (".mlp.fc2.", ".output.dense.")]  # fmt: skip
    old = {}
    for k, v in load_file(str(new / "model.safetensors")).items():
        if k.startswith(sw + "swin.layernorm."):
            continue  # 4.x's SwinBackbone had none
        if k.startswith(sw + "swin."):
            k = sw + k[len(sw + "swin.") :]
            for a, b in back:
                k = k.replace(a, b)
        old[k] = v
    for k in [k for k in old if k.endswith("attention.self.relative_position_bias_table")]:
        old[k.replace("bias_table", "index")] = mmdet_position_index(4).reshape(16, 16)
    assert any(".attention.self.query." in k for k in old)
    (tmp_path / "v4").mkdir()
    shutil.copy(new / "config.json", tmp_path / "v4" / "config.json")
    save_file(old, str(tmp_path / "v4" / "model.safetensors"))
    a = Mask2FormerDetector(new, GENEVAL_CLASSES, torch.device("cpu"), scale=(64, 48))
    b = Mask2FormerDetector(tmp_path / "v4", GENEVAL_CLASSES, torch.device("cpu"), scale=(64, 48))
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        for ta, tb in zip(a.net(x), b.net(x), strict=True):
            torch.testing.assert_close(ta, tb, rtol=0, atol=0)


@pytest.mark.slow
def test_mmdetections_own_model_gives_the_converted_logits():
    """Where mmdetection 2.x is installed (not a requirement: bench/geneval_mmdet_parity.py says
    how), its own model of GenEval's config, random weights, against the converted one: every
    backbone stage and every prediction within 1e-4 of values up to ~50 (measured: 5e-5); and
    the whole inference on one padded image."""
    pytest.importorskip("mmdet", minversion="2.0")
    import mmdet

    if not mmdet.__version__.startswith("2."):
        pytest.skip(f"mmdetection {mmdet.__version__}: the 2.x config is needed")
    from bench.geneval_mmdet_parity import compare, compare_pipeline

    config = Path(mmdet.__file__).parent / ".mim" / "configs" / "mask2former"
    got = compare(str(config / "mask2former_swin-s-p4-w7-224_lsj_8x2_50e_coco.py"), (256, 224), 0)
    assert len(got["backbone"]) == 4 and len(got["class"]) == len(got["mask"]) == 10
    assert max(got["backbone"] + got["class"] + got["mask"]) < 1e-4
    assert max(got["scale"]) > 1.0  # activations of a real size, not a vanishing signal
    # image to detections: mmdetection's inference_detector (its Pad(128) before Normalize, its
    # post-processing) against Mask2FormerDetector; measured 7e-8 on the scores (the old order,
    # 0 padded after normalising, gives 8e-5), boxes equal
    pipe = compare_pipeline(str(config / "mask2former_swin-s-p4-w7-224_lsj_8x2_50e_coco.py"), 0)
    assert pipe["score"] < 1e-6 and pipe["box_px"] == 0.0 and pipe["same_labels"] == 1.0
