"""DeepSpeed ZeRO stages 0-3 at world size 2 train exactly what the single process trains.

The batch of ``test_learner_deepspeed.toy_batch``: rank 0 runs 3 micro-batches, rank 1 runs 2
and pads one zero-loss backward, so each optimizer step accumulates several backwards per rank
(ZeRO-2/3 reduce inside every one of them) and the pad is exercised. Three updates (three
optimizer steps) must give the single-process weights (1e-5, as the stage-0 test) and, at every
step, its pre-clip gradient norm (1e-4; ``grad_clip_norm`` 1.0 clips, so Adam does not hide a
scale error in it). Without the fix in ``learner.worker.DeepSpeedOptimizing``, ZeRO-3 keeps
only the last backward's gradient here (73 % off in the norm); ZeRO-2's reduction buckets pair
gradients by hook order, which the old pad matched on this model by chance (a LayerNorm MLP
showed the mismatch: docs/ray_system.md, "Learner gradients").
"""

from __future__ import annotations

import pytest
import torch
from test_learner_deepspeed import local_reference, small_cfg, toy_batch

from maskgrpo_ray.pipeline.settings import settings_from_config

UPDATES = 3
WEIGHT_TOL = 1e-5  # max |dW| / max |W| per tensor (the stage-0 test: 1e-5 per element)
NORM_TOL = 1e-4  # relative, pre-clip gradient norm
STEP_TOL = 5e-3  # max |dW| / max |W - W0|: relative to what the updates changed


def max_differences(
    got: dict[str, torch.Tensor],
    ref: dict[str, torch.Tensor],
    start: dict[str, torch.Tensor],
    d_model: int,
) -> tuple[float, float]:
    """Over the trained tensors (rank 0's names), the largest ``max|a - b| / max|b|`` (weights)
    and ``max|a - b| / max|b - start|`` (the weights' change over the updates, which a wrong
    gradient changes first). The key bias of each attention block is left out: its gradient is
    exactly zero in exact arithmetic (softmax ignores a shift of a whole row), so both runs hold
    float noise there that Adam turns into steps of +-lr (``test_learner_deepspeed``)."""
    worst_rel = worst_step = 0.0
    for name, a in got.items():
        b, b0 = ref[name], start[name]
        if name.endswith("qkv.bias"):
            a, b, b0 = (torch.cat([t[:d_model], t[2 * d_model :]]) for t in (a, b, b0))
        diff = float((a.float() - b).abs().max())
        worst_rel = max(worst_rel, diff / max(float(b.abs().max()), 1e-12))
        worst_step = max(worst_step, diff / max(float((b - b0).abs().max()), 1e-12))
    return worst_rel, worst_step


def run_stages(stages: tuple[int, ...], *extra: str, weight_tol: float = WEIGHT_TOL) -> None:
    """Each stage at world size 2 against the single process: prints the table of max
    differences, then asserts the tolerances."""
    from maskgrpo_ray.learner.group import LearnerGroup

    cfg = small_cfg(*extra)
    batch = toy_batch(cfg)
    start, _ = local_reference(cfg, batch, updates=0)
    ref_state, ref_metrics = local_reference(cfg, batch, updates=UPDATES)
    rows = []
    for stage in stages:
        settings = settings_from_config(small_cfg(*extra, f"learner.zero_stage={stage}"))
        group = LearnerGroup(settings, timeout_s=300)
        try:
            got = [group.update(batch) for _ in range(UPDATES)]
            states = group.all_ranks_state()
        finally:
            group.shutdown()
        for name, t in states[0].items():  # ranks hold identical weights
            assert torch.equal(t, states[1][name]), (stage, name)
        w_rel, w_step = max_differences(states[0], ref_state, start, cfg.model.toy.d_model)
        norm_rel = max(
            abs(g["grad_norm"] - r["grad_norm"]) / r["grad_norm"]
            for g, r in zip(got, ref_metrics, strict=True)
        )
        rows.append((stage, w_rel, w_step, norm_rel))
    print(f"\nZeRO, world size 2 vs the single process, {UPDATES} updates {list(extra)}")
    print("stage  max|dW|/max|W|  max|dW|/max|W-W0|  max rel d(grad_norm)")
    for stage, w_rel, w_step, norm_rel in rows:
        print(f"{stage:>5}  {w_rel:.2e}        {w_step:.2e}           {norm_rel:.2e}")
    for stage, w_rel, w_step, norm_rel in rows:
        assert w_rel <= weight_tol and w_step <= STEP_TOL, (stage, w_rel, w_step)
        assert norm_rel <= NORM_TOL, (stage, norm_rel)


@pytest.mark.slow
@pytest.mark.ci
@pytest.mark.timeout(900)
def test_zero_stages_0_to_3_world2_equal_single_process(ray_cluster):
    run_stages((0, 1, 2, 3))  # about 40 s on 2 cores: four learner groups of 2 ranks


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_zero_stages_with_frozen_parameters_equal_single_process(ray_cluster):
    """Only some parameters train (a LoRA adapter, the base frozen): the same equality. LoRA's
    B matrices start at zero, so their weights are all update: there max|dW| / max|W| is the
    update-relative difference, held to ``STEP_TOL`` (stage 0 measures 2.9e-4 there too)."""
    lora = "model.lora={rank: 4, alpha: 8, target_modules: [qkv, proj]}"
    run_stages((0, 2, 3), lora, weight_tol=STEP_TOL)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_zero3_with_trajectory_shrinkage_equals_single_process(ray_cluster):
    """ZeRO-3 with trajectory shrinkage (s = 2): rank 0 has 12 samples x 2 rows in 2
    micro-batches of 20 rows, rank 1 6 x 2 in 1, so rank 1 pads one no-grad forward of the old
    log-probs' recompute (``learner_loss.pad_forward``: ZeRO-3 gathers partitioned parameters
    inside every forward, a collective) and one backward. The update equals the single
    process's (about 30 s). The toy's tensors are below DeepSpeed's
    ``stage3_param_persistence_threshold`` (they stay whole on every rank), so the gather
    itself does not run here: the equal forward counts are
    ``test_trajectory_shrinkage.py::test_ranks_call_the_model_equally_often_when_forwards_are_collective``."""
    run_stages((3,), "train.trajectory_shrinkage=2")
