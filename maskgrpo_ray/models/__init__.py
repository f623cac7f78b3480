"""Policies and image tokenizers: the toy world (``toy``), Show-o and MAGVIT-v2."""

from maskgrpo_ray.models.base import LogitsFn, MaskedImagePolicy, cfg_mix

__all__ = ["LogitsFn", "MaskedImagePolicy", "cfg_mix"]
