"""Config validation: bad input fails with the field, the value and the fix."""

from __future__ import annotations

import pytest

from maskgrpo_ray.cli import main
from maskgrpo_ray.config import RENAMED_FIELDS, ConfigError, load_config
from maskgrpo_ray.pipeline.settings import settings_from_config


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
        (
            "train.unmasking_step_selection=first train.unmasking_steps_trained=0",
            ["unmasking_steps_trained=0", "rollout.unmasking_steps=8", "set it"],
        ),
        ("rollout.unmasking_steps=17", ["unmasking_steps=17", "16 tokens", "lower rollout."]),
        ("rollout.transition=p3", ["rollout.transition", "'p3'"]),
    ],
)
def test_bad_config_names_field_value_and_fix(override, needles):
    with pytest.raises(ConfigError) as err:
        load_config("configs/toy.yaml", override.split())
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
        "configs/showo_512_clip_forward.yaml",
        "configs/showo_512_clip_unmasking_reduction.yaml",
        "configs/showo_tiny_random.yaml",
    ],
)
def test_shipped_configs_validate(path):
    load_config(path)


def test_forward_showo_config_differs_only_in_the_estimator():
    """showo_512_clip_forward.yaml is the main Show-o run (the paper's setting) with the forward
    estimator: only the likelihood, the inner updates, the clip, the run name and the evidence
    (none for the forward recipe) differ."""
    base = load_config("configs/showo_512_clip.yaml").model_dump()
    fwd = load_config("configs/showo_512_clip_forward.yaml").model_dump()
    differ = {
        f"{section}.{key}"
        for section in base
        for key in base[section]
        if base[section][key] != fwd[section][key]
    }
    assert differ == {
        "run.name",
        "likelihood.estimator",
        "likelihood.forward",
        "train.updates_per_batch",
        "train.clip_low",
        "evidence.source",
        "evidence.quality",
        "evidence.reference",
    }
    assert fwd["likelihood"]["forward"]["mask_draws"] == 4


def test_embedded_default_equals_toy_yaml():
    # `maskgrpo train` without --config runs the toy world: the model defaults are configs/toy.yaml
    assert load_config(None) == load_config("configs/toy.yaml")


# The six renames: "step" alone means a driver step; the old key fails naming the new one.
RENAMES = [
    ("train.warmup_steps", "train.warmup_updates", 10, "optimizer updates"),
    ("rollout.num_steps", "rollout.unmasking_steps", 4, "driver steps"),
    ("eval.num_steps", "eval.unmasking_steps", 4, "driver steps"),
    ("train.step_selection", "train.unmasking_step_selection", "last", "driver steps"),
    ("train.steps_trained", "train.unmasking_steps_trained", 2, "driver steps"),
    ("train.micro_batch_samples_per_gpu", "train.micro_batch_pairs_per_gpu", 8, "pairs"),
]


def test_renames_table_is_complete():
    assert {(old, RENAMED_FIELDS[old][0]) for old, *_ in RENAMES} == {
        (old, new) for old, (new, _) in RENAMED_FIELDS.items()
    }


def _assert_renamed(err: ConfigError, old: str, new: str, why: str) -> None:
    msg = str(err)
    assert f"{old} was renamed {new}: " in msg, msg
    assert why in msg and "rename the key in your YAML or --set" in msg, msg


@pytest.mark.parametrize(("old", "new", "value", "why"), RENAMES)
def test_old_name_via_set_is_rejected_with_new_name(old, new, value, why):
    with pytest.raises(ConfigError) as err:
        load_config("configs/toy.yaml", [f"{old}={value}"])
    _assert_renamed(err.value, old, new, why)
    # the new name takes the same value (the selection needs its k alongside)
    extra = ["train.unmasking_steps_trained=2"] if new.endswith("step_selection") else []
    cfg = load_config("configs/toy.yaml", [f"{new}={value}", *extra])
    section, field = new.split(".")
    assert getattr(getattr(cfg, section), field) == value


@pytest.mark.parametrize(("old", "new", "value", "why"), RENAMES)
def test_old_name_in_yaml_is_rejected_with_new_name(tmp_path, old, new, value, why):
    section, field = old.split(".")
    path = tmp_path / "old.yaml"
    path.write_text(f"{section}:\n  {field}: {value}\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    _assert_renamed(err.value, old, new, why)


def test_all_old_names_are_reported_at_once():
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"{old}={value}" for old, _, value, _ in RENAMES])
    assert str(err.value).count(" was renamed ") == len(RENAMES)


def test_cli_old_name_exits_2_before_starting_anything(capsys, tmp_path):
    argv = ["train", "--set", "rollout.num_steps=4", "--run-dir", str(tmp_path / "run")]
    assert main(argv) == 2
    assert "rollout.num_steps was renamed rollout.unmasking_steps" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_learner_threads_keep_to_the_ranks_cpus_when_rollouts_overlap():
    """Auto torch threads of a CPU learner rank: the node's cores per rank in the synchronous
    loop; with asynchronous rollouts the rank's reserved CPUs (the rollouts use the rest)."""
    from maskgrpo_ray.learner.worker import auto_threads

    def learner(*extra: str):
        return settings_from_config(load_config("configs/toy.yaml", list(extra))).learner

    assert auto_threads(learner(), 1, 8, "cpu") == 8
    assert auto_threads(learner("learner.num_workers=2"), 2, 8, "cpu") == 4
    lag = learner("rollout.max_policy_lag=1")
    assert lag.overlapped and auto_threads(lag, 1, 8, "cpu") == 1  # 0.5 CPUs reserved -> 1
    more = learner("rollout.max_policy_lag=1", "learner.num_cpus_per_worker=3")
    assert auto_threads(more, 1, 8, "cpu") == 3
    assert auto_threads(learner("learner.torch_threads_per_worker=5"), 1, 8, "cpu") == 5
    assert auto_threads(lag, 1, 8, "cuda") == 0  # torch's default on a GPU
