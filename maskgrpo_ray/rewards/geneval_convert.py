"""GenEval's own detector for the in-process scorer: the mmdetection checkpoint the official
evaluator loads, converted into transformers' ``Mask2FormerForUniversalSegmentation``.

GenEval's ``evaluation/download_models.sh`` fetches OpenMMLab's training of Mask2Former Swin-S
for COCO instances (:data:`OFFICIAL_FILE`, mmdetection 2.x config :data:`MMDET_CONFIG`); the hub's
``facebook/mask2former-swin-small-coco-instance`` is another training of the same architecture
(Meta's Detectron2 release, converted by transformers). :func:`convert_detector` turns the
former into a transformers folder (``config.json``, ``model.safetensors``) that
:class:`maskgrpo_ray.rewards.geneval_detector.Mask2FormerDetector` loads.

The checkpoint is read with ``torch.load(weights_only=True)`` (tensors and plain containers
only: no code runs). Every source key is mapped, and every target key filled, or the conversion
stops naming the keys. The map follows mmdetection 2.x's module names (``mmdet/models/backbones/
swin.py``, ``mmdet/models/plugins/msdeformattn_pixel_decoder.py``, ``mmdet/models/dense_heads/
mask2former_head.py``, mmcv's ``cnn/bricks/transformer.py``); what is more than a rename:

- Swin patch merging: mmcv's ``PatchMerging`` concatenates each 2x2 neighbourhood with
  ``nn.Unfold`` (channel ``c * 4 + kh * 2 + kw``), the original Swin (and transformers) as
  ``[x(0,0), x(1,0), x(0,1), x(1,1)]`` (channel ``k * C + c``); mmdetection's ``swin_converter``
  (``mmdet/models/utils/ckpt_convert.py``, ``correct_unfold_reduction_order``) reorders the
  original weights into unfold order, :func:`unfold_to_swin_order` is its inverse (reduction
  weight and norm);
- the Swin ``qkv`` and the decoder self-attention's ``in_proj`` are packed ``[q; k; v]`` rows:
  split into transformers' ``q_proj``, ``k_proj``, ``v_proj`` (the cross-attention keeps the
  packed ``in_proj``, as transformers does);
- the decoder layers run ``cross_attn, norm, self_attn, norm, ffn, norm`` (the config's
  ``operation_order``): ``norms.0/1/2`` are the cross, self and feed-forward norms;
- Swin's ``relative_position_index`` (a buffer) is not copied: transformers computes its own;
  the conversion checks the two are equal. transformers' ``swin.layernorm`` (ignored by
  ``SwinBackbone``: its forward never reads it) is written as an identity norm, and
  ``criterion.empty_weight`` (training only) as mmdetection's class weights ``[1] * 80 + [0.1]``.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from maskgrpo_ray.errors import UserError

OFFICIAL_FILE = "mask2former_swin-s-p4-w7-224_lsj_8x2_50e_coco_20220504_001756-743b7d99.pth"
MMDET_CONFIG = "configs/mask2former/mask2former_swin-s-p4-w7-224_lsj_8x2_50e_coco.py"
NO_OBJECT_WEIGHT = 0.1  # the config's loss_cls class_weight for the no-object column
OFFICIAL = "official"  # a ``detector`` value: the converted folder of :func:`official_folder`
HUB_DETECTRON2 = "hf://facebook/mask2former-swin-small-coco-instance"
"""Meta's Detectron2 training of the same architecture, converted by transformers: not the
weights GenEval's evaluator loads."""

B = "model.pixel_level_module.encoder."
P = "model.pixel_level_module.decoder."
T = "model.transformer_module."


class ConvertError(UserError, ValueError):
    """A checkpoint the converter cannot turn into GenEval's detector (one line)."""


class OfficialDetectorMissing(UserError, FileNotFoundError):
    """``detector: official`` before ``maskgrpo geneval convert-detector`` was run."""


def official_folder() -> Path:
    """Where ``detector: official`` is read and ``convert-detector`` writes by default:
    ``$MASKGRPO_CACHE_DIR/geneval/mask2former-swin-s-mmdet`` (``~/.cache/maskgrpo-ray/...``)."""
    cache = os.environ.get("MASKGRPO_CACHE_DIR") or str(Path.home() / ".cache" / "maskgrpo-ray")
    return Path(cache) / "geneval" / "mask2former-swin-s-mmdet"


