"""Benchmark results are evidence: a results file a script writes under ``bench/`` by default is
not ignored by git (only scratch output and the toy lab's cache are), and no code cites a results
file the repository does not hold (issue 57: the H100 results were ignored and lost)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _ignored(rel: str) -> bool:
    """``git check-ignore`` on a path (it need not exist): exit 0 ignored, 1 not."""
    done = subprocess.run(
        ["git", "-C", str(ROOT), "check-ignore", "-q", "--no-index", rel], check=False
    )
    assert done.returncode in (0, 1), f"git check-ignore failed on {rel}: {done.returncode}"
    return done.returncode == 0


@pytest.mark.skipif(
    shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs a git checkout"
)
def test_default_results_files_are_not_ignored_scratch_is():
    # the default --out of bench/frontier.py and bench/bench_gpu.py, and a made-up one
    for rel in ("bench/results_frontier.json", "bench/results_gpu.json", "bench/results_x.json"):
        assert not _ignored(rel), f"{rel} is ignored: a bench's default output must be committable"
    for rel in ("bench/scratch/results_frontier.json", "bench/cache/abc.json"):
        assert _ignored(rel), f"{rel} is scratch output and must stay ignored"


def test_the_package_cites_only_results_files_that_exist():
    cited = {
        (m.group(0), str(p.relative_to(ROOT)))
        for p in (ROOT / "maskgrpo_ray").rglob("*.py")
        for m in re.finditer(r"bench/results[\w.-]*\.json", p.read_text())
    }
    missing = sorted((f, where) for f, where in cited if not (ROOT / f).exists())
    assert not missing, f"cited results files that are not in the repository: {missing}"
