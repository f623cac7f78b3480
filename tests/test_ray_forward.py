"""The forward estimator across processes: rollout actors and learner ranks build the same
seeded masks, so the learner's first pass reproduces the rollout's old log-probs exactly."""

from __future__ import annotations

import json

import pytest
from test_ray_system import small_cfg

from maskgrpo_ray.loop import driver
from maskgrpo_ray.prompts.loading import PromptStream, load_prompts


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_forward_estimator_ratio_one_across_processes_then_real(ray_cluster, tmp_path):
    from maskgrpo_ray.backend.ray_executor import RayExecutor

    cfg = small_cfg(
        "likelihood.estimator=forward",
        "train.unmasking_step_selection=all",
        "likelihood.forward.mask_draws=3",
        "likelihood.forward.mask_ratios=uniform",
        "train.updates_per_batch=3",
        "filter.enabled=false",
    )
    ex = RayExecutor(cfg, timeout_s=300)
    try:
        stream = PromptStream(load_prompts("toy", "train"), cfg.run.seed, cfg.data.shuffle)
        driver.train(cfg, ex, tmp_path, stream, load_prompts("toy", "eval")[:2])
    finally:
        ex.shutdown()
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert r["learner_world_size"] == 2
        # first pass: the rollout actor's old log-probs (its masks, its process) against both
        # learner ranks' recomputation with the same weights and seeds
        assert r["abs_log_ratio_max"] <= 1e-5, r["abs_log_ratio_max"]
        # the last of 3 inner updates sees a ratio that moved: importance weights are real
        assert abs(r["ratio_mean"] - 1.0) > 1e-6
