"""The declared dependencies match the imports.

Every module of the package (``maskgrpo_ray/``, ``actors/``, ``learner/``) is parsed (ast) for
what it imports, including the names it imports by string (``importlib.import_module("X")``,
``find_spec("X")``, ``extras.require("X", ...)``); each top-level name is mapped to the
distribution that provides it in this environment (``importlib.metadata.packages_distributions``)
and held against ``pyproject.toml``: in ``[project].dependencies``, or, for an optional package
(``maskgrpo_ray.extras.EXTRAS``), in the extra the code names when it is missing. The tests,
benchmarks and docs scripts may also use the ``dev`` extra. ``requirements.txt`` (what ``make``
installs) must pin every declared distribution within its declared range.

The next import of an undeclared package fails here, in CI, not for a pip user at the end of a
run (issue 34: ``matplotlib`` was imported by every run and declared nowhere).
"""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass
from importlib.metadata import packages_distributions, version
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from maskgrpo_ray.extras import EXTRAS, NODEPS_PINS

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = ("maskgrpo_ray", "actors", "learner")
FIRST_PARTY = {"maskgrpo_ray", "actors", "learner", "__future__"}
STRING_IMPORTERS = {"import_module", "find_spec", "require", "check"}  # f("name", ...)
NODEPS = {canonicalize_name(Requirement(p).name) for p in NODEPS_PINS}


@dataclass(frozen=True)
class Declared:
    core: frozenset[str]  # canonical distribution names
    extras: dict[str, frozenset[str]]  # extra -> its distributions (self-references expanded)
    specs: dict[str, Requirement]  # distribution -> its requirement (specifier)


def declared(pyproject_text: str) -> Declared:
    project = tomllib.loads(pyproject_text)["project"]
    own = canonicalize_name(project["name"])
    specs: dict[str, Requirement] = {}

    def names(reqs: Iterable[str]) -> tuple[set[str], set[str]]:
        dists, refs = set(), set()
        for text in reqs:
            req = Requirement(text)
            name = canonicalize_name(req.name)
            if name == own:
                refs |= set(req.extras)
            else:
                dists.add(name)
                specs[name] = req
        return dists, refs

    core, _ = names(project["dependencies"])
    raw = {k: names(v) for k, v in project.get("optional-dependencies", {}).items()}
    extras = {}
    for extra, (dists, refs) in raw.items():
        extras[extra] = frozenset(dists.union(*(raw[r][0] for r in refs)))
    return Declared(frozenset(core), extras, specs)


def _type_checking_only(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(test or ast.Pass())


def imported_names(path: Path) -> dict[str, bool]:
    """``{top-level name: imported at module level}`` of what ``path`` imports (not under
    ``if TYPE_CHECKING:``; relative imports and the standard library left out)."""
    out: dict[str, bool] = {}

    def add(name: str, top_level: bool) -> None:
        top = name.split(".")[0]
        if top and top not in sys.stdlib_module_names and top not in FIRST_PARTY:
            out[top] = out.get(top, False) or top_level

    def visit(node: ast.AST, top_level: bool) -> None:
        if _type_checking_only(node):
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, top_level)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            add(node.module, top_level)
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            fname = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            first = getattr(node.args[0], "value", None)  # a constant's value
            name_like = isinstance(first, str) and re.fullmatch(r"[A-Za-z_][\w.]*", first)
            if fname in STRING_IMPORTERS and name_like:
                add(str(first), False)
        inner = top_level and not isinstance(
            node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda | ast.ClassDef
        )
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(ast.parse(path.read_text()), True)
    return out


def sources(*dirs: str) -> list[Path]:
    return sorted(p for d in dirs for p in (ROOT / d).rglob("*.py") if ".venv" not in p.parts)


@pytest.fixture(scope="module")
def dists_of() -> dict[str, set[str]]:
    return {k: {canonicalize_name(d) for d in v} for k, v in packages_distributions().items()}


@pytest.fixture(scope="module")
def project() -> Declared:
    return declared((ROOT / "pyproject.toml").read_text())


def undeclared(
    files: list[Path], dec: Declared, dists_of: dict[str, set[str]], allowed_extras: set[str]
) -> list[str]:
    """One line per import no declaration covers: core for any name, or the extra EXTRAS
    names for an optional one, or one of ``allowed_extras`` (tests: dev)."""
    problems = []
    for path in files:
        for name in sorted(imported_names(path)):
            dists = dists_of.get(name, set())
            where = f"{path.relative_to(ROOT)} imports {name!r}"
            if not dists:
                problems.append(f"{where}: no installed distribution provides it")
                continue
            ok = set(dec.core)
            if name in EXTRAS:
                ok |= dec.extras.get(EXTRAS[name], frozenset())
            for extra in allowed_extras:
                ok |= dec.extras.get(extra, frozenset())
            if not dists & (ok | NODEPS):
                extra = (
                    f"its extra {EXTRAS[name]!r}"
                    if name in EXTRAS
                    else "an extra the code names (maskgrpo_ray/extras.py)"
                )
                problems.append(
                    f"{where} (distribution {'/'.join(sorted(dists))}): in neither "
                    f"[project].dependencies nor {extra}"
                )
    return problems


