"""The module paths of the flat layout, kept working for one release (issues 33 and 38).

Issue 33 grouped ``maskgrpo_ray``'s flat modules into packages: ``config/`` (the config tree),
``step/`` (the algorithm's loop), ``backend/`` (the Ray backend) and ``cli/`` (the commands);
issue 38 moved the toy world (``toyworld``, ``models.toy``, ``rewards.rules``) into ``worlds/toy/``
beside the GenEval-shaped world.
:data:`MOVED` maps each old path to its new one. Until the next release an import of an old
path, ``import maskgrpo_ray.driver`` or ``from maskgrpo_ray.ray_executor import RayExecutor``,
still works: it answers the moved module itself (the same module object, so its classes,
functions and a monkeypatch through the old path are the new module's) and warns once
(``DeprecationWarning``) with the new path. ``maskgrpo_ray.config`` and ``maskgrpo_ray.cli``
kept their names (they became packages that provide what the modules did) and are not here.

No code of the house imports an old path; ``tests/test_moved_paths.py`` holds that and checks
every entry. The finder answers only these names and only after the ordinary finders found
nothing (it is appended to ``sys.meta_path`` by ``maskgrpo_ray/__init__.py``).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

MOVED: dict[str, str] = {
    # the config family: config/ (the tree's import point, maskgrpo_ray.config, is its __init__)
    "maskgrpo_ray.config_base": "maskgrpo_ray.config.base",
    "maskgrpo_ray.config_policy": "maskgrpo_ray.config.policy",
    "maskgrpo_ray.config_training": "maskgrpo_ray.config.training",
    "maskgrpo_ray.config_run": "maskgrpo_ray.config.run",
    "maskgrpo_ray.config_metrics": "maskgrpo_ray.config.metrics",
    "maskgrpo_ray.evaluation.metric_spec": "maskgrpo_ray.config.metrics",
    "maskgrpo_ray.config_docs": "maskgrpo_ray.config.docs",
    "maskgrpo_ray.builtin_configs": "maskgrpo_ray.config.builtin",
    # the commands: cli/ (the `maskgrpo` entry point, maskgrpo_ray.cli, is its __init__)
    "maskgrpo_ray.plan_cli": "maskgrpo_ray.cli.plan",
    "maskgrpo_ray.prompts_cli": "maskgrpo_ray.cli.prompts",
    "maskgrpo_ray.configs_cli": "maskgrpo_ray.cli.configs",
    # the step: step/
    "maskgrpo_ray.driver": "maskgrpo_ray.step.driver",
    "maskgrpo_ray.collect": "maskgrpo_ray.step.collect",
    "maskgrpo_ray.phases": "maskgrpo_ray.step.phases",
    "maskgrpo_ray.executor": "maskgrpo_ray.step.executor",
    "maskgrpo_ray.local": "maskgrpo_ray.step.local",
    "maskgrpo_ray.recovery": "maskgrpo_ray.step.recovery",
    "maskgrpo_ray.step_figures": "maskgrpo_ray.step.figures",
    "maskgrpo_ray.learner_core": "maskgrpo_ray.step.learner_core",
    "maskgrpo_ray.learner_loss": "maskgrpo_ray.step.learner_loss",
    # the Ray backend: backend/
    "maskgrpo_ray.ray_executor": "maskgrpo_ray.backend.executor",
    "maskgrpo_ray.ray_fleet": "maskgrpo_ray.backend.fleet",
    "maskgrpo_ray.ray_chunks": "maskgrpo_ray.backend.chunks",
    "maskgrpo_ray.ray_filter": "maskgrpo_ray.backend.filter",
    "maskgrpo_ray.ray_metrics": "maskgrpo_ray.backend.metrics",
    "maskgrpo_ray.ray_cluster": "maskgrpo_ray.backend.cluster",
    "maskgrpo_ray.weight_transfer": "maskgrpo_ray.backend.weight_transfer",
    # the embedded worlds: worlds/ (issue 38), the toy beside the GenEval-shaped world
    "maskgrpo_ray.toyworld": "maskgrpo_ray.worlds.toy.world",
    "maskgrpo_ray.models.toy": "maskgrpo_ray.worlds.toy.model",
    "maskgrpo_ray.rewards.rules": "maskgrpo_ray.worlds.toy.rewards",
}


class OldPathFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers an old path of :data:`MOVED` with the module at its new path."""

    def __init__(self) -> None:
        self._own_specs: dict[str, importlib.machinery.ModuleSpec | None] = {}

    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        new = MOVED[spec.name]
        warnings.warn(
            f"{spec.name} moved to {new}; the old path works until the next release",
            DeprecationWarning,
            stacklevel=2,  # the importing line (the import system's own frames are skipped)
        )
        module = importlib.import_module(new)
        # the import system sets the alias's spec on the module next; exec_module undoes that
        self._own_specs[spec.name] = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        alias = module.__spec__
        assert alias is not None
        module.__spec__ = self._own_specs.pop(alias.name)  # its own again (reload, -m, pickle)


def install() -> None:
    """Append the finder to ``sys.meta_path`` (once)."""
    if not any(isinstance(f, OldPathFinder) for f in sys.meta_path):
        sys.meta_path.append(OldPathFinder())
