"""The configs shipped inside the package: ``configs/*.yaml`` of the repository, installed as the
package data of ``maskgrpo_ray.configs`` (pyproject's ``package-dir``), so that a pip user has
them too.

``--config toy`` (a bare name, with or without ``.yaml``, that is not a file here) reads the
built-in ``toy.yaml``; a path that is not there fails in one line that names the built-in
configs. ``maskgrpo configs list|show|copy`` (:mod:`maskgrpo_ray.cli.configs`) lists, prints and
copies them. No torch, no ray.
"""

from __future__ import annotations

import importlib
import logging
from pathlib import Path

from maskgrpo_ray.errors import UserError

log = logging.getLogger(__name__)

PACKAGE = "maskgrpo_ray.configs"
SUFFIXES = ("", ".yaml", ".yml")


class NoSuchConfig(UserError, FileNotFoundError):
    """``--config`` names neither a file nor a built-in config."""


def folder() -> Path:
    """Where the built-in configs are: ``<site-packages>/maskgrpo_ray/configs`` in a pip install,
    the repository's ``configs/`` in a checkout (an editable install, or the checkout on the
    path). The package's ``__path__``, not ``importlib.resources``: in a checkout on the path the
    package is ``maskgrpo_ray/configs/__init__.py``, whose ``__path__`` reaches ``configs/``."""
    return Path(importlib.import_module(PACKAGE).__path__[0])


def names() -> list[str]:
    """The built-in configs' names (``toy``, ``showo_512_clip``, ...), sorted."""
    return sorted(p.stem for p in folder().glob("*.yaml"))


def path_of(name: str) -> Path:
    """The built-in config ``name`` (``.yaml`` optional); :class:`NoSuchConfig` naming the
    built-in ones when there is none of that name."""
    stem = name.removesuffix(".yaml").removesuffix(".yml")
    path = folder() / f"{stem}.yaml"
    if not path.is_file():
        raise NoSuchConfig(f"{name!r} is not a built-in config; built-in: {', '.join(names())}")
    return path


def summary(name: str, width: int = 100) -> str:
    """The first sentence of built-in config ``name``'s leading comment, cut to ``width``."""
    lines = []
    for line in path_of(name).read_text(encoding="utf-8").splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("# ").strip())
    sentence = " ".join(lines).split(". ")[0].rstrip(".")
    return sentence if len(sentence) <= width else sentence[: width - 3].rstrip() + "..."


def resolve(spec: str | Path) -> Path:
    """The YAML file ``--config spec`` means: ``spec`` itself when it exists, else the built-in
    config of that bare name (logged, with where it was read). Raises :class:`NoSuchConfig`
    (one line: the path, the built-in names, the fix) when it is neither."""
    path = Path(spec)
    if path.exists():
        return path
    text = str(spec)
    bare = "/" not in text and "\\" not in text and path.suffix in SUFFIXES
    if bare and path.stem in names():
        found = path_of(path.stem)
        log.info("--config %s: the built-in config %s", text, found)
        return found
    raise NoSuchConfig(
        f"--config {text}: no such file; the built-in configs are {', '.join(names())} "
        "(--config NAME reads one; `maskgrpo configs copy NAME` writes it here to edit)"
    )
