"""The house's layering: which room (package) may import which when it loads.

A room is a top-level package of ``maskgrpo_ray`` (``algo``, ``config``, ``loop``, ...; ``actors``
and ``learner``, installed as ``maskgrpo_ray.actors`` and ``maskgrpo_ray.learner``) or one of the
four modules left at the top (``__init__``, ``api``, ``errors``, ``extras``). :data:`ROOMS` says
what each holds and which rooms it imports at load time (module level, ``if TYPE_CHECKING:``
blocks included, as ``tests/test_import_graph.py`` counts them; imports inside functions are
the lazy ones and not a room's dependency). The test holds the code to the table both ways: a
room importing one it may not fails, and so does a permission no import uses (the table is the
code's, not a wish), a module in no room, or a circle among the rooms. ``docs/architecture.md``
shows the table between its ``rooms`` markers; ``python tests/test_layering.py --write``
rewrites it from here and the test holds the page to it.
"""

from __future__ import annotations

import sys
from pathlib import Path

from test_import_graph import find_cycles, import_edges, module_files

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
BEGIN, END = "<!-- rooms: begin -->", "<!-- rooms: end -->"

# room -> (what it holds, the rooms it imports at load time). Listed from the ground up.
ROOMS: dict[str, tuple[str, set[str]]] = {
    "errors": ("`UserError`: the one-line errors a user sees", set()),
    "extras": ("which optional package belongs to which pip extra", {"errors"}),
    "algo": ("the paper's math on tensors, and the diversity figures (torch only)", set()),
    "planner": ("`maskgrpo plan`'s cost model and split (no torch)", set()),
    "cluster": ("what every Ray process shares: attach, Ray metrics, weight transfer", {"errors"}),
    "runlog": ("the run's log: `metrics.jsonl` and curves, trackers, monitors", {"extras"}),
    "config": ("the config tree (pydantic, no torch)", {"errors", "runlog"}),
    "checkpoints": ("where a run's checkpoints live: storage, the run's store", {"config"}),
    "weights": ("weight files read safely, hub ids and their resolution", {"config", "errors"}),
    "models": (
        "policies behind a registry: Show-o, aMUSEd, LoRA",
        {"algo", "config", "errors", "weights"},
    ),
    "prompts": (
        "prompt sets and files, generated prompts, GenEval's schema and rule",
        {"errors", "models"},
    ),
    "rewards": (
        "reward components behind a registry: CLIP, ImageReward, PickScore, GenEval",
        {"errors", "extras", "prompts", "weights"},
    ),
    "worlds": (
        "the embedded worlds (toy, shapes), their shipped weights, the simulated accelerator",
        {"config", "errors", "models", "planner", "prompts", "rewards", "weights"},
    ),
    "pipeline": (
        "what a step is made of: settings, messages, phases, the update",
        {"algo", "config", "errors", "models", "rewards", "runlog"},
    ),
    "evaluation": (
        "`maskgrpo eval`: generation, metrics, FID, GenEval, the report",
        {
            "algo",
            "config",
            "errors",
            "extras",
            "models",
            "pipeline",
            "prompts",
            "rewards",
            "worlds",
        },
    ),
    "loop": (
        "the step loop, the same for every backend: driver, collect, recovery",
        {
            "algo",
            "checkpoints",
            "config",
            "evaluation",
            "models",
            "pipeline",
            "prompts",
            "runlog",
            "weights",
        },
    ),
    "actors": (
        "thin Ray actors: rollout, reward, filter, control, the pool",
        {"algo", "cluster", "config", "errors", "evaluation", "models", "pipeline", "rewards"},
    ),
    "learner": (
        "the learner ranks: group, worker, weight sync",
        {"actors", "cluster", "config", "errors", "loop", "models", "pipeline", "weights"},
    ),
    "backend": (
        "the Ray backend: RayExecutor, the fleet, chunks, the filter actor",
        {
            "actors",
            "cluster",
            "config",
            "evaluation",
            "learner",
            "loop",
            "models",
            "pipeline",
            "weights",
        },
    ),
    "cli": (
        "the commands (`cli/__init__` imports nothing: `cli.app` on first use)",
        {"checkpoints", "config", "errors", "loop", "planner", "prompts", "weights"},
    ),
    "api": ("the commands as Python functions", {"config"}),
    "__init__": ("`import maskgrpo_ray`: the API, loaded on first use", {"api"}),
}


