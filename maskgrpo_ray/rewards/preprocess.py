"""Batched image preprocessing for CLIP-style reward models, straight from uint8 tensors.

open_clip's evaluation transform and ImageReward's ``_transform`` are the same pipeline on one PIL
image at a time: resize the shortest side to ``size`` (bicubic, antialiased), centre-crop
``size x size``, scale to [0, 1], normalise by channel mean and std. :func:`pixels_from_uint8` runs
it on the whole batch as tensors. torchvision's antialiased bicubic kernel on tensors is PIL's
(``a = -0.5``); both round to uint8 after resizing, so the results differ from the PIL path by at
most 1/255 at a few pixels when downscaling (a no-op resize is exact), see ``docs/rewards.md``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torchvision.transforms.v2.functional as TF
from torchvision.transforms import InterpolationMode

# OpenAI CLIP's channel statistics, used by open_clip's defaults and by ImageReward.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

_INTERPOLATION = {"bicubic": InterpolationMode.BICUBIC, "bilinear": InterpolationMode.BILINEAR}
TENSOR_RESIZE_MODES = ("shortest", "squash")


@dataclass(frozen=True)
class ImagePreprocess:
    """The evaluation transform of a CLIP-style image tower (open_clip's ``PreprocessCfg``)."""

    size: tuple[int, int] = (224, 224)
    mean: tuple[float, float, float] = CLIP_MEAN
    std: tuple[float, float, float] = CLIP_STD
    interpolation: str = "bicubic"
    resize_mode: str = "shortest"  # "shortest" (resize + centre crop) or "squash"

    def __post_init__(self) -> None:
        if self.interpolation not in _INTERPOLATION:
            raise ValueError(f"interpolation must be one of {sorted(_INTERPOLATION)}")
        if self.resize_mode not in TENSOR_RESIZE_MODES:
            raise ValueError(f"tensor preprocessing supports resize_mode {TENSOR_RESIZE_MODES}")
        if self.resize_mode == "shortest" and self.size[0] != self.size[1]:
            raise ValueError("resize_mode 'shortest' on tensors needs a square size")


def pixels_from_uint8(
    images: torch.Tensor,
    cfg: ImagePreprocess,
    *,
    device: torch.device | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Preprocess a batch of RGB images for a CLIP-style image tower.

    Args:
        images: uint8 [N, H, W, 3].
        cfg: the model's evaluation transform.
        device: where to run the resize (the model's device; default: where ``images`` are).
        dtype: dtype of the result.

    Returns:
        [N, 3, size, size] normalised pixels, ``((x / 255) - mean) / std``.
    """
    x = images.to(device) if device is not None else images
    x = x.permute(0, 3, 1, 2)  # [N, 3, H, W] uint8
    mode = _INTERPOLATION[cfg.interpolation]
    if cfg.resize_mode == "squash":
        if tuple(x.shape[-2:]) != cfg.size:
            x = TF.resize(x, list(cfg.size), interpolation=mode, antialias=True)
    else:
        if min(x.shape[-2:]) != cfg.size[0]:
            x = TF.resize(x, [cfg.size[0]], interpolation=mode, antialias=True)
        x = TF.center_crop(x, list(cfg.size))
    mean = torch.tensor(cfg.mean, device=x.device).view(1, 3, 1, 1)
    std = torch.tensor(cfg.std, device=x.device).view(1, 3, 1, 1)
    return ((x.float() / 255.0 - mean) / std).to(dtype)  # [N, 3, size, size]
