"""No import circle in the house.

Every module of ``maskgrpo_ray`` (with ``actors/`` and ``learner/``, installed as
``maskgrpo_ray.actors`` and ``maskgrpo_ray.learner``) is parsed with ``ast``; the imports it makes
when it is loaded (at module level, including ``if TYPE_CHECKING:`` blocks: a type-only import
is still a dependency a reader follows, and the next refactor turns it into a runtime one) form
a directed graph that must be acyclic. Imports inside functions (lazy imports) are collected
separately: they run only when called and are how a lower room may reach a plugin or a heavy
dependency, so they are reported (``python tests/test_import_graph.py``) and held to a list
that a new one has to join knowingly.

An import of ``a.b.c`` depends on module ``a.b.c`` and on the ``__init__`` of every package
above it that the importer is not itself inside (loading ``a.b.c`` runs ``a/b/__init__.py``).
``from a.b import c`` depends on ``a.b.c`` when that is a module, else on ``a.b``.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {  # folder -> the package name it installs as (pyproject's package-dir)
    "maskgrpo_ray": "maskgrpo_ray",
    "actors": "maskgrpo_ray.actors",
    "learner": "maskgrpo_ray.learner",
}

# maskgrpo_ray/{actors,learner,configs}/__init__.py: a checkout's stand-ins for the folders above
# (their __path__ reaches them; the wheel ships the folders there instead): not modules of their own
STAND_INS = {
    ROOT / "maskgrpo_ray" / name / "__init__.py" for name in ("actors", "learner", "configs")
}

Edge = tuple[str, str, int]  # (importer, imported, line)


def module_files() -> dict[str, Path]:
    """Module name -> its file, for every module of the installed package."""
    out: dict[str, Path] = {}
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path in STAND_INS:
                continue
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([package, *parts])] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST, in_function: bool = False) -> Iterator[tuple[ast.stmt, bool]]:
    """Every import statement with whether it sits inside a function body."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node, in_function
        inside = in_function or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        yield from _imports(node, inside)


def _targets(
    node: ast.stmt, importer: str, is_package: bool, modules: dict[str, Path]
) -> list[str]:
    """The house's modules one import statement names (outside imports: none)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        assert isinstance(node, ast.ImportFrom)
        base = node.module or ""
        if node.level:  # relative: from the importer's package
            pkg = importer.split(".") if is_package else importer.split(".")[:-1]
            pkg = pkg[: len(pkg) - (node.level - 1)]
            base = ".".join([*pkg, base] if base else pkg)
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
    out = []
    for name in names:
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            target = ".".join(parts[:i])
            if target not in modules or target == importer:
                continue
            # a package's __init__ counts unless the importer is inside that package
            if i < len(parts) and importer.startswith(target + "."):
                continue
            out.append(target)
    return out


def import_edges() -> tuple[list[Edge], list[Edge]]:
    """(load-time edges, function-level edges) over the house's modules."""
    modules = module_files()
    eager: list[Edge] = []
    lazy: list[Edge] = []
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        for node, in_function in _imports(tree):
            for target in _targets(node, name, path.name == "__init__.py", modules):
                (lazy if in_function else eager).append((name, target, node.lineno))
    return sorted(set(eager)), sorted(set(lazy))


def find_cycles(edges: list[Edge]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    graph: dict[str, set[str]] = {}
    for a, b, _ in edges:
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:  # recursion depth <= number of modules (~100)
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph[v]:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _short(name: str) -> str:
    return name.removeprefix("maskgrpo_ray.")


# Function-level imports that close a circle with the load-time graph, each on purpose. A new
# one must be added here knowingly (and is better avoided). None is left: the last one, the
# config asking the model registry for a kind's rules, became the kinds registering their rules
# in ``config.kinds`` (issue 55).
LAZY_CIRCLES_ALLOWED: set[tuple[str, str]] = set()


def test_the_module_graph_is_read_from_every_file():
    modules = module_files()
    eager, _ = import_edges()
    # the graph covers the three folders and sees a known edge of each kind
    assert {
        "maskgrpo_ray.loop.driver",
        "maskgrpo_ray.actors.pool",
        "maskgrpo_ray.learner.group",
    } <= set(modules)
    pairs = {(a, b) for a, b, _ in eager}
    assert ("maskgrpo_ray.loop.driver", "maskgrpo_ray.loop.collect") in pairs
    assert ("maskgrpo_ray.learner.weight_sync", "maskgrpo_ray.learner.group") in pairs


def test_the_checker_finds_a_circle():
    # a -> b -> c -> a and a self-contained d -> e: one circle of three
    edges = [("a", "b", 1), ("b", "c", 1), ("c", "a", 1), ("d", "e", 1)]
    assert find_cycles(edges) == [["a", "b", "c"]]
    assert find_cycles(edges[1:]) == []


def test_no_import_circle_at_load_time():
    eager, _ = import_edges()
    cycles = find_cycles(eager)
    lines = []
    for comp in cycles:
        members = set(comp)
        lines += [f"{a} -> {b} (line {n})" for a, b, n in eager if a in members and b in members]
    assert not cycles, "import circles:\n" + "\n".join(sorted(lines))


def lazy_circles() -> list[tuple[str, str, int]]:
    """Function-level imports ``a -> b`` where ``b`` already reaches ``a`` at load time."""
    eager, lazy = import_edges()
    reach: dict[str, set[str]] = {}
    for a, b, _ in eager:
        reach.setdefault(a, set()).add(b)

    def reaches(src: str, dst: str) -> bool:
        seen, todo = set(), [src]
        while todo:
            v = todo.pop()
            if v == dst:
                return True
            if v not in seen:
                seen.add(v)
                todo += reach.get(v, ())
        return False

    return sorted({(a, b, n) for a, b, n in lazy if reaches(b, a)})


def test_lazy_imports_close_no_new_circle():
    found = {(a, b) for a, b, _ in lazy_circles()}
    assert found <= LAZY_CIRCLES_ALLOWED, sorted(found - LAZY_CIRCLES_ALLOWED)
    stale = sorted(LAZY_CIRCLES_ALLOWED - found)
    assert not stale, f"LAZY_CIRCLES_ALLOWED names circles no import closes (remove them): {stale}"


def main() -> None:
    eager, lazy = import_edges()
    print(f"{len(module_files())} modules, {len(eager)} load-time imports, {len(lazy)} lazy")
    for comp in find_cycles(eager):
        print("CIRCLE:", " <-> ".join(map(_short, comp)))
    for a, b, n in lazy_circles():
        print(f"lazy import closing a circle: {_short(a)}:{n} -> {_short(b)}")
    if "-v" in sys.argv:
        for a, b, n in sorted(lazy):
            print(f"lazy: {_short(a)}:{n} -> {_short(b)}")


if __name__ == "__main__":
    main()