def resolve_detector(detector: str, where: str = "detector") -> str:
    """``detector`` with :data:`OFFICIAL` replaced by the converted folder (others unchanged).

    Raises:
        OfficialDetectorMissing: ``official`` and no converted folder (one line naming the
            converter and the hub alternative).
    """
    if str(detector) != OFFICIAL:
        return str(detector)
    folder = official_folder()
    if not (folder / "config.json").is_file():
        raise OfficialDetectorMissing(
            f"{where}: official (GenEval's own detector, OpenMMLab's mmdetection training) is "
            f"not converted yet, no {folder}; run `maskgrpo geneval convert-detector "
            f"{OFFICIAL_FILE}` (the file GenEval's download_models.sh fetches) or set {where}: "
            f"{HUB_DETECTRON2} (Meta's Detectron2 training, converted by transformers)"
        )
    return str(folder)


def detector_identity(detector: str) -> str:
    """What tells two ``detector`` values apart: the folder ``official`` and local paths
    resolve to, or the hub id as written."""
    d = str(detector)
    if d == OFFICIAL:
        return str(official_folder().resolve())
    if "://" in d:
        return d
    return str(Path(d).expanduser().resolve())


def unfold_to_swin_order(x: torch.Tensor) -> torch.Tensor:
    """The inverse of mmdetection's ``correct_unfold_reduction_order`` (2-D reduction weight)
    and ``correct_unfold_norm_order`` (1-D norm): unfold channel ``c * 4 + j`` -> Swin channel
    ``k * C + c``, with ``k = [0, 2, 1, 3][j]`` (a permutation that is its own inverse)."""
    if x.dim() == 1:
        return x.reshape(-1, 4)[:, [0, 2, 1, 3]].transpose(0, 1).reshape(-1)
    out, cin = x.shape
    return x.reshape(out, cin // 4, 4)[:, :, [0, 2, 1, 3]].transpose(1, 2).reshape(out, cin)


def split_qkv(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed ``[q; k; v]`` rows (weight ``[3D, D]`` or bias ``[3D]``) -> ``(q, k, v)``."""
    q, k, v = packed.chunk(3, dim=0)
    return q, k, v


Rule = tuple[str, Callable[[re.Match[str], torch.Tensor], list[tuple[str, torch.Tensor]]]]


def _to(template: str) -> Callable[[re.Match[str], torch.Tensor], list[tuple[str, torch.Tensor]]]:
    return lambda m, t: [(m.expand(template), t)]


def _qkv(prefix: str) -> Callable[[re.Match[str], torch.Tensor], list[tuple[str, torch.Tensor]]]:
    def split(m: re.Match[str], t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        base, kind = m.expand(prefix), m.group("wb")
        return [(f"{base}.{n}_proj.{kind}", p) for n, p in zip("qkv", split_qkv(t), strict=True)]

    return split


def _merge(
    template: str,
) -> Callable[[re.Match[str], torch.Tensor], list[tuple[str, torch.Tensor]]]:
    return lambda m, t: [(m.expand(template), unfold_to_swin_order(t))]


def _stage(m: re.Match[str], t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    return [(f"{B}hidden_states_norms.stage{int(m.group('i')) + 1}.{m.group('wb')}", t)]


WB = r"(?P<wb>weight|bias)"
SB = r"backbone\.stages\.(?P<i>\d+)\.blocks\.(?P<j>\d+)\."
TB = B + r"swin.encoder.layers.\g<i>.blocks.\g<j>."
PD = r"panoptic_head\.pixel_decoder\."
PE = PD + r"encoder\.layers\.(?P<l>\d+)\."
DL = r"panoptic_head\.transformer_decoder\.layers\.(?P<l>\d+)\."
TL = T + r"decoder.layers.\g<l>."
RULES: tuple[Rule, ...] = (
    # mmdet/models/backbones/swin.py: PatchEmbed, SwinBlock (WindowMSA as w_msa, FFN), stages,
    # PatchMerging (mmcv), the out_indices norms norm0..3
    (r"backbone\.patch_embed\.projection\." + WB, _to(B + r"swin.embeddings.patch_embeddings.projection.\g<wb>")),  # noqa: E501
    (r"backbone\.patch_embed\.norm\." + WB, _to(B + r"swin.embeddings.norm.\g<wb>")),
    (SB + r"norm1\." + WB, _to(TB + r"layernorm_before.\g<wb>")),
    (SB + r"norm2\." + WB, _to(TB + r"layernorm_after.\g<wb>")),
    (SB + r"attn\.w_msa\.relative_position_bias_table", _to(TB + "attention.relative_position_bias.relative_position_bias_table")),  # noqa: E501
    (SB + r"attn\.w_msa\.relative_position_index", lambda m, t: []),  # checked, not copied
    (SB + r"attn\.w_msa\.qkv\." + WB, _qkv(TB + "attention")),
    (SB + r"attn\.w_msa\.proj\." + WB, _to(TB + r"attention.o_proj.\g<wb>")),
    (SB + r"ffn\.layers\.0\.0\." + WB, _to(TB + r"mlp.fc1.\g<wb>")),
    (SB + r"ffn\.layers\.1\." + WB, _to(TB + r"mlp.fc2.\g<wb>")),
    (r"backbone\.stages\.(?P<i>\d+)\.downsample\.(?P<n>reduction|norm)\." + WB, _merge(B + r"swin.encoder.layers.\g<i>.downsample.\g<n>.\g<wb>")),  # noqa: E501
    (r"backbone\.norm(?P<i>\d)\." + WB, _stage),
    # mmdet/models/plugins/msdeformattn_pixel_decoder.py: input_convs (top level first, as
    # transformers' input_projections), the deformable encoder (self_attn, norm, ffn, norm),
    # level_encoding, the stride-4 lateral and output convs, mask_feature
    (PD + r"input_convs\.(?P<i>\d+)\.conv\." + WB, _to(P + r"input_projections.\g<i>.0.\g<wb>")),  # noqa: E501
    (PD + r"input_convs\.(?P<i>\d+)\.gn\." + WB, _to(P + r"input_projections.\g<i>.1.\g<wb>")),
    (PE + r"attentions\.0\.(?P<n>sampling_offsets|attention_weights|value_proj|output_proj)\." + WB, _to(P + r"encoder.layers.\g<l>.self_attn.\g<n>.\g<wb>")),  # noqa: E501
    (PE + r"ffns\.0\.layers\.0\.0\." + WB, _to(P + r"encoder.layers.\g<l>.fc1.\g<wb>")),
    (PE + r"ffns\.0\.layers\.1\." + WB, _to(P + r"encoder.layers.\g<l>.fc2.\g<wb>")),
    (PE + r"norms\.0\." + WB, _to(P + r"encoder.layers.\g<l>.self_attn_layer_norm.\g<wb>")),
    (PE + r"norms\.1\." + WB, _to(P + r"encoder.layers.\g<l>.final_layer_norm.\g<wb>")),
    (PD + r"level_encoding\.weight", _to(P + "level_embed")),
    (PD + r"lateral_convs\.0\.conv\.weight", _to(P + "adapter_1.0.weight")),
    (PD + r"lateral_convs\.0\.gn\." + WB, _to(P + r"adapter_1.1.\g<wb>")),
    (PD + r"output_convs\.0\.conv\.weight", _to(P + "layer_1.0.weight")),
    (PD + r"output_convs\.0\.gn\." + WB, _to(P + r"layer_1.1.\g<wb>")),
    (PD + r"mask_feature\." + WB, _to(P + r"mask_projection.\g<wb>")),
    # mmdet/models/dense_heads/mask2former_head.py: the masked-attention decoder (cross_attn,
    # norm, self_attn, norm, ffn, norm), its post_norm, queries, level embedding, class and mask
    # embeddings (mask_embed: Linear, ReLU, Linear, ReLU, Linear)
    (DL + r"attentions\.0\.attn\.(?P<n>in_proj_weight|in_proj_bias)", _to(TL + r"cross_attn.\g<n>")),  # noqa: E501
    (DL + r"attentions\.0\.attn\.out_proj\." + WB, _to(TL + r"cross_attn.out_proj.\g<wb>")),
    (DL + r"attentions\.1\.attn\.in_proj_(?P<wb>weight|bias)", _qkv(TL + "self_attn")),
    (DL + r"attentions\.1\.attn\.out_proj\." + WB, _to(TL + r"self_attn.out_proj.\g<wb>")),
    (DL + r"norms\.0\." + WB, _to(TL + r"cross_attn_layer_norm.\g<wb>")),
    (DL + r"norms\.1\." + WB, _to(TL + r"self_attn_layer_norm.\g<wb>")),
    (DL + r"norms\.2\." + WB, _to(TL + r"final_layer_norm.\g<wb>")),
    (DL + r"ffns\.0\.layers\.0\.0\." + WB, _to(TL + r"fc1.\g<wb>")),
    (DL + r"ffns\.0\.layers\.1\." + WB, _to(TL + r"fc2.\g<wb>")),
    (r"panoptic_head\.transformer_decoder\.post_norm\." + WB, _to(T + r"decoder.layernorm.\g<wb>")),  # noqa: E501
    (r"panoptic_head\.query_embed\.weight", _to(T + "queries_embedder.weight")),
    (r"panoptic_head\.query_feat\.weight", _to(T + "queries_features.weight")),
    (r"panoptic_head\.level_embed\.weight", _to(T + "level_embed.weight")),
    (r"panoptic_head\.cls_embed\." + WB, _to(r"class_predictor.\g<wb>")),
    (r"panoptic_head\.mask_embed\.(?P<i>[024])\." + WB, lambda m, t: [(f"{T}decoder.mask_predictor.mask_embedder.{int(m.group('i')) // 2}.0.{m.group('wb')}", t)]),  # noqa: E501
)  # fmt: skip
_COMPILED = tuple((re.compile(p), f) for p, f in RULES)


def renamed(key: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]] | None:
    """The transformers keys and tensors of one mmdetection key (None: no rule knows it)."""
    for pattern, fn in _COMPILED:
        m = pattern.fullmatch(key)
        if m:
            return fn(m, tensor)
    return None


def swin_s_config(classes: Sequence[str], source: Mapping[str, Any] | None = None) -> Any:
    """transformers' ``Mask2FormerConfig`` of :data:`MMDET_CONFIG`: Swin-S (embed 96, depths
    [2, 2, 18, 2], heads [3, 6, 12, 24], window 7), a 3-level deformable pixel decoder of 6
    layers (feed-forward 1024), 9 masked-attention decoder layers (transformers counts
    ``decoder_layers = 10``: it also counts the prediction made from the queries before the
    first layer), 100 queries, 256 channels, 8 heads, feed-forward 2048; ``classes`` as labels
    and ``source`` (file name, sha256, ...) kept as ``geneval_source``."""
    from transformers import Mask2FormerConfig, SwinConfig

    swin = SwinConfig(  # type: ignore[call-arg]
        embed_dim=96,
        depths=[2, 2, 18, 2],
        num_heads=[3, 6, 12, 24],
        window_size=7,
        drop_path_rate=0.0,
        out_features=["stage1", "stage2", "stage3", "stage4"],
    )
    config = Mask2FormerConfig(  # type: ignore[call-arg]
        backbone_config=swin,
        num_labels=len(classes),
        id2label=dict(enumerate(classes)),
        label2id={c: i for i, c in enumerate(classes)},
        num_queries=100,
        hidden_dim=256,
        feature_size=256,
        mask_feature_size=256,
        encoder_layers=6,
        encoder_feedforward_dim=1024,
        decoder_layers=10,
        dim_feedforward=2048,
        num_attention_heads=8,
        pre_norm=False,
        common_stride=4,
        feature_strides=[4, 8, 16, 32],
        no_object_weight=NO_OBJECT_WEIGHT,
    )
    if source is not None:
        config.geneval_source = dict(source)
    return config


def convert_state_dict(
    src: Mapping[str, torch.Tensor], target: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """mmdetection's state dict -> transformers' keys, shaped as ``target`` (a
    ``Mask2FormerForUniversalSegmentation`` state dict, or its inference half's plus
    ``criterion.empty_weight``). Filled, not converted: ``swin.layernorm`` (identity) and
    ``criterion.empty_weight``.

    Raises:
        ConvertError: a source key no rule knows, a target key left empty, a shape that differs.
    """
    out: dict[str, torch.Tensor] = {}
    unknown: list[str] = []
    for key, tensor in src.items():
        mapped = renamed(key, tensor)
        if mapped is None:
            unknown.append(key)
            continue
        for name, value in mapped:
            out[name] = value.detach().to(torch.float32).contiguous()
    if unknown:
        raise ConvertError(
            f"convert-detector: {len(unknown)} checkpoint keys are not mmdetection 2.x's "
            f"Mask2Former Swin-S (e.g. {unknown[:3]}); pass {OFFICIAL_FILE} (GenEval's "
            "download_models.sh)"
        )
    for name, value in target.items():
        if name.startswith(B + "swin.layernorm."):
            out[name] = (
                torch.ones_like(value) if name.endswith("weight") else torch.zeros_like(value)
            )
        elif name == "criterion.empty_weight":
            out[name] = torch.ones_like(value)
            out[name][-1] = NO_OBJECT_WEIGHT
    lost, extra = sorted(set(target) - set(out)), sorted(set(out) - set(target))
    bad = [k for k in target if k in out and tuple(out[k].shape) != tuple(target[k].shape)]
    if lost or extra or bad:
        raise ConvertError(
            f"convert-detector: the checkpoint does not fill transformers' Mask2Former Swin-S "
            f"(missing {lost[:3]}, unexpected {extra[:3]}, shape differs {bad[:3]}); pass "
            f"{OFFICIAL_FILE} (mmdetection 2.x, {MMDET_CONFIG})"
        )
    return out


def check_position_index(src: Mapping[str, torch.Tensor], net: torch.nn.Module) -> None:
    """mmdetection's Swin ``relative_position_index`` buffers equal transformers' own (so the
    bias tables, copied as they are, index the same offsets)."""
    ours = {k: v for k, v in net.named_buffers() if k.endswith("relative_position_index")}
    theirs = [v for k, v in src.items() if k.endswith("relative_position_index")]
    if not ours or len(ours) != len(theirs):
        raise ConvertError(
            f"convert-detector: {len(theirs)} relative_position_index buffers in the "
            f"checkpoint, {len(ours)} in transformers' Swin; pass {OFFICIAL_FILE}"
        )
    if not all(
        torch.equal(t.long().reshape(-1), o.long().reshape(-1))
        for t, o in zip(theirs, ours.values(), strict=True)
    ):
        raise ConvertError(
            "convert-detector: mmdetection's relative_position_index differs from "
            "transformers' Swin; this transformers version is not the one the converter knows"
        )


def load_mmdet_checkpoint(path: str | Path) -> dict[str, torch.Tensor]:
    """The ``state_dict`` of an mmdetection checkpoint, read with ``weights_only=True``.

    Raises:
        ConvertError: the file is missing, is not loadable without running code, or holds no
            state dict (one line).
    """
    where = Path(str(path))
    if not where.is_file():
        raise ConvertError(f"convert-detector: no file {where}; pass the path of {OFFICIAL_FILE}")
    try:
        ckpt = torch.load(str(where), map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 (any refusal is one line)
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConvertError(
            f"convert-detector: {where} does not load with torch.load(weights_only=True) "
            f"({first[:160]}); this project never unpickles code: pass {OFFICIAL_FILE} as "
            "downloaded"
        ) from None
    state = ckpt.get("state_dict", ckpt) if isinstance(ckpt, Mapping) else None
    if not isinstance(state, Mapping) or not all(
        isinstance(v, torch.Tensor) for v in state.values()
    ):
        raise ConvertError(
            f"convert-detector: {where} holds no state dict of tensors; pass {OFFICIAL_FILE}"
        )
    return dict(state)


def sha256(path: str | Path) -> str:
    """The file's sha256, hex."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def convert_detector(
    path: str | Path, out: str | Path, classes: Sequence[str] | None = None
) -> dict[str, Any]:
    """Convert the mmdetection checkpoint ``path`` into the transformers folder ``out``
    (``config.json`` with GenEval's classes and ``geneval_source``, ``model.safetensors``),
    loaded strictly into the model before it is written. Returns ``geneval_source``."""
    from safetensors.torch import save_file

    from maskgrpo_ray.prompts.geneval_schema import GENEVAL_CLASSES
    from maskgrpo_ray.rewards.geneval_detector import _Mask2Former

    src = load_mmdet_checkpoint(path)
    source = {
        "file": Path(str(path)).name,
        "sha256": sha256(path),
        "mmdetection_config": MMDET_CONFIG,
        "converted_by": "maskgrpo geneval convert-detector",
        "weights": "OpenMMLab's mmdetection training (GenEval's detector)",
    }
    config = swin_s_config(tuple(classes or GENEVAL_CLASSES), source)
    net = _Mask2Former(config).eval()
    check_position_index(src, net)
    target = dict(net.state_dict())
    target["criterion.empty_weight"] = torch.ones(config.num_labels + 1)
    state = convert_state_dict(src, target)
    net.load_state_dict({k: v for k, v in state.items() if not k.startswith("criterion.")})
    folder = Path(str(out))
    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(folder))
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return source
