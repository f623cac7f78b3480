"""The repository stands alone (issue 55): a clone with nothing beside it passes its tests.

Every file the tests read is inside the repository (the Show-o reference fixtures in
``tests/fixtures/showo_reference``, ``SHOWO_REFERENCE_FIXTURES`` an override), and no file of the
repository names a path that leaves it: a ``../`` path must resolve, from the file's own folder,
to a file or folder of the repository. ``.ci/run`` also runs the fixture tests once from a copy
of the tracked files in an empty folder, so CI tests what a clone gets.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest
import showo_helpers

ROOT = Path(__file__).resolve().parents[1]
# folders a checkout makes or holds that are not the repository's files
NOT_OURS = {
    ".git",
    ".venv",
    "venv",
    "runs",
    "build",
    "dist",
    ".cache",
    ".whl",
    "__pycache__",
    ".mypy_cache",
    ".pytest_cache",
    ".ruff_cache",
}
TEXT = {".py", ".md", ".yaml", ".yml", ".toml", ".txt", ".sh", ".json", ".cfg", ".ini", ""}
# a relative path that climbs (one or more "../", then the rest) in code, docs, links, comments
CLIMB = re.compile(r"(?<![\w.])((?:\.\./)+[\w.\-/]*)")
UP = ".." + "/"  # written so, this file holds no climbing path of its own
FIXTURE_FILES = (
    "tiny_showo_config.json",
    "tiny_showo_weights.safetensors",
    "tiny_showo_io.safetensors",
    "tiny_magvit_config.json",
    "tiny_magvit_weights.safetensors",
    "tiny_magvit_io.safetensors",
    "showo_512_state_keys.json",
    "magvitv2_state_keys.json",
    "full_size_configs.json",
)


def repository_text_files() -> list[Path]:
    out = []
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in NOT_OURS and not d.endswith(".egg-info")]
        for name in files:
            path = Path(folder) / name
            if path.suffix in TEXT:
                out.append(path)
    return out


def leaves_the_repository(path: Path, climb: str) -> bool:
    """``climb`` (a relative path starting with ``..``) written in ``path``: it stays inside
    only if, from the file's folder, it reaches something the repository holds."""
    target = (path.parent / climb).resolve()
    return not (target.is_relative_to(ROOT) and target.exists())


def test_no_file_names_a_path_outside_the_repository():
    files = repository_text_files()
    assert len(files) > 300  # the walk saw the repository
    outside = [
        f"{p.relative_to(ROOT)}:{n}: {m}"
        for p in files
        for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
        for m in CLIMB.findall(line)
        if leaves_the_repository(p, m)
    ]
    assert not outside, "paths leaving the repository:\n" + "\n".join(outside)


def test_the_checker_sees_a_path_that_leaves():
    doc = ROOT / "docs" / "showo.md"
    assert leaves_the_repository(doc, f"{UP}{UP}shared/fixtures/showo_reference")
    assert leaves_the_repository(ROOT / "tests" / "x.py", f"{UP}shared/reference/notes.md")
    assert not leaves_the_repository(doc, f"{UP}README.md")
    line = f"see `{UP}shared/x.md` and ({UP}README.md)"
    assert CLIMB.findall(line) == [f"{UP}shared/x.md", f"{UP}README.md"]


def test_the_fixtures_resolve_inside_the_repository(monkeypatch):
    monkeypatch.delenv(showo_helpers.ENV_VAR, raising=False)
    showo_helpers.fixture_dir.cache_clear()
    try:
        found = showo_helpers.fixture_dir()
    finally:
        showo_helpers.fixture_dir.cache_clear()
    assert found == ROOT / "tests" / "fixtures" / "showo_reference"
    missing = [f for f in FIXTURE_FILES if not (found / f).is_file()]
    assert not missing and (found / "README.md").is_file(), missing


def test_the_fixture_variable_still_overrides(monkeypatch, tmp_path):
    elsewhere = tmp_path / "my_fixtures"
    shutil.copytree(ROOT / "tests" / "fixtures" / "showo_reference", elsewhere)
    monkeypatch.setenv(showo_helpers.ENV_VAR, str(elsewhere))
    showo_helpers.fixture_dir.cache_clear()
    try:
        assert showo_helpers.fixture_dir() == elsewhere.resolve()
        monkeypatch.setenv(showo_helpers.ENV_VAR, str(tmp_path / "nowhere"))
        showo_helpers.fixture_dir.cache_clear()
        with pytest.raises(pytest.fail.Exception, match="SHOWO_REFERENCE_FIXTURES="):
            showo_helpers.fixture_dir()
    finally:
        showo_helpers.fixture_dir.cache_clear()
