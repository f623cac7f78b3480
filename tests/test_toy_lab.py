"""The lab's record key (bench/toy_lab.py): the resolved config's non-default fields, so a field
added later at its default keeps every record, and any real change makes a new one."""

from bench import lab_records as records
from bench import toy_lab as lab


def test_non_default_keeps_only_what_differs_from_the_schema():
    defaults = {"train.lr": 1.0, "train.kl": 0.0, "model.kind": "toy"}
    resolved = {"train": {"lr": 1.0, "kl": 0.5, "new_field": 3}, "model": {"kind": "toy"}}
    # lr and kind at their defaults drop out; kl differs; a field without a default stays
    assert records.non_default(resolved, defaults) == {"train.kl": 0.5, "train.new_field": 3}


def test_a_field_added_at_its_default_keeps_the_key():
    defaults = {"train.lr": 1.0}
    before = {"train": {"lr": 2.0}}
    after = {"train": {"lr": 2.0, "ema_decay": 0.0}}  # the new field, at its default
    assert records.non_default(before, defaults) == records.non_default(
        after, {**defaults, "train.ema_decay": 0.0}
    )


def test_key_ignores_an_explicit_default_and_sees_a_change():
    job = lab.Job("ref", (), 0, 60, config="configs/shapes.yaml")
    # the YAML's own value made explicit (shapes.yaml: kl_coef 0.01), and a change of it
    explicit = lab.Job("ref", ("train.kl_coef=0.01",), 0, 60, config="configs/shapes.yaml")
    changed = lab.Job("ref", ("train.kl_coef=0.0",), 0, 60, config="configs/shapes.yaml")
    other_seed = lab.Job("ref", (), 1, 60, config="configs/shapes.yaml")
    assert job.key() == explicit.key()
    assert len({job.key(), changed.key(), other_seed.key()}) == 3


def test_reusing_the_base_evaluation_keeps_the_key():
    base = lab.Job("ref", (), 0, 60, config="configs/shapes.yaml")
    assert "eval.reuse_base_evaluation=true" in base.all_overrides()
    without = lab.Job(
        "ref", ("eval.reuse_base_evaluation=false",), 0, 60, config="configs/shapes.yaml"
    )
    assert base.key() == without.key()
