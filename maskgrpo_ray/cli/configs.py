"""``maskgrpo configs list|show|copy``: the configs shipped inside the package
(:mod:`maskgrpo_ray.config.builtin`).

    maskgrpo configs list                     # name, one-line description; where they are
    maskgrpo configs show showo_512_clip      # print one
    maskgrpo configs copy toy [DEST]          # write toy.yaml here (or DEST) to edit
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path
from typing import Any

from maskgrpo_ray.config import builtin
from maskgrpo_ray.errors import UserError


class CopyRefused(UserError, FileExistsError):
    """``maskgrpo configs copy`` would overwrite a file."""


def register(sub: Any) -> None:
    """Add the ``configs`` command to the ``maskgrpo`` sub-parsers."""
    p = sub.add_parser("configs", help="list, print or copy the built-in configs")
    ps = p.add_subparsers(dest="configs_command", required=True)
    ps.add_parser("list", help="the built-in configs (use one with --config NAME)")
    s = ps.add_parser("show", help="print a built-in config")
    s.add_argument("name")
    c = ps.add_parser("copy", help="write a built-in config to a file to edit")
    c.add_argument("name")
    c.add_argument("dest", nargs="?", default=None, help="file or folder (default: ./NAME.yaml)")
    c.add_argument("--force", action="store_true", help="overwrite DEST if it exists")


def copy(name: str, dest: str | None, force: bool) -> Path:
    """Copy built-in ``name`` to ``dest`` (a file, or a folder to put ``NAME.yaml`` in; default:
    ``./NAME.yaml``); :class:`CopyRefused` when the target exists and ``force`` is not set."""
    source = builtin.path_of(name)
    target = Path(dest) if dest else Path(source.name)
    if target.is_dir() or (dest or "").endswith("/"):
        target = target / source.name
    if target.exists() and not force:
        raise CopyRefused(f"{target} exists; pass --force to overwrite it, or another DEST")
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, target)
    return target


def run(args: argparse.Namespace) -> int:
    """``maskgrpo configs ...``: 0 done; a bad name or a refused copy raises a UserError (exit 2)."""
    if args.configs_command == "list":
        names = builtin.names()
        width = max(len(n) for n in names)
        for name in names:
            print(f"{name.ljust(width)}  {builtin.summary(name)}")
        print(f"\n(in {builtin.folder()}; use one with --config NAME)")
    elif args.configs_command == "show":
        print(builtin.path_of(args.name).read_text(encoding="utf-8"), end="")
    else:
        target = copy(args.name, args.dest, args.force)
        print(f"wrote {target}; use it with --config {target}")
    return 0
