"""Does ``maskgrpo geneval convert-detector`` give the model mmdetection runs? Builds
mmdetection 2.x's own Mask2Former Swin-S COCO-instance model (GenEval's config) with seeded
random weights, saves it as mmdetection saves a checkpoint, converts it, and compares the two
forwards on the same input: the class and mask logits of every decoder layer (max absolute
difference). ``--write-fixture`` also writes the key-and-shape list of mmdetection's state dict
(``tests/fixtures/geneval_mmdet_swin_s_keys.json``), which the tests check the converter
against where mmdetection is not installed.

Needs an environment with mmdetection 2.x (mmdet 2.28.2, mmcv 1.7.2 without its compiled ops:
on the CPU its deformable attention runs the PyTorch path) and scipy; never the project's
requirements. How it was run (docs/evaluation.md, "The official detector"):

    python -m bench.geneval_mmdet_parity --mmdet-config PATH/TO/mmdet/.mim/configs/mask2former/\
mask2former_swin-s-p4-w7-224_lsj_8x2_50e_coco.py [--side 256 224] [--write-fixture]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import types
from pathlib import Path

import torch

FIXTURE = Path("tests/fixtures/geneval_mmdet_swin_s_keys.json")


def _no_compiled_ops() -> None:
    """mmcv.ops imports its compiled extension at import time; the CPU forward never calls it
    (``MultiScaleDeformableAttention`` runs ``multi_scale_deformable_attn_pytorch`` off CUDA).
    A stand-in module lets the import pass; any call of a compiled op raises."""

    class _Ext(types.ModuleType):
        def __getattr__(self, name: str):  # noqa: ANN204
            if name.startswith("__"):
                raise AttributeError(name)

            def op(*_a, **_k):  # noqa: ANN202
                raise RuntimeError(f"mmcv compiled op {name} called")

            return op

    sys.modules.setdefault("mmcv._ext", _Ext("mmcv._ext"))


def build_mmdet(config_path: str, seed: int) -> torch.nn.Module:
    """mmdetection's model of ``config_path``, every parameter drawn at random (seeded), so no
    part of the map is hidden by an init that is constant (zeros, ones): matrices and
    convolutions ``N(0, 1 / fan_in)`` (activations keep their scale, so a wrong channel order
    anywhere shows in the outputs), norm scales ``1 + N(0, 0.2)``, other vectors ``N(0, 0.1)``."""
    _no_compiled_ops()
    from mmcv import Config
    from mmdet.models import build_detector

    cfg = Config.fromfile(config_path)
    cfg.model.backbone.init_cfg = None
    model = build_detector(cfg.model).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            z = torch.randn(p.shape, generator=g)
            if p.dim() >= 2:
                p.copy_(z / max(1, p[0].numel()) ** 0.5)
            elif "norm" in name or ".gn." in name:
                p.copy_(1.0 + 0.2 * z)
            else:
                p.copy_(0.1 * z)
    return model


def mmdet_logits(model: torch.nn.Module, x: torch.Tensor) -> tuple[list, list, list]:
    """Per decoder prediction (10: the queries', then each of the 9 layers'), the class logits
    ``[N, Q, C + 1]`` and mask logits ``[N, Q, h, w]`` of mmdetection's head; the backbone's
    four feature maps."""
    h, w = x.shape[2:]
    metas = [{"batch_input_shape": (h, w), "img_shape": (h, w, 3), "pad_shape": (h, w, 3)}]
    feats = model.extract_feat(x)
    classes, masks = model.panoptic_head(feats, metas * x.shape[0])
    return classes, masks, list(feats)


def ours_logits(folder: str, x: torch.Tensor) -> tuple[list, list, list]:
    """The same from transformers' ``Mask2FormerForUniversalSegmentation`` loaded from the
    converted folder (strict: transformers reports any key it did not fill)."""
    from transformers import Mask2FormerForUniversalSegmentation

    model, info = Mask2FormerForUniversalSegmentation.from_pretrained(
        folder, output_loading_info=True
    )
    bad = {k: v for k, v in info.items() if v}
    if bad:
        raise SystemExit(f"transformers' loading is not strict: {bad}")
    out = model.eval()(pixel_values=x, output_auxiliary_logits=True)
    classes = [a["class_queries_logits"] for a in out.auxiliary_logits]
    masks = [a["masks_queries_logits"] for a in out.auxiliary_logits]
    feats = model.model.pixel_level_module.encoder(x).feature_maps
    return [*classes, out.class_queries_logits], [*masks, out.masks_queries_logits], list(feats)


def write_fixture(model: torch.nn.Module, config_path: str) -> None:
    import mmcv
    import mmdet
    from mmdet.datasets import CocoDataset

    keys = {k: list(v.shape) for k, v in model.state_dict().items()}
    FIXTURE.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "what": "every key and shape of the state dict of mmdetection 2.x's Mask2Former "
        "Swin-S COCO-instance model (the layout of GenEval's checkpoint), as mmdetection's own "
        "model definition produces it: written by bench/geneval_mmdet_parity.py --write-fixture",
        "mmdet": mmdet.__version__,
        "mmcv": mmcv.__version__,
        "config": Path(config_path).name,
        "classes_source": "mmdet/datasets/coco.py (CocoDataset.CLASSES)",
        "sources": {
            "backbone.*": "mmdet/models/backbones/swin.py (SwinTransformer, SwinBlock, "
            "WindowMSA; PatchMerging and FFN from mmcv/cnn/bricks/transformer.py)",
            "panoptic_head.pixel_decoder.*": "mmdet/models/plugins/msdeformattn_pixel_decoder.py"
            " (input_convs, encoder, level_encoding, lateral_convs, output_convs, mask_feature)",
            "panoptic_head.transformer_decoder.*, query_*, level_embed, cls_embed, mask_embed": (
                "mmdet/models/dense_heads/mask2former_head.py (Mask2FormerHead.__init__); "
                "layers from mmcv/cnn/bricks/transformer.py (BaseTransformerLayer: attentions, "
                "ffns, norms; MultiheadAttention wraps nn.MultiheadAttention as attn)"
            ),
        },
        "coco_classes": list(CocoDataset.CLASSES),  # the label order of cls_embed's rows
        "keys": keys,
    }
    FIXTURE.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {FIXTURE} ({len(keys)} keys)")


def compare(config_path: str, side: tuple[int, int], seed: int) -> dict[str, list[float]]:
    """Max absolute differences, mmdetection's model against the converted one on one random
    input: per backbone stage, per prediction's class and mask logits; with each one's scale."""
    from maskgrpo_ray.rewards.geneval_convert import convert_detector

    model = build_mmdet(config_path, seed)
    x = torch.randn(1, 3, *side, generator=torch.Generator().manual_seed(seed + 1))
    with tempfile.TemporaryDirectory() as root, torch.no_grad():
        ckpt = Path(root) / "random.pth"
        torch.save({"meta": {"CLASSES": ("person",)}, "state_dict": model.state_dict()}, ckpt)
        convert_detector(ckpt, Path(root) / "converted")
        theirs = mmdet_logits(model, x)
        ours = ours_logits(str(Path(root) / "converted"), x)
    out: dict[str, list[float]] = {"backbone": [], "class": [], "mask": [], "scale": []}
    for key, i in (("backbone", 2), ("class", 0), ("mask", 1)):
        for t, o in zip(theirs[i], ours[i], strict=True):
            out[key].append((t - o).abs().max().item())
            out["scale"].append(t.abs().max().item())
    return out


def compare_pipeline(config_path: str, seed: int, top: int = 20) -> dict[str, float]:
    """The whole inference, image to detections: mmdetection's ``inference_detector`` (its test
    pipeline: resize, ``Pad(size_divisor=32, pad_val=128)``, ``Normalize``; its
    ``instance_postprocess``) against :class:`Mask2FormerDetector` on the converted weights, on
    one 800 x 1000 image (no resize at (1333, 800), 24 columns of padding). Over the ``top``
    detections by score: the largest score difference, the largest box-corner difference (px),
    and whether the labels are the same."""
    _no_compiled_ops()
    from mmcv import Config
    from mmdet.apis import inference_detector

    from maskgrpo_ray.prompts.geneval_schema import GENEVAL_CLASSES
    from maskgrpo_ray.rewards.geneval_convert import convert_detector
    from maskgrpo_ray.rewards.geneval_detector import Mask2FormerDetector

    model = build_mmdet(config_path, seed)
    model.cfg = Config.fromfile(config_path)
    g = torch.Generator().manual_seed(seed + 2)
    rgb = torch.randint(0, 256, (800, 1000, 3), dtype=torch.uint8, generator=g)
    with tempfile.TemporaryDirectory() as root, torch.no_grad():
        ckpt = Path(root) / "random.pth"
        torch.save({"state_dict": model.state_dict()}, ckpt)
        convert_detector(ckpt, Path(root) / "converted")
        det = Mask2FormerDetector(Path(root) / "converted", GENEVAL_CLASSES, torch.device("cpu"))
        ours = det.detect(rgb[None], [set(GENEVAL_CLASSES)])[0]
        bbox_results, _ = inference_detector(model, rgb.numpy()[:, :, ::-1].copy())  # BGR
    theirs = [(float(b[4]), c, b[:4].tolist()) for c, bs in enumerate(bbox_results) for b in bs]
    mine = [(float(b[4]), int(c), b[:4].tolist()) for b, c in zip(ours.boxes, ours.labels)]
    theirs, mine = sorted(theirs, reverse=True)[:top], sorted(mine, reverse=True)[:top]
    return {
        "score": max(abs(a[0] - b[0]) for a, b in zip(theirs, mine, strict=True)),
        "box_px": max(
            max(abs(x - y) for x, y in zip(a[2], b[2], strict=True))
            for a, b in zip(theirs, mine, strict=True)
        ),
        "same_labels": float([a[1] for a in theirs] == [b[1] for b in mine]),
        "top_score": theirs[0][0],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mmdet-config", required=True, help="mmdetection 2.x's config file")
    ap.add_argument("--side", type=int, nargs=2, default=[256, 224], help="input H W")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--write-fixture", action="store_true")
    ap.add_argument("--pipeline", action="store_true", help="also image -> detections")
    args = ap.parse_args()
    if args.write_fixture:
        write_fixture(build_mmdet(args.mmdet_config, args.seed), args.mmdet_config)
    got = compare(args.mmdet_config, tuple(args.side), args.seed)
    scales = iter(got["scale"])
    print(f"input {args.side}, seed {args.seed}: max |mmdetection - converted| (max |value|)")
    for key in ("backbone", "class", "mask"):
        for i, d in enumerate(got[key]):
            print(f"{key:>8} {i}: {d:.2e} ({next(scales):.2f})")
    print(f"worst: {max(got['backbone'] + got['class'] + got['mask']):.2e}")
    if args.pipeline:
        print("inference_detector vs Mask2FormerDetector, 800 x 1000 image, top 20 detections:")
        print(compare_pipeline(args.mmdet_config, args.seed))


if __name__ == "__main__":
    main()
