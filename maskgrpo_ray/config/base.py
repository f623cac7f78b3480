"""The base of every config section: strict (an unknown key is an error) and frozen.

Plain pydantic, at the bottom of the house: the config tree (:mod:`maskgrpo_ray.config`) and the
specs other modules own (``eval.metrics[i]``: :mod:`maskgrpo_ray.config.metrics`) build
on it without importing torch.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    """A config section: unknown keys fail validation, and a validated value never changes."""

    model_config = ConfigDict(extra="forbid", frozen=True)
