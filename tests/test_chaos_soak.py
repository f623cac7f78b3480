"""The chaos soak (bench/chaos_soak.py), short: a 10-step toy run on the Ray backend with one
SIGKILL of each actor kind (a learner rank as the checkpoint is written and as the weight sync
starts, a rollout actor while the next step's rollouts run ahead of the update, the reward
actor at a random moment, the filter actor as a step starts, and a learner rank of the new
group while it is restored after the first learner fault), a SIGTERM of the driver and a
resume with the same command after the newest checkpoint was cut in half.

It must end like the fault-free run with the same seed: every step once in metrics.jsonl, no
group lost or trained twice, the figures equal and the final weights bit-equal; every death is
counted in the row metrics, and the cut checkpoint is named in one line before the previous
one is used. The long soak is ``bench/chaos_soak.py`` (figures in docs/fault_drill.md).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import chaos_plan, chaos_soak

ROOT = Path(__file__).resolve().parents[1]


def test_the_plan_covers_every_kind_and_moment_once_on_distinct_steps():
    faults = chaos_plan.plan_faults(seed=1, steps=10, n=5)
    kills = [f for f in faults if f.kind != "sigterm"]
    assert {f.kind for f in kills} == set(chaos_plan.KINDS)
    assert {f.moment for f in kills} == {*chaos_plan.MOMENTS, chaos_plan.RESTORE}
    (again,) = [f for f in kills if f.moment == chaos_plan.RESTORE]  # with the first learner
    assert again.kind == "learner"
    assert again.step == min(f.step for f in kills if f.kind == "learner" and f is not again)
    steps = [f.step for f in faults if f is not again]
    assert len(set(steps)) == len(steps) and min(steps) >= 1 and max(steps) <= 10 - 3
    for f in kills:
        if f.moment == "checkpoint":
            assert chaos_plan.checkpoint_step(f.step)
        if f.moment == "ahead":
            assert chaos_plan.has_ahead(f.step, 10)
    assert sum(f.kind == "sigterm" for f in faults) == 1
    with pytest.raises(ValueError, match="need"):
        chaos_plan.plan_faults(seed=1, steps=6, n=5)


@pytest.mark.slow
@pytest.mark.ci
@pytest.mark.timeout(1200)
def test_short_soak_ends_bit_equal_to_the_fault_free_run(ray_cluster, tmp_path):
    res = chaos_soak.soak(steps=10, n_faults=5, seed=1, tmp=tmp_path)
    print(chaos_soak.table(res))
    assert res["completed"] and res["exit_codes"] == [0, 0], res
    assert res["steps_in_metrics"] == 10
    injected = res["injected"]
    assert injected == {"rollout": 1, "reward": 1, "filter": 1, "learner": 3, "sigterm": 1}, res
    assert res["by_moment"][chaos_plan.RESTORE] == 1, res["by_moment"]
    for kind in chaos_plan.KINDS:  # every death in the row metrics
        assert res["deaths_counted"][kind] == injected[kind], (kind, res["deaths_counted"])
    assert res["groups_lost"] == 0 and res["groups_duplicated"] == 0, res
    assert res["max_rel_diff"] == 0.0, res
    assert res["final_weights_bit_equal"], res["final_weights_max_abs_diff"]
    # one line each time the cut checkpoint is met (the resume; a learner restore before the
    # next checkpoint replaces the pointer to it meets it again)
    assert res["truncated"] and len(set(res["fallback_lines"])) == 1, res["fallback_lines"]
    line = res["fallback_lines"][0]
    assert "(truncated?)" in line and "falling back to" in line, line
    assert set(res["recovery_s"]) == {*chaos_plan.KINDS, "sigterm"}, res["recovery_s"]
