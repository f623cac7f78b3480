"""maskgrpo-ray: Mask-GRPO for masked generative text-to-image models, on Ray.

The Python API (:mod:`maskgrpo_ray.api`) is re-exported here and imported on first use, so
``import maskgrpo_ray`` stays light (no torch, no ray)::

    import maskgrpo_ray as mg
    summary = mg.train("toy", {"train.steps": 20})
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["__version__", "evaluate", "load_config", "plan", "train", "validate"]

if TYPE_CHECKING:
    from maskgrpo_ray.api import evaluate, load_config, plan, train, validate

_API = ("evaluate", "load_config", "plan", "train", "validate")


def __getattr__(name: str) -> Any:
    if name in _API:
        from maskgrpo_ray import api

        return getattr(api, name)
    raise AttributeError(f"module 'maskgrpo_ray' has no attribute {name!r}")