def test_every_import_of_the_package_is_declared(project, dists_of):
    files = sources(*PACKAGE_DIRS)
    assert len(files) >= 90
    problems = undeclared(files, project, dists_of, allowed_extras=set())
    assert not problems, "\n".join(problems)


# Imported only by the GenEval detector's parity check against mmdetection's own model
# (bench/geneval_mmdet_parity.py and its slow test, which skips without them): they run in a
# separate environment of their own (bench/geneval_mmdet_parity.py's docstring says how to build it), never the project's.
OWN_ENVIRONMENT = {"mmdet", "mmcv"}


def test_tests_benchmarks_and_docs_scripts_import_only_declared_packages(project, dists_of):
    files = sources("tests", "bench", "docs")
    local = {p.stem for p in files}  # tests' and benchmarks' own helper modules
    local |= {p.parent.name for p in files if p.name == "__init__.py"}  # and bench/, a package
    local |= OWN_ENVIRONMENT
    problems = [
        p
        for p in undeclared(files, project, dists_of, allowed_extras={"dev"})
        if p.split("'")[1] not in local
    ]
    assert not problems, "\n".join(problems)


def test_the_check_fails_when_a_declaration_is_removed(dists_of):
    # matplotlib out of [project].dependencies: the modules that import it are named
    text = (ROOT / "pyproject.toml").read_text()
    cut = re.sub(r'^\s*"matplotlib[^"]*",\n', "", text, flags=re.M)
    assert cut != text
    problems = undeclared(sources("maskgrpo_ray"), declared(cut), dists_of, set())
    assert {p.split(" ")[0] for p in problems} == {
        "maskgrpo_ray/runlog/run_log.py",
        "maskgrpo_ray/runlog/monitors.py",  # monitors_figure (issue 48; this set missed it)
        "maskgrpo_ray/evaluation/report.py",
    }, problems
    # pyarrow's extra emptied: prompts/loading.py's Parquet reader is named
    cut = re.sub(r"^parquet = \[.*\]$", "parquet = []", text, flags=re.M)
    problems = undeclared(sources("maskgrpo_ray"), declared(cut), dists_of, set())
    assert [p.split(" ")[0] for p in problems] == ["maskgrpo_ray/prompts/loading.py"], problems
    assert "its extra 'parquet'" in problems[0]


def test_optional_packages_are_in_their_extra_only_and_imported_lazily(project, dists_of):
    for module, extra in EXTRAS.items():
        assert extra in project.extras, f"EXTRAS names extra {extra!r}; pyproject has none"
        dists = dists_of.get(module, set())
        assert dists & project.extras[extra], f"{module!r}: not in extra {extra!r}"
        assert not dists & project.core, f"{module!r} is a core dependency and an extra"
    named = set(EXTRAS.values()) | {"dev"}
    assert set(project.extras) == named, "an extra no code names (maskgrpo_ray/extras.py)"
    optional = set(EXTRAS) | {"ImageReward", "fairscale"}
    eager = [
        f"{path.relative_to(ROOT)}: {name}"
        for path in sources(*PACKAGE_DIRS)
        for name, top_level in imported_names(path).items()
        if top_level and name in optional
    ]
    assert not eager, f"optional packages imported at module level: {eager}"


def _pins(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        text = line.split("#")[0].strip()
        if text:
            req = Requirement(text)
            (spec,) = req.specifier
            assert spec.operator == "==", f"{path.name}: {text} is not an exact pin"
            out[canonicalize_name(req.name)] = spec.version
    return out


def test_requirements_pin_every_declared_distribution_within_its_range(project):
    # a declared range is pinned inside it; a bare name is at least installed by make
    pins = _pins(ROOT / "requirements.txt")
    for name, req in sorted(project.specs.items()):
        if not req.specifier:
            assert version(name), name  # raises PackageNotFoundError when missing
            continue
        assert name in pins, f"{name} is declared as {req} but not pinned in requirements.txt"
        assert req.specifier.contains(pins[name], prereleases=True), (
            f"requirements.txt pins {name}=={pins[name]}, outside pyproject's {req}"
        )
    assert _pins(ROOT / "requirements-nodeps.txt") == dict(
        (canonicalize_name(Requirement(p).name), p.split("==")[1]) for p in NODEPS_PINS
    )


def test_imported_names_reads_every_form(tmp_path):
    src = tmp_path / "m.py"
    src.write_text(
        "from __future__ import annotations\n"
        "import os, numpy.linalg as la\n"
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    import _typeshed\n"
        "from . import sibling\n"
        "def f():\n    import yaml\n    importlib.import_module('ImageReward.models')\n"
        "    require('pyarrow.parquet', 'x')\n    find_spec(name)\n"
    )
    assert imported_names(src) == {
        "numpy": True,
        "yaml": False,
        "ImageReward": False,
        "pyarrow": False,
    }
