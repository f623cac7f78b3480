"""A user's mistake ends in one line and exit 2, from every command, before anything starts.

Each case runs ``maskgrpo`` in this process (``cli.main``) and asserts: exit code 2, exactly one
line on stderr, starting ``maskgrpo:``, naming the culprit (the field or the path) and never a
traceback. ``--debug`` brings the traceback back.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from maskgrpo_ray.cli import main

REPO = Path(__file__).parents[1]
TOY = str(REPO / "configs" / "toy.yaml")


def _run(argv: list[str], capsys) -> tuple[int, list[str]]:
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse's usage errors
        code = exit_.code
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    return code, lines


def _files(tmp: Path) -> dict[str, Path]:
    """Bad inputs on disk (made fresh for each case)."""
    out = {}
    (tmp / "bad.yaml").write_text("run: {backend: ray\ntrain: [1, 2\n")
    out["bad_yaml"] = tmp / "bad.yaml"
    (tmp / "latin1.yaml").write_bytes("run: {name: caf\xe9}\n".encode("latin-1"))
    out["latin1_yaml"] = tmp / "latin1.yaml"
    (tmp / "binary.txt").write_bytes(bytes(range(128, 256)) * 4)
    out["binary_prompts"] = tmp / "binary.txt"
    (tmp / "object.json").write_text(json.dumps({"prompt": "one red dot on the left"}))
    out["object_json"] = tmp / "object.json"
    (tmp / "empty.txt").write_text("")
    out["empty_prompts"] = tmp / "empty.txt"
    (tmp / "latin1.txt").write_bytes("one red dot on the left caf\xe9\n".encode("latin-1"))
    out["latin1_prompts"] = tmp / "latin1.txt"
    (tmp / "a_folder").mkdir()
    out["folder"] = tmp / "a_folder"
    (tmp / "showo_no_weights").mkdir()
    (tmp / "showo_no_weights" / "config.json").write_text("{}")
    out["showo_no_weights"] = tmp / "showo_no_weights"
    (tmp / "a_file").write_text("x")
    out["a_file"] = tmp / "a_file"
    return out


TRAIN = ["train", "--config", TOY]
# (case, argv built from the files, a fragment the one line must contain)
CASES = [
    ("yaml that does not parse", lambda f: ["train", "--config", str(f["bad_yaml"])], "line 2"),
    ("config not UTF-8", lambda f: ["validate", "--config", str(f["latin1_yaml"])], "UTF-8"),
    ("config missing", lambda f: ["train", "--config", "nope.yaml"], "nope.yaml"),
    ("config is a folder", lambda f: ["validate", "--config", str(f["folder"])], "a folder"),
    ("unknown --set key", lambda f: [*TRAIN, "--set", "train.stepz=3"], "train.stepz"),
    ("wrong type", lambda f: [*TRAIN, "--set", "train.steps=abc"], "train.steps"),
    ("out of range", lambda f: [*TRAIN, "--set", "train.steps=-1"], "train.steps"),
    ("--set without =", lambda f: [*TRAIN, "--set", "train.steps"], "key.path=value"),
    (
        "prompts file missing",
        lambda f: [*TRAIN, "--set", "data.prompts=/no/such/prompts.json"],
        "/no/such/prompts.json",
    ),
    (
        "prompts file is binary",
        lambda f: [*TRAIN, "--set", f"data.prompts={f['binary_prompts']}"],
        "UTF-8",
    ),
    (
        "prompts in a wrong encoding",
        lambda f: [*TRAIN, "--set", f"data.prompts={f['latin1_prompts']}"],
        "UTF-8",
    ),
    (
        "prompts JSON object, not a list",
        lambda f: [*TRAIN, "--set", f"data.prompts={f['object_json']}"],
        "JSON list",
    ),
    (
        "prompts file empty",
        lambda f: [*TRAIN, "--set", f"data.prompts={f['empty_prompts']}"],
        "holds no prompts",
    ),
    (
        "prompts is a folder",
        lambda f: [*TRAIN, "--set", f"data.prompts={f['folder']}"],
        "a folder",
    ),
    (
        "shipped Show-o config as is (no prompts, no weights here)",
        lambda f: ["train", "--config", str(REPO / "configs" / "showo_256_clip.yaml")],
        "prompts",
    ),
    (
        "Show-o folder without weights",
        lambda f: [
            *TRAIN,
            "--set",
            "model.kind=showo",
            "--set",
            f"model.showo.showo_path={f['showo_no_weights']}",
            "--set",
            "reward.components=[{kind: toy_rules}]",
        ],
        "model.showo.showo_path",
    ),
    (
        "CLIP reward without local weights (no download unless asked)",
        lambda f: [*TRAIN, "--set", "reward.components=[{kind: clip}]"],
        "MASKGRPO_ALLOW_DOWNLOADS",
    ),
    (
        "unknown reward kind",
        lambda f: [*TRAIN, "--set", "reward.components=[{kind: clipp}]"],
        "clipp",
    ),
    ("--run-dir is a file", lambda f: [*TRAIN, "--run-dir", str(f["a_file"])], "a file"),
    (
        "--resume a folder that is no run",
        lambda f: ["train", "--resume", str(f["folder"])],
        "--resume",
    ),
    (
        "eval: weights that do not exist",
        lambda f: ["eval", "--weights", "/no/such/weights.pt"],
        "/no/such/weights.pt",
    ),
    (
        "prompts make: unknown kind",
        lambda f: ["prompts", "make", "--kind", "nope", "--n", "3", "--out", "x.jsonl"],
        "nope",
    ),
    (
        "status: no cluster there",
        lambda f: ["status", "--run", "toy", "--address", "127.0.0.1:9", "--timeout", "3"],
        "127.0.0.1:9",
    ),
]


@pytest.mark.parametrize("case,argv,fragment", CASES, ids=[c[0] for c in CASES])
def test_a_user_mistake_is_one_line_and_exit_2(case, argv, fragment, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MASKGRPO_ALLOW_DOWNLOADS", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)  # no download must happen without it
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # an empty cache
    code, lines = _run(argv(_files(tmp_path)), capsys)
    assert code == 2, (case, lines)
    assert len(lines) == 1, (case, lines)
    assert lines[0].startswith("maskgrpo: ") and fragment in lines[0], (case, lines)
    assert "Traceback" not in lines[0]
    assert not (tmp_path / "runs").exists()  # nothing was started, nothing written


def test_debug_brings_the_traceback_back(tmp_path):
    from maskgrpo_ray.config import ConfigError

    with pytest.raises(ConfigError, match="train.stepz"):
        main(["--debug", "train", "--config", TOY, "--set", "train.stepz=3"])


def test_a_missing_reward_dependency_names_the_package(tmp_path, capsys, monkeypatch):
    """A reward kind whose package is not installed (image-reward hidden from the import
    system): one line naming the kind and the install command."""
    import sys

    from maskgrpo_ray.rewards import base

    for name in list(sys.modules):
        if name.startswith("ImageReward"):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "ImageReward", None)  # find_spec: not installed
    assert base.REWARD_REGISTRY  # the kind itself stays registered: its package is missing
    code, lines = _run(
        [*TRAIN, "--set", "reward.components=[{kind: imagereward, args: {checkpoint: x.pt}}]"],
        capsys,
    )
    assert code == 2 and len(lines) == 1, lines
    assert "'imagereward'" in lines[0] and "pip install" in lines[0], lines


def _mutations(tree: dict) -> list[tuple[str, ...]]:
    """Every (section, field) leaf of a config tree."""
    return [(s, k) for s, sec in tree.items() if isinstance(sec, dict) for k in sec]


hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies
VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**6), max_value=10**6),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.lists(st.integers(min_value=-3, max_value=3), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)
BASE_TREE = yaml.safe_load(Path(TOY).read_text())
LEAVES = _mutations(BASE_TREE)


@hypothesis.settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[hypothesis.HealthCheck.function_scoped_fixture],
)
@hypothesis.given(
    edits=st.lists(
        st.tuples(st.sampled_from(LEAVES), st.sampled_from(["drop", "retype", "perturb"]), VALUES),
        min_size=1,
        max_size=3,
    )
)
def test_mutated_configs_validate_or_fail_in_one_line(edits, tmp_path_factory, capsys):
    """Drop, retype or perturb fields of the toy config: ``maskgrpo validate`` either prints a
    run plan (exit 0) or one line (exit 2); never a traceback, never another exit code."""
    tree = json.loads(json.dumps(BASE_TREE))
    for (section, key), how, value in edits:
        sec = tree.get(section)
        if not isinstance(sec, dict):
            continue
        if how == "drop":
            sec.pop(key, None)
        elif how == "retype":
            sec[key] = value
        elif isinstance(sec.get(key), (int, float)) and not isinstance(sec.get(key), bool):
            sec[key] = sec[key] * -1 if value is None else sec[key] + 10**6
    path = tmp_path_factory.mktemp("cfg") / "mutated.yaml"
    path.write_text(yaml.safe_dump(tree))
    code = main(["validate", "--config", str(path)])
    captured = capsys.readouterr()
    if code == 0:
        assert json.loads(captured.out)["run"]  # the resolved run plan
    else:
        lines = [x for x in captured.err.splitlines() if x.strip()]
        assert code == 2 and len(lines) == 1 and lines[0].startswith("maskgrpo: "), lines


def test_status_and_scale_never_hang_without_a_cluster(capsys, monkeypatch, tmp_path):
    """No --address, no RAY_ADDRESS, no head on this machine: one line at once."""
    from maskgrpo_ray.cluster import attach as ray_cluster

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray_cluster, "_local_head_address", lambda: None)
    for argv in (["status", "--run", "toy"], ["scale", "--run", "toy", "--rollout", "2"]):
        code, lines = _run(argv, capsys)
        assert code == 2 and len(lines) == 1 and "no running Ray cluster" in lines[0], lines
    # an address that a dead head left behind: refused at once, named
    monkeypatch.setattr(ray_cluster, "_local_head_address", lambda: "127.0.0.1:9")
    code, lines = _run(["status", "--run", "toy", "--timeout", "3"], capsys)
    assert code == 2 and "127.0.0.1:9" in lines[0] and "address file" in lines[0], lines
    assert os.environ.get("RAY_ADDRESS") is None
