"""The commands: ``maskgrpo`` (``maskgrpo = maskgrpo_ray.cli:main``; ``python -m
maskgrpo_ray.cli``).

:mod:`~maskgrpo_ray.cli.app` is the command itself (the parser, the dispatch, ``train``,
``validate``, ``scale`` and ``status``); ``plan``, ``prompts``, ``configs`` and ``geneval`` are its
sub-commands' modules, and ``maskgrpo eval`` is :mod:`maskgrpo_ray.evaluation.cli`.

This package stays light (no torch, no ray: ``maskgrpo_ray.plan`` loads ``cli.plan`` alone), so
``app``'s names (``main``, ``run_train``, ...: what the module ``maskgrpo_ray.cli`` held before
it became this package) are loaded on first use and are ``app``'s own objects.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from maskgrpo_ray.cli.app import main, run_train, train_command, validate_command

__all__ = ["main", "run_train", "train_command", "validate_command"]

_MODULES = frozenset({"app", "configs", "geneval", "plan", "prompts"})  # never looked up in app


def __getattr__(name: str) -> Any:
    if name.startswith("__") or name in _MODULES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from maskgrpo_ray.cli import app

    return getattr(app, name)
