"""Config validation: bad input fails with the field, the value and the fix."""

from __future__ import annotations

import pytest

from maskgrpo_ray.cli import main
from maskgrpo_ray.config import ConfigError, load_config


def test_toy_config_loads_and_overrides_apply():
    cfg = load_config("configs/toy.yaml", ["train.steps=3", "rollout.transition=p2"])
    assert cfg.train.steps == 3 and cfg.rollout.transition == "p2"


@pytest.mark.parametrize(
    ("override", "needles"),
    [
        ("train.learnig_rate=1e-3", ["train.learnig_rate", "unknown key"]),
        ("train.learning_rate=-1e-3", ["train.learning_rate=-0.001", "positive", "use e.g."]),
        ("rollout.samples_per_prompt=1", ["samples_per_prompt=1", "G >= 2", "set it to 2"]),
        ("filter.percentile=150", ["filter.percentile=150", "outside 0-100", "[0, 100]"]),
        ("train.step_selection=first", ["steps_trained=0", "rollout.num_steps", "set it"]),
        ("rollout.transition=p3", ["rollout.transition", "'p3'"]),
    ],
)
def test_bad_config_names_field_value_and_fix(override, needles):
    with pytest.raises(ConfigError) as err:
        load_config("configs/toy.yaml", [override])
    for n in needles:
        assert n in str(err.value), (n, str(err.value))


def test_cli_bad_config_exits_2_before_starting_anything(capsys, tmp_path):
    code = main(
        [
            "train",
            "--config",
            "configs/toy.yaml",
            "--set",
            "rollout.samples_per_prompt=1",
            "--run-dir",
            str(tmp_path / "run"),
        ]
    )
    assert code == 2
    assert "samples_per_prompt" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # nothing was built or written


def test_override_syntax_error():
    with pytest.raises(ConfigError, match="expected key.path=value"):
        load_config("configs/toy.yaml", ["train.steps"])


@pytest.mark.parametrize(
    "path",
    [
        "configs/toy.yaml",
        "configs/showo_256_clip.yaml",
        "configs/showo_512_clip.yaml",
        "configs/showo_tiny_random.yaml",
    ],
)
def test_shipped_configs_validate(path):
    load_config(path)


def test_embedded_default_equals_toy_yaml():
    # `maskgrpo train` without --config runs the toy world: the model defaults are configs/toy.yaml
    assert load_config(None) == load_config("configs/toy.yaml")
