"""The model kinds' own settings rules, as the kinds register them: config knows none of them.

A model kind (``model.kind``) brings two rules of its own to the config: the pydantic section of
its settings (a kind that is not one of ``model``'s sections, ``toy``, ``shapes``, ``showo``,
has ``model.args`` validated by it) and a cross-field check on the whole config (``rollout.
unmasking_steps`` no more than the toy image's tokens, ...). The module that implements a kind
registers them here when it is imported: :func:`maskgrpo_ray.models.registry.register_model`
does it for every model entry, so a kind's rules and its model are registered together.

Validating ``model`` finds the kind's rules (:func:`rules_for`) the way the model registry finds
the kind: it imports the modules named in ``model.plugins`` (:func:`load_plugins`) and, for a
built-in kind, the module that registers it (:data:`BUILTIN_KINDS`, a table of module names,
imported on first use as a plugin is). No module of this package imports a kind's code, so the
config sits below the models (``tests/test_layering.py``).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel

BUILTIN_KINDS: dict[str, str] = {
    "amused": "maskgrpo_ray.models.amused",
    "toy": "maskgrpo_ray.worlds.toy.model",
    "shapes": "maskgrpo_ray.worlds.shapes.model",
    "showo": "maskgrpo_ray.models.showo",
    "sim": "maskgrpo_ray.worlds.toy.sim",  # a simulated accelerator (cost_model profiles)
}
"""Built-in kinds -> the module that registers them (and their rules) when imported."""

HOW_TO_REGISTER = (
    "a new kind is one module that calls maskgrpo_ray.models.registry.register_model(kind, "
    "ModelEntry(build=...)) at import time; name that module in model.plugins so that every "
    "process imports it (docs/models.md)"
)


@dataclass(frozen=True)
class KindRules:
    """A model kind's own rules on the config.

    Attributes:
        section: the pydantic model of the kind's settings; a kind that is not one of the
            sections of ``ModelConfig`` has ``model.args`` validated by it. None: no settings
            of its own.
        check: ``config -> None``, cross-field rules on the whole
            :class:`maskgrpo_ray.config.Config` (typed ``Any`` here: this module loads before
            it); raises ``ValueError`` whose message names the field, the value and the fix.
    """

    section: type[BaseModel] | None = None
    check: Callable[[Any], None] | None = None


_RULES: dict[str, KindRules] = {}


def register_kind(kind: str, rules: KindRules) -> None:
    """Register ``rules`` under ``kind`` (registering the same rules again is a no-op)."""
    old = _RULES.get(kind)
    if old is not None and old != rules:
        raise ValueError(f"model kind {kind!r} already has its config rules registered ({old!r})")
    _RULES[kind] = rules


def kind_names() -> list[str]:
    """Every kind whose rules can be found now: built-ins and registered ones, sorted."""
    return sorted(set(_RULES) | set(BUILTIN_KINDS))


def rules_for(kind: str, plugins: Iterable[str] = ()) -> KindRules:
    """The rules of ``kind`` after importing ``plugins`` (and the built-in kind's module);
    ValueError naming the known kinds and how to register one."""
    load_plugins(plugins)
    if kind not in _RULES and kind in BUILTIN_KINDS:
        importlib.import_module(BUILTIN_KINDS[kind])
    if kind not in _RULES:
        raise ValueError(
            f"model.kind={kind!r} is not a registered model kind; registered: "
            f"{', '.join(kind_names())}. Use one of them, or register it: {HOW_TO_REGISTER}"
        )
    return _RULES[kind]


def load_plugins(modules: Iterable[str]) -> None:
    """Import each plugin (``model.plugins``) so that it registers its kinds.

    A plugin is a module name (importable in every process: an installed package, or a module
    under the driver's working directory, which Ray puts on local workers' ``sys.path``) or the
    path of a ``.py`` file, imported as the module named by its stem (reused when that module is
    already imported from the same file, e.g. by pytest).
    """
    for name in modules:
        try:
            if name.endswith(".py"):
                import_file(Path(name))
            else:
                importlib.import_module(name)
        except (ImportError, OSError) as err:
            raise ValueError(
                f"model.plugins: cannot import {name!r} ({err}); give a module name importable "
                "in every process (installed, or under the working directory) or a .py file path"
            ) from err


def import_file(path: Path) -> None:
    """Import the ``.py`` file at ``path`` as the module named by its stem (once per file)."""
    path = path.resolve()
    loaded = sys.modules.get(path.stem)
    if loaded is not None and Path(getattr(loaded, "__file__", "") or "").resolve() == path:
        return
    spec = importlib.util.spec_from_file_location(path.stem, path)
    if spec is None or spec.loader is None or not path.is_file():
        raise ImportError(f"no Python file at {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[path.stem]
        raise