def room_of(module: str) -> str:
    """``maskgrpo_ray.loop.driver`` -> ``loop``; ``maskgrpo_ray`` -> ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def room_edges() -> dict[tuple[str, str], list[str]]:
    """(importer's room, imported room) -> the load-time imports that make it."""
    out: dict[tuple[str, str], list[str]] = {}
    eager, _ = import_edges()
    for a, b, line in eager:
        ra, rb = room_of(a), room_of(b)
        if ra != rb:
            out.setdefault((ra, rb), []).append(f"{a}:{line} -> {b}")
    return out


def test_every_module_is_in_a_room():
    rooms = {room_of(m) for m in module_files()}
    assert rooms == set(ROOMS), (sorted(rooms - set(ROOMS)), sorted(set(ROOMS) - rooms))


def test_every_room_is_a_package_the_wheel_installs():
    # pyproject's explicit package list: a folder missing from it is silently left out of the
    # wheel (tests/test_wheel.py sees that too, but only in the slow selection)
    import tomllib

    listed = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    folders = {
        ".".join(p.parent.relative_to(ROOT).parts)
        for p in (ROOT / "maskgrpo_ray").rglob("__init__.py")
    }
    assert folders - listed == set()


def test_rooms_import_only_what_the_table_allows():
    bad = [
        f"{ra} may not import {rb}: " + "; ".join(sites[:3])
        for (ra, rb), sites in sorted(room_edges().items())
        if rb not in ROOMS[ra][1]
    ]
    assert not bad, "\n".join(bad)


def test_every_permission_in_the_table_is_used():
    used = set(room_edges())
    unused = [(ra, rb) for ra, (_, may) in ROOMS.items() for rb in may if (ra, rb) not in used]
    assert not unused, f"the table allows imports no module makes (remove them): {unused}"


def test_the_rooms_have_no_circle_and_the_table_lists_them_from_the_ground_up():
    edges = [(ra, rb, 0) for ra, (_, may) in ROOMS.items() for rb in may]
    assert find_cycles(edges) == []
    order = list(ROOMS)
    late = [(ra, rb) for ra, rb, _ in edges if order.index(rb) > order.index(ra)]
    assert not late, f"a room is listed before a room it imports: {late}"


# Imports inside functions (lazy: not a room's load-time dependency, so outside the table) that
# run from a room to one listed above it: the arrows a drawing of the house shows running back
# up. Each is named here with why it stays; a new one fails the next test until it joins.
UPWARD_LAZY: dict[tuple[str, str], str] = {
    ("weights", "models"): (
        "hub.resolve_config asks the model kind, by name, which of its fields take a hub id "
        "(ModelEntry.hub_fields): a registry lookup like a plugin's, only when ids are resolved "
        "(it closes no circle, tests/test_import_graph.py). Untying it as config's "
        "was (config.kinds) takes a hub-field registry in weights filled by the model and reward "
        "kinds, or resolve_config moved above both with its callers (cli.app, evaluation.cli)"
    ),
    ("weights", "rewards"): (
        "the same for each reward component's kind (rewards.base.reward_hub_fields), which also "
        "imports the reward kind's module by rewards.base's own table of built-in kinds"
    ),
    ("planner", "pipeline"): (
        "cost_model.workload_of reads a run config through the pipeline's settings (the units "
        "a sample trains, as the learner counts them) only when `maskgrpo plan` or the simulated "
        "accelerator is given a config: the planner stays torch-free when it loads; computing "
        "those units in the planner would copy the learner's counting, which must not drift"
    ),
    ("evaluation", "actors"): (
        "`maskgrpo eval` on Ray (RayGenerator) starts a rollout pool; only that path imports "
        "ray, the in-process evaluation never does"
    ),
    ("evaluation", "backend"): (
        "RayGenerator spreads the evaluation units over that pool with backend.chunks' "
        "map_over_pool (a lost actor replaced, its unit re-run): the same scheduling as a run; "
        "moving RayGenerator up into backend/ needs run_eval's choice of generator moved up too"
    ),
}


def upward_lazy_edges() -> dict[tuple[str, str], list[str]]:
    """(importer's room, imported room listed above it) -> the function-level imports."""
    order = list(ROOMS)
    out: dict[tuple[str, str], list[str]] = {}
    _, lazy = import_edges()
    for a, b, line in lazy:
        ra, rb = room_of(a), room_of(b)
        if ra != rb and order.index(rb) > order.index(ra):
            out.setdefault((ra, rb), []).append(f"{a}:{line} -> {b}")
    return out


def test_every_import_running_back_up_is_named_with_why_it_stays():
    got = upward_lazy_edges()
    new = {k: v for k, v in got.items() if k not in UPWARD_LAZY}
    gone = sorted(set(UPWARD_LAZY) - set(got))
    assert not new, f"lazy imports running up the house, not named in UPWARD_LAZY: {new}"
    assert not gone, f"UPWARD_LAZY names imports no module makes any more (remove them): {gone}"


def test_the_checker_sees_a_forbidden_import():
    # the layering seen by the test: the evaluation imports the pipeline (its phases), and the
    # pipeline may not import the evaluation or the loop
    assert "pipeline" in ROOMS["evaluation"][1]
    assert not {"evaluation", "loop"} & ROOMS["pipeline"][1]
    assert ("evaluation", "pipeline") in room_edges()


def render() -> str:
    lines = [BEGIN, "| room | holds | imports when it loads |", "|---|---|---|"]
    for room, (holds, may) in ROOMS.items():
        name = f"`{room}`" if room in {"__init__", "api", "errors", "extras"} else f"`{room}/`"
        lines.append(f"| {name} | {holds} | {', '.join(f'`{r}`' for r in sorted(may)) or '-'} |")
    return "\n".join([*lines, END])


def test_the_architecture_doc_shows_the_table():
    text = DOC.read_text()
    got = BEGIN + text.split(BEGIN, 1)[1].split(END, 1)[0] + END
    assert got == render(), "docs/architecture.md: run `python tests/test_layering.py --write`"


def main() -> None:
    if "--write" in sys.argv:
        text = DOC.read_text()
        head, rest = text.split(BEGIN, 1)
        DOC.write_text(head + render() + rest.split(END, 1)[1])
    for (ra, rb), sites in sorted(room_edges().items()):
        print(f"{ra} -> {rb}: {len(sites)} imports")


if __name__ == "__main__":
    main()
