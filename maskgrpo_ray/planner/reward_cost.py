"""The reward side of a step's cost: the forward FLOPs one image costs each reward kind, and a
cost profile with a config's own reward components (``maskgrpo plan --config``). Arithmetic only
(no torch), beside :mod:`maskgrpo_ray.planner.cost_model`. The efficiency each kind runs at is the one
measured on an H100 where there is a measurement (:data:`H100_REWARD_SECONDS`), else
:data:`REWARD_MFU`; another device gets the same efficiency at its own peak.
"""

from __future__ import annotations

from dataclasses import replace

from maskgrpo_ray.planner.cost_model import VIT_H14_IMAGE_FLOPS, CostProfile, peak_bf16

VIT_L14_IMAGE_FLOPS = 2.0 * 304e6 * 257  # ViT-L-14 image tower at 224 px: ~304M params x 257 tokens
# Mask2Former Swin-S on COCO instances: 313 G "FLOPs" in its paper (Cheng et al., CVPR 2022,
# Table 2), fvcore's count (a multiply-add once) averaged over COCO val at 800 px short side
# (~800 x 1067 for 4:3 images): x2 for FLOPs, x 800*800 / (800*1067) for a square image, which
# the test pipeline resizes to 800 x 800
MASK2FORMER_SWIN_S_FLOPS = 2.0 * 313e9 * (800 * 800) / (800 * 1067)
# colour crops per image through ViT-L-14: GenEval's 553 prompts have 94 `colors` (one object)
# and 100 `color_attr` (two) lines; a crop is classified only where the count holds, so this
# is an upper bound
GENEVAL_CROPS_PER_IMAGE = (94 * 1 + 100 * 2) / 553
REWARD_FLOPS: dict[str, tuple[float, str]] = {
    "clip": (VIT_H14_IMAGE_FLOPS, "CLIP ViT-H-14 image tower, 2 x 632M params x 257 tokens"),
    "pickscore": (VIT_H14_IMAGE_FLOPS, "PickScore (a CLIP ViT-H-14), 2 x 632M params x 257 tokens"),
    "geneval": (
        MASK2FORMER_SWIN_S_FLOPS + GENEVAL_CROPS_PER_IMAGE * VIT_L14_IMAGE_FLOPS,
        "GenEval: Mask2Former Swin-S at 800 x 800 (2 x 313 GFLOP x 0.75, Cheng et al. 2022 "
        "Table 2) + 0.53 ViT-L-14 colour crops (2 x 304M params x 257 tokens)",
    ),
}
"""Per reward kind, the forward FLOPs one image costs and where the figure comes from (the text
encoders are per prompt, once per group, and left out)."""
REWARD_MFU = 0.30
# Measured on one H100 80GB HBM3 (bench/bench_reward_gpu.py, 2026-11-27, random weights;
# docs/gpu.md, "The reward side", the only record: the raw results file was lost), seconds
# per image batched: Mask2Former Swin-S at 800 x 800 in float32 (TF32), 32 a batch: 13.76 ms
# (3.4% MFU: far below the 30% assumed before); ViT-L-14 crops in bf16, 96 a batch: 0.58 ms
# each. CLIP ViT-H-14 measured 1.07-1.17 ms (bf16, 24-96 a batch), what 30% MFU gives
# (1.09 ms): clip and pickscore keep REWARD_MFU.
H100_REWARD_SECONDS: dict[str, float] = {"geneval": 13.76e-3 + GENEVAL_CROPS_PER_IMAGE * 0.58e-3}
H100_PEAK = 989e12


def kind_mfu(kind: str) -> float:
    """The efficiency a reward kind runs at: measured on the H100 where measured, else
    :data:`REWARD_MFU`."""
    if kind in H100_REWARD_SECONDS:
        return REWARD_FLOPS[kind][0] / (H100_REWARD_SECONDS[kind] * H100_PEAK)
    return REWARD_MFU


def reward_cost(kinds: list[str], device: str, mfu: float | None = None) -> tuple[float, str]:
    """GPU-seconds per image of the reward components ``kinds`` on ``device`` (the sum over
    :data:`REWARD_FLOPS`, each at ``mfu`` when given, else at :func:`kind_mfu`), and the text
    that says so; a kind not in the table counts 0 and is named."""
    peak = peak_bf16(device)
    if peak is None:
        raise ValueError(f"no dense bf16 peak known for {device!r} (cost_model.PEAK_BF16)")
    known = [k for k in kinds if k in REWARD_FLOPS]
    mfus = {k: mfu if mfu is not None else kind_mfu(k) for k in known}
    seconds = sum(REWARD_FLOPS[k][0] / (mfus[k] * peak) for k in known)
    text = "; ".join(
        f"{REWARD_FLOPS[k][1]}: {REWARD_FLOPS[k][0]:.3g} FLOP at {mfus[k]:.1%} MFU"
        + (" (measured on an H100)" if mfu is None and k in H100_REWARD_SECONDS else "")
        for k in known
    )
    if unknown := sorted(set(kinds) - set(known)):
        text += f"{'; ' if text else ''}not counted: {unknown}"
    return seconds, f"reward per image {seconds * 1e3:.3g} GPU-ms ({text})"


def with_rewards(p: CostProfile, kinds: list[str]) -> CostProfile:
    """``p`` with the reward side of a config's components (:func:`reward_cost`) in place of
    the profile's CLIP ViT-H-14."""
    seconds, text = reward_cost(kinds, p.device)
    source = p.source.replace("reward CLIP ViT-H-14 at 30% MFU", text)
    return replace(p, reward_seconds_per_image=seconds, source=source)
