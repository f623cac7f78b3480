"""The flat layout's module paths keep working for one release (issues 33 and 38, maskgrpo_ray/_moved.py).

Every old path of ``_moved.MOVED`` imports and is the moved module itself (so every name it
exports is the new module's object), warns once naming the new path, and no file at the old
path is left to shadow it; no code, test, bench or doc of the repository names an old path any
more; the two modules that became packages (``maskgrpo_ray.config``, ``maskgrpo_ray.cli``) still
provide what they did, and the ``maskgrpo`` command starts through both of its entry points.
"""

from __future__ import annotations

import ast
import importlib
import os
import re
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from maskgrpo_ray._moved import MOVED
from maskgrpo_ray.cli import app

ROOT = Path(__file__).resolve().parents[1]
# the repository's text files that may name a module: code, tests, benches, docs, deployment
SKIP_DIRS = {"runs", "cache", "__pycache__", "build", "dist"}  # outputs; hidden folders too
TEXT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".toml", ".sh", ".json", ".txt", ".cfg", ""}
ALLOWED = {ROOT / "maskgrpo_ray" / "_moved.py", Path(__file__).resolve()}  # the table, this file
_OLD = [
    k.removeprefix("maskgrpo_ray.").split(".") for k in MOVED
]  # ["driver"], ["evaluation", ...]
OLD_NAME = re.compile(r"maskgrpo_ray\.(?:" + "|".join(r"\.".join(o) for o in _OLD) + r")\b")
OLD_FILE = re.compile(r"maskgrpo_ray/(?:" + "|".join("/".join(o) for o in _OLD) + r")\.py\b")
OLD_LEAVES = {k.removeprefix("maskgrpo_ray.") for k in MOVED if k.count(".") == 1}


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_is_the_moved_module(old):
    new = importlib.import_module(MOVED[old])
    module = importlib.import_module(old)
    assert module is new
    # its names are the new module's objects, through every form of import
    names = [n for n in vars(new) if not n.startswith("__")]
    assert names
    for name in names:
        assert getattr(module, name) is getattr(new, name)
    package, _, leaf = old.rpartition(".")
    assert getattr(importlib.import_module(package), leaf) is new  # from package import leaf
    # and the module keeps its own identity (reload, pickling by reference, python -m)
    assert new.__name__ == new.__spec__.name == MOVED[old]
    assert not (ROOT / (old.replace(".", "/") + ".py")).exists()  # nothing left to shadow it
    assert Path(new.__file__).is_relative_to(ROOT / "maskgrpo_ray")


def test_an_old_path_warns_once_at_the_importing_line_and_unpickles():
    code = (
        "import pickle, warnings\n"
        "warnings.simplefilter('always')\n"
        "with warnings.catch_warnings(record=True) as seen:\n"
        "    import maskgrpo_ray.driver as old\n"
        "    from maskgrpo_ray.driver import RunFailed\n"
        "import maskgrpo_ray.step.driver as new\n"
        "assert old is new and RunFailed is new.RunFailed\n"
        "print(len(seen), seen[0].category.__name__, seen[0].filename)\n"
        "print(seen[0].message)\n"
        # a pickle written before the move names the old path: it still loads
        "assert pickle.loads(b'cmaskgrpo_ray.ray_fleet\\nRolloutFleet\\n.').__module__ == "
        "'maskgrpo_ray.backend.fleet'\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    counts, message = out.stdout.splitlines()
    assert counts == "1 DeprecationWarning <string>"
    assert message.startswith("maskgrpo_ray.driver moved to maskgrpo_ray.step.driver;")


def test_an_unknown_module_is_still_an_import_error():
    with pytest.raises(ModuleNotFoundError, match="maskgrpo_ray.no_such_module"):
        importlib.import_module("maskgrpo_ray.no_such_module")


def test_every_target_is_a_module_of_the_new_packages():
    packages = ("config", "step", "backend", "cli", "worlds")
    for old, new in MOVED.items():
        assert new.split(".")[1] in packages, (old, new)
        assert (ROOT / (new.replace(".", "/") + ".py")).is_file(), new


def _repository_text_files():
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.endswith(".egg-info")]
        dirs[:] = [d for d in dirs if not d.startswith(".") or d == ".ci"]  # caches, .git
        for name in files:
            path = Path(folder) / name
            if path.suffix in TEXT_SUFFIXES and path not in ALLOWED and path.name != "ISSUE_33.md":
                yield path


def test_no_code_test_bench_or_doc_names_an_old_path():
    found = []
    for path in _repository_text_files():
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        where = path.relative_to(ROOT)
        found += [f"{where}: {m.group(0)}" for m in OLD_NAME.finditer(text)]
        found += [f"{where}: {m.group(0)}" for m in OLD_FILE.finditer(text)]
        if path.suffix == ".py":  # from maskgrpo_ray import driver
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, ast.ImportFrom) and node.module == "maskgrpo_ray":
                    found += [
                        f"{where}: import {a.name}" for a in node.names if a.name in OLD_LEAVES
                    ]
    assert not found, "\n".join(found)


def test_the_checker_sees_an_old_path():
    text = "from maskgrpo_ray.ray_executor import RayExecutor  # see maskgrpo_ray/config_run.py"
    assert OLD_NAME.search(text) and OLD_FILE.search(text)
    assert not OLD_NAME.search("maskgrpo_ray.backend.executor maskgrpo_ray.step.driver")


def test_the_cli_package_gives_the_old_modules_names_as_apps_objects():
    import maskgrpo_ray.cli as cli

    names = [n for n in vars(app) if not n.startswith("__")]
    assert {"main", "run_train", "train_command", "validate_command", "_parser"} <= set(names)
    for name in names:
        assert getattr(cli, name) is getattr(app, name)
    with pytest.raises(AttributeError, match="no attribute 'nosuch'"):
        _ = cli.nosuch


def test_the_console_script_and_python_m_start_the_command():
    (script,) = [e for e in entry_points(group="console_scripts") if e.name == "maskgrpo"]
    assert script.value == "maskgrpo_ray.cli:main" and script.load() is app.main
    out = subprocess.run(
        [sys.executable, "-m", "maskgrpo_ray.cli", "configs", "list"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "toy" in out.stdout
