"""bench/bench_gpu_shrinkage.py: its ``--smoke`` run (tiny random Show-o, CPU) measures every
configuration, counts the rows a block shares and checks the block starts on-policy; the
planner's predicted ratio by hand."""

from __future__ import annotations

import pytest

from bench.bench_gpu_shrinkage import parse_args, predicted_ratio, run
from maskgrpo_ray.planner.cost_model import PROFILES


def test_smoke_run_measures_every_shrinkage(tmp_path):
    out = run(parse_args(["--smoke", "--out", str(tmp_path / "s.json")]))
    assert out is not None and (tmp_path / "s.json").exists()
    rows = out["shrinkage"]["rows"]
    assert [(r["likelihood"], r["s"]) for r in rows] == [
        (lik, s) for lik in ("eq14", "marginal") for s in (1, 2, 4)
    ]
    for r in rows:  # 6 samples x 4 consecutive steps from step 0: ceil(4 / s) rows each
        assert r["pairs"] == 24 and r["pairs_per_s"] > 0
        assert r["rows_per_sample"] == pytest.approx(4 // r["s"])
        # the warm-up update starts at the rollout's weights: the block starts agree (float32)
        assert r["onpolicy_measured_share"] == 1 / r["s"]
        assert r["first_ratio_abs_dev_max"] < 1e-4
    assert all(r["time_vs_s1"] == 1.0 for r in rows if r["s"] == 1)


def test_predicted_ratio_by_hand():
    # 16 steps at s = 2: 8 rows; a marginal pair is 1 - f rows' work and f scoring
    f = PROFILES["showo_512_h100"].learner_scoring_share
    want = (8 * (1 - f) + 16 * f) * (1 + 1 / 3) / 16  # a pass, and the no-grad recompute
    assert predicted_ratio("512px", 16, 2, "marginal") == pytest.approx(want, rel=1e-12)
    assert predicted_ratio("512px", 16, 2, "eq14") == pytest.approx(8 * (4 / 3) / 16)
    assert predicted_ratio("512px", 16, 1, "marginal") == 1.0
    assert predicted_ratio("tiny-64tok", 4, 2, "eq14") is None
