"""Optional features and what installs them (no torch, no ray).

A default ``maskgrpo train`` (local and Ray), ``maskgrpo eval`` and ``maskgrpo plan`` need only
``[project].dependencies``. A feature beyond them imports its package when it is used, and a
missing package ends in one line naming the pip extra that installs it (``maskgrpo`` prints a
:class:`MissingExtra` as ``maskgrpo: <message>`` and exits 2). A checkout set up with ``make``
has every extra (``requirements.txt``).

ImageReward is the exception: the ``image-reward`` package's metadata pins an old ``timm`` that
open_clip refuses, so it cannot be an extra that pip resolves; it is installed ``--no-deps``
(:data:`NODEPS_INSTALL`, the same pins as ``requirements-nodeps.txt``; docs/dependencies.md).

``tests/test_dependencies.py`` holds this table, ``pyproject.toml`` and every module's imports
against each other.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

from maskgrpo_ray.errors import UserError

DISTRIBUTION = "maskgrpo-ray"

EXTRAS: dict[str, str] = {  # top-level import name -> the extra that installs it
    "pyarrow": "parquet",  # Parquet prompt files (data.prompts: *.parquet)
    "torch_fidelity": "fid",  # the fid metric (FID and KID) of maskgrpo eval
    "tensorboard": "trackers",  # logging.trackers
    "wandb": "trackers",
    "mlflow": "trackers",
    "s3fs": "s3",  # run.storage: s3://...
}

# image-reward's own pins clash with ours (timm==0.6.13); these two, without their dependencies,
# are all the reward needs beside what is installed already. Equal to requirements-nodeps.txt.
NODEPS_PINS = ("image-reward==1.5", "fairscale==0.4.13")
NODEPS_INSTALL = "pip install --no-deps " + " ".join(NODEPS_PINS)


class MissingExtra(UserError, ImportError):
    """A feature's optional package is not installed; the message names the extra."""


def install_hint(module: str) -> str:
    """The pip command that installs ``module``'s extra: ``pip install 'maskgrpo-ray[fid]'``."""
    return f"pip install '{DISTRIBUTION}[{EXTRAS[module]}]'"


def missing(module: str, feature: str) -> MissingExtra:
    """The one-line error for ``feature`` without ``module`` installed."""
    return MissingExtra(
        f"{feature} needs the {module!r} package, which is not installed: {install_hint(module)}"
    )


def require(module: str, feature: str) -> ModuleType:
    """Import ``module`` (a key of :data:`EXTRAS`, or one of its submodules) for ``feature``;
    :class:`MissingExtra` when its package is not installed. An ImportError from inside an
    installed package (a broken install) is raised as it is."""
    top = module.split(".")[0]
    if top not in EXTRAS:
        raise KeyError(f"{top!r} is not an optional package (maskgrpo_ray.extras.EXTRAS)")
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as err:
        if err.name is not None and err.name.split(".")[0] == top:
            raise missing(top, feature) from None
        raise


def check(module: str, feature: str) -> None:
    """:class:`MissingExtra` when ``module``'s package is not installed (nothing imported)."""
    if importlib.util.find_spec(module) is None:
        raise missing(module, feature)
