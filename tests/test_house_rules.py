"""The house's size rules, computed: no file in ``maskgrpo_ray/``, ``actors/`` or ``learner/``
over 450 lines, no function over 80, and the list of functions over 60 lines in
``docs/architecture.md`` equal to the code's (between its ``functions-over-60`` markers).

``python tests/test_house_rules.py --write`` rewrites that list from the code; the test then
holds the doc to it, so it cannot go stale again.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("maskgrpo_ray", "actors", "learner")
MAX_FILE_LINES, MAX_FUNCTION_LINES, LISTED_OVER = 450, 80, 60
DOC = ROOT / "docs" / "architecture.md"
BEGIN, END = "<!-- functions-over-60: begin -->", "<!-- functions-over-60: end -->"


def sources() -> list[Path]:
    return sorted(p for folder in FOLDERS for p in (ROOT / folder).rglob("*.py"))


def function_lengths() -> dict[str, int]:
    """``path:qualified name`` -> lines from ``def`` to its last line (paths inside
    ``maskgrpo_ray/`` relative to it, the others to the repository)."""
    out: dict[str, int] = {}
    for path in sources():
        package = ROOT / FOLDERS[0]
        rel = path.relative_to(package if path.is_relative_to(package) else ROOT)
        _walk(ast.parse(path.read_text(), str(path)), f"{rel}:", out)
    return out


def _walk(node: ast.AST, prefix: str, out: dict[str, int]) -> None:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            name = f"{prefix}{child.name}"
            if not isinstance(child, ast.ClassDef):
                out[name] = (child.end_lineno or child.lineno) - child.lineno + 1
            _walk(child, name + ".", out)


def listed(text: str) -> set[str]:
    """The names in the doc's generated list."""
    block = text.split(BEGIN, 1)[1].split(END, 1)[0]
    return set(re.findall(r"`([^`]+:[^`]+)`", block))


def render() -> str:
    over = sorted(((n, k) for k, n in function_lengths().items() if n > LISTED_OVER), reverse=True)
    lines = [f"* `{k}` ({n} lines)" for n, k in over]
    return "\n".join([BEGIN, *lines, END])


def test_no_file_over_450_lines():
    long = {
        str(p.relative_to(ROOT)): n
        for p in sources()
        if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES
    }
    assert not long, long


def test_no_bench_script_over_450_lines():
    # bench/'s scripts are split by what they measure (bench_gpu's gpu_*.py, bench_cluster_sim's
    # cluster_sim_*.py, chaos_soak's chaos_*.py), each `python -m bench.NAME` as before
    long = {
        p.name: n
        for p in sorted((ROOT / "bench").glob("*.py"))
        if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES
    }
    assert not long, long


def test_no_function_over_80_lines():
    lengths = function_lengths()
    assert len(lengths) > 500  # every module was read
    long = {k: n for k, n in lengths.items() if n > MAX_FUNCTION_LINES}
    assert not long, long


def test_the_architecture_doc_lists_every_function_over_60_lines():
    want = {k for k, n in function_lengths().items() if n > LISTED_OVER}
    got = listed(DOC.read_text())
    assert got == want, (
        f"docs/architecture.md lists {sorted(got - want)} that are not over {LISTED_OVER} lines "
        f"and misses {sorted(want - got)}: run python tests/test_house_rules.py --write"
    )


def test_the_lister_reads_a_block():
    text = f"x\n{BEGIN}\n* `a.py:f` (61 lines)\n* `b/c.py:K.g` (70 lines)\n{END}\n`d.py:h`"
    assert listed(text) == {"a.py:f", "b/c.py:K.g"}


if __name__ == "__main__":
    if "--write" in sys.argv:
        text = DOC.read_text()
        head, rest = text.split(BEGIN, 1)
        DOC.write_text(head + render() + rest.split(END, 1)[1])
    print(render())
