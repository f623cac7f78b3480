"""The configs shipped inside the package: ``--config NAME``, ``maskgrpo configs``, and the error
for a config file that is not there (it names the built-in ones). Run from a temporary folder,
as a pip user would, so the repository's ``configs/`` is not in the current directory."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from maskgrpo_ray.cli import main
from maskgrpo_ray.config import ConfigError, builtin, load_config

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = sorted(p.stem for p in (ROOT / "configs").glob("*.yaml"))


@pytest.fixture
def elsewhere(tmp_path, monkeypatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_every_yaml_of_configs_is_a_built_in_and_loads_by_name(elsewhere):
    assert len(SHIPPED) >= 8 and builtin.names() == SHIPPED
    for name in SHIPPED:
        by_name = load_config(name).model_dump(mode="json")
        assert by_name == load_config(ROOT / "configs" / f"{name}.yaml").model_dump(mode="json")
        assert load_config(f"{name}.yaml").model_dump(mode="json") == by_name
        assert builtin.summary(name), name  # each file opens with its description


def test_a_file_of_that_name_here_wins_over_the_built_in(elsewhere):
    (elsewhere / "toy").write_text("train: {steps: 3}\n")
    assert load_config("toy").train.steps == 3
    assert load_config("toy.yaml").train.steps == load_config(ROOT / "configs/toy.yaml").train.steps


def test_a_missing_config_file_names_the_built_in_configs(elsewhere, capsys):
    code = main(["validate", "--config", "configs/toy.yaml"])  # the README's path, no checkout
    lines = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("maskgrpo: --config configs/toy.yaml: no such file")
    assert ", ".join(SHIPPED) in lines[0] and "maskgrpo configs copy NAME" in lines[0]
    with pytest.raises(ConfigError, match="no such file"):
        load_config("not_a_config")


def test_configs_list_show_and_copy(elsewhere, capsys):
    assert main(["configs", "list"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in out[: len(SHIPPED)]] == SHIPPED
    assert main(["configs", "show", "showo_512_clip"]) == 0
    assert capsys.readouterr().out == (ROOT / "configs/showo_512_clip.yaml").read_text()
    assert main(["configs", "copy", "toy"]) == 0
    copied = elsewhere / "toy.yaml"
    assert copied.read_bytes() == (ROOT / "configs/toy.yaml").read_bytes()
    assert main(["configs", "copy", "showo_256_clip", "sub/"]) == 0
    assert (elsewhere / "sub" / "showo_256_clip.yaml").is_file()
    capsys.readouterr()
    copied.write_text("# mine\n")
    assert main(["configs", "copy", "toy"]) == 2  # never overwrites without --force
    assert "exists; pass --force" in capsys.readouterr().err and copied.read_text() == "# mine\n"
    assert main(["configs", "copy", "toy", "--force"]) == 0
    assert yaml.safe_load(copied.read_text())["run"]["name"] == "toy"
    assert main(["configs", "show", "nosuch"]) == 2
    assert "built-in: " + ", ".join(SHIPPED) in capsys.readouterr().err


def test_load_config_takes_a_tree_and_leaves_it_as_it_was():
    tree = {"train": {"steps": 5}, "run": {"backend": "local"}}
    cfg = load_config(tree, ["train.steps=7"])
    assert cfg.train.steps == 7 and cfg.run.backend == "local"
    assert tree == {"train": {"steps": 5}, "run": {"backend": "local"}}
