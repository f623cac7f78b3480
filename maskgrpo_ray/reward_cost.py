"""The reward side of a step's cost: the forward FLOPs one image costs each reward kind, and a
cost profile with a config's own reward components (``maskgrpo plan --config``). Arithmetic only
(no torch), beside :mod:`maskgrpo_ray.cost_model`; a figure from here is a model, not a
measurement.
"""

from __future__ import annotations

from dataclasses import replace

from maskgrpo_ray.cost_model import VIT_H14_IMAGE_FLOPS, CostProfile, peak_bf16

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


def reward_cost(kinds: list[str], device: str, mfu: float = REWARD_MFU) -> tuple[float, str]:
    """GPU-seconds per image of the reward components ``kinds`` on ``device`` at ``mfu`` (the
    sum of :data:`REWARD_FLOPS`), and the text that says so; a kind not in the table counts 0
    and is named."""
    peak = peak_bf16(device)
    if peak is None:
        raise ValueError(f"no dense bf16 peak known for {device!r} (cost_model.PEAK_BF16)")
    known = [k for k in kinds if k in REWARD_FLOPS]
    flops = sum(REWARD_FLOPS[k][0] for k in known)
    text = "; ".join(f"{REWARD_FLOPS[k][1]}: {REWARD_FLOPS[k][0]:.3g} FLOP" for k in known)
    if unknown := sorted(set(kinds) - set(known)):
        text += f"{'; ' if text else ''}not counted: {unknown}"
    return flops / (mfu * peak), f"reward per image {flops:.3g} FLOP at {mfu:.0%} MFU ({text})"


def with_rewards(p: CostProfile, kinds: list[str]) -> CostProfile:
    """``p`` with the reward side of a config's components (:func:`reward_cost`) in place of
    the profile's CLIP ViT-H-14."""
    seconds, text = reward_cost(kinds, p.device)
    source = p.source.replace("reward CLIP ViT-H-14 at 30% MFU", text)
    return replace(p, reward_seconds_per_image=seconds, source=source)
