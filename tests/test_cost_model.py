"""The cost model behind the simulated accelerator, ``maskgrpo plan`` and the cluster bench:
FLOP counts from the checkpoint's shapes, profiles derived from them, the pipeline ideal and
the planner's split (all arithmetic, derived here by hand)."""

from __future__ import annotations

import json
import math

import pytest
from showo_helpers import read_json

from maskgrpo_ray.cli import main
from maskgrpo_ray.planner.checkpoint_cost import CheckpointRates, checkpoint_bytes, checkpoint_cost
from maskgrpo_ray.planner.cost_model import (
    PROFILES,
    SHOWO_FLOPS,
    SHOWO_PARAMS,
    CostProfile,
    Workload,
    measured_mfu,
    peak_bf16,
    resolve_profile,
    showo_profile,
    step_costs,
)
from maskgrpo_ray.planner.split import pipeline_ideal, plan_split


def test_showo_parameter_counts_are_the_checkpoint_key_lists():
    # the official Show-o 512 state-dict layout (tests/fixtures/showo_reference/README.md)
    keys = read_json("showo_512_state_keys.json")
    body = sum(
        math.prod(v["shape"]) for k, v in keys.items() if ".layers." in k or "final_layernorm" in k
    )
    assert SHOWO_FLOPS.body_params == body
    assert sum(math.prod(v["shape"]) for v in keys.values()) == SHOWO_PARAMS
    assert SHOWO_FLOPS.head_params == 8192 * (2048 + 1)  # the codebook's lm_head columns + bias


def test_image_pass_flops_by_hand():
    # L = 1024: 2 x (body x 1026 rows + head x 1024) + attention 4 x 24 x 2048 x 1026 x 1155
    f = SHOWO_FLOPS
    counted = 2.0 * (1_208_510_464 * 1026 + 8192 * 2049 * 1024)
    attention = 4.0 * 24 * 2048 * 1026 * (129 + 1026)
    assert f.forward(1024, 1, 0) == pytest.approx(counted, rel=1e-12)
    assert f.attention(1024) == pytest.approx(attention, rel=1e-12)
    assert f.image_pass(1024) == pytest.approx(counted + attention, rel=1e-12)
    assert f.attention_share(1024) == pytest.approx(attention / counted, rel=1e-12)


def test_showo_512_profile_is_the_h100_measurement():
    p = PROFILES["showo_512_h100"]
    peak = peak_bf16("NVIDIA H100 80GB HBM3")
    assert peak == 989e12
    # bench/bench_gpu.py on an H100 (docs/gpu.md): the rollout's marginal likelihood, 24 images
    # x 50 steps in 20.27 s; the learner's micro-batch 8, 48 marginal pairs in 3.017 s
    assert p.rollout_seconds_per_image_step == pytest.approx(20.27 / 1200, rel=1e-12)
    assert p.learner_seconds_per_pair == pytest.approx(3.017 / 48, rel=1e-12)
    # a forward-estimator pair is one masked forward + backward: Eq. 14's measured cost
    fwd = PROFILES["showo_512_h100_forward"]
    assert fwd.learner_seconds_per_pair == pytest.approx(1.643 / 48, rel=1e-12)
    # the same efficiency (MFU) on another device, at its own datasheet peak
    one = SHOWO_FLOPS.image_pass(1024)
    r_mfu, l_mfu = measured_mfu(512, "marginal")
    assert r_mfu == pytest.approx(one / (p.rollout_seconds_per_image_step * peak), rel=1e-12)
    h200 = showo_profile("h200", 512, unmasking_steps=50, device="H200")
    assert h200.learner_seconds_per_pair == pytest.approx(3 * one / (l_mfu * 989e12), rel=1e-12)
    stated = showo_profile("s", 512, unmasking_steps=50, rollout_mfu=0.40, learner_mfu=0.35)
    assert stated.rollout_seconds_per_image_step == pytest.approx(one / (0.40 * peak), rel=1e-12)
    assert stated.learner_seconds_per_pair == pytest.approx(3 * one / (0.35 * peak), rel=1e-12)
    assert "stated" in stated.source and "measured on an H100" in p.source
    assert p.weight_bytes == 2 * SHOWO_PARAMS  # bf16
    assert "MFU" in p.source and p.image_tokens == 1024 and p.unmasking_steps == 50
    # 96 samples x 50 steps of pairs: 302 s on one H100 as measured (the FLOP model at the
    # stated 35% MFU said ~114 s, 9e12 FLOPs x 4800 pairs at 44% of the peak ~100 s)
    assert 96 * 50 * p.learner_seconds_per_pair == pytest.approx(301.7, rel=1e-3)


def _profile(**kw) -> CostProfile:
    base = dict(
        name="hand",
        device="test",
        source="by hand",
        rollout_seconds_per_image_step=0.01,
        rollout_batch_images=12,
        learner_seconds_per_pair=0.02,
        reward_seconds_per_image=0.001,
        weight_bytes=2_000_000_000,
        sync_bytes_per_second=10e9,
        image_px=512,
        image_tokens=1024,
    )
    return CostProfile(**{**base, **kw})


def test_step_costs_and_ideals_by_hand():
    p = _profile()
    w = Workload(prompts_per_step=16, samples_per_prompt=6, unmasking_steps=50, units_per_sample=25)
    c = step_costs(p, w, rollout_gpus=5, learner_gpus=7)
    # rollout: ceil(16 / 5) = 4 prompts x 6 images x 50 steps x 0.01 s = 12 s
    assert c.rollout_s == pytest.approx(12.0)
    # learner: ceil(96 / 7) = 14 samples x 25 pairs x 0.02 s = 7 s
    assert c.learner_s == pytest.approx(7.0)
    assert c.sync_s == pytest.approx(0.2)  # 2 GB at 10 GB/s
    assert (c.r, c.l) == (pytest.approx(0.5), pytest.approx(0.5))
    ideal = pipeline_ideal(c)
    assert ideal.sync == pytest.approx(96 / (12 + 7 + 0.2))
    assert ideal.asynchronous == pytest.approx(96 / 12)
    assert ideal.limit == pytest.approx(12 / 1.0)  # n / (r + l)
    assert ideal.learner_busy_async == pytest.approx(7.2 / 12)
    assert ideal.asynchronous <= ideal.limit + 1e-9


def test_shrinkage_shares_the_rows_not_the_per_pair_scoring():
    """Trajectory shrinkage shares a block's input row (the forward, backward and log_softmax),
    not the per-pair scoring (issue 57: the planner divided the whole pair cost by s). By hand,
    50 units at s = 2 in 25 rows, a pair 0.02 s of which f = 0.4 is scoring: a pass costs
    25 x 0.6 + 50 x 0.4 = 35 pairs, the no-grad recompute a third of that, 46.67 pairs per
    sample; f = 0 is the old division (25 + 25 / 3 = 33.3), s = 1 is 50 whatever f."""
    w2 = Workload(16, 6, 50, units_per_sample=50, shrinkage=2)
    assert w2.forward_passes_per_sample == 25
    assert w2.learner_pairs(0.4) == pytest.approx(35 + 35 / 3)
    assert w2.learner_pairs(0.0) == pytest.approx(25 + 25 / 3) == w2.pairs_per_sample
    assert Workload(16, 6, 50, units_per_sample=50).learner_pairs(0.4) == 50
    c = step_costs(_profile(learner_scoring_share=0.4), w2, rollout_gpus=4, learner_gpus=12)
    assert c.l == pytest.approx((35 + 35 / 3) * 0.02)  # GPU-seconds per image
    # the built-in profile: the marginal's quadrature over Eq. 14 at micro-batch 8 (H100)
    p = PROFILES["showo_512_h100"]
    assert p.learner_scoring_share == pytest.approx(1 - 1.643 / 3.017, rel=1e-12)
    assert PROFILES["showo_512_h100_forward"].learner_scoring_share == 0.0
    assert p.learner_seconds_per_pair * p.learner_scoring_share == pytest.approx(0.0286, abs=1e-4)
    # so s = 2 saves 3% of the learner's work on Show-o 512, not a third
    s2 = Workload(16, 6, 50, units_per_sample=50, shrinkage=2).learner_pairs(
        p.learner_scoring_share
    )
    assert s2 / 50 == pytest.approx(0.970, abs=1e-3)
    with pytest.raises(ValueError, match="learner_scoring_share=1.0 must be in"):
        _profile(learner_scoring_share=1.0)


def test_plan_split_is_the_best_of_every_split():
    p, w = PROFILES["showo_512_h100"], Workload.of_profile(PROFILES["showo_512_h100"])
    plan = plan_split(p, w, 16)
    brute = max(
        (pipeline_ideal(step_costs(p, w, r, 16 - r)).asynchronous, -r) for r in range(1, 16)
    )
    assert plan.images_per_s == pytest.approx(brute[0]) and plan.rollout_gpus == -brute[1]
    assert plan.rollout_gpus + plan.learner_gpus == 16
    assert len(plan.table) == 15 and plan.images_per_s <= plan.limit
    sync = plan_split(p, w, 16, asynchronous=False)
    assert sync.images_per_s < plan.images_per_s  # R + L + W > max(R, L + W)
    with pytest.raises(ValueError, match="at least 2 GPUs"):
        plan_split(p, w, 1)


def test_user_profiles_resolve_or_name_what_is_wrong():
    assert resolve_profile("showo_256_h100") is PROFILES["showo_256_h100"]
    mine = resolve_profile({"base": "showo_512_h100", "learner_seconds_per_pair": 0.05})
    assert mine.learner_seconds_per_pair == 0.05 and mine.image_px == 512
    with pytest.raises(ValueError, match="not a built-in cost profile"):
        resolve_profile("showo_1024_tpu")
    with pytest.raises(ValueError, match="unknown field"):
        resolve_profile({"base": "showo_512_h100", "flops": 1})
    with pytest.raises(ValueError, match="missing field"):
        resolve_profile({"name": "x", "device": "y"})
    with pytest.raises(ValueError, match="must be > 0"):
        resolve_profile({"base": "showo_512_h100", "weight_bytes": 0})


def test_plan_cli_prints_the_split_and_refuses_unknown_gpus(capsys):
    assert main(["plan", "--profile", "showo_512_h100", "--gpus", "16", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["recommended"] == {"rollout_gpus": 4, "learner_gpus": 12}
    assert out["images_per_s"] <= out["work_conserving_limit"]
    assert main(["plan", "--model", "showo", "--resolution", "256", "--gpu", "A100"]) == 0
    assert "recommended:" in capsys.readouterr().out
    assert main(["plan", "--model", "showo", "--gpu", "TPUv9"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "TPUv9" in err[0] and "H100" in err[0]


def test_plan_takes_the_workload_from_a_config(capsys):
    # the Show-o 512 config with all 50 steps trained at the paper's 16 prompts: the 512 profile
    every = ["--set", "train.unmasking_step_selection=all", "--set", "train.prompts_per_step=16"]
    assert main(["plan", "--config", "configs/showo_512_clip.yaml", *every, "--json"]) == 0
    full = json.loads(capsys.readouterr().out)
    assert full["workload"]["units_per_sample"] == 50 and full["workload"]["unmasking_steps"] == 50
    assert full["profile"]["name"] == "showo_512_h100" and full["recommended"]["rollout_gpus"] == 4
    # training 10 of the 50 steps: l = 10 x 23.81 ms, r unchanged (S x 6.94 ms): the limit is
    # n / (r + l) = 16 / (0.347 + 0.238)
    sets = [
        "--set",
        "train.unmasking_step_selection=group_random",
        "--set",
        "train.prompts_per_step=16",
    ]
    sets += ["--set", "train.unmasking_steps_trained=10"]
    assert main(["plan", "--config", "configs/showo_512_clip.yaml", *sets, "--json"]) == 0
    cheap = json.loads(capsys.readouterr().out)
    assert cheap["workload"]["units_per_sample"] == 10
    p = PROFILES["showo_512_h100"]
    want = 16 / (50 * p.rollout_seconds_per_image_step + 10 * p.learner_seconds_per_pair)
    assert cheap["work_conserving_limit"] == pytest.approx(want, rel=1e-9)
    assert cheap["images_per_s"] > full["images_per_s"]
    # the toy has no cost profile: one line naming the fix
    assert main(["plan", "--config", "configs/toy.yaml"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--profile" in err[0]


def test_checkpoint_bytes_by_hand():
    # fp32, all trained (the toy): 4 (weights) + 8 (Adam's two moments) = 12 bytes a parameter;
    # its measured file is 887,399 bytes for 70,727 parameters: 848,724 and DeepSpeed's framing
    assert checkpoint_bytes(70_727, 70_727, bf16=False) == 848_724
    assert 848_724 < 887_399 < 1.05 * 848_724
    # bf16 mixed precision: 2 (weights) + 4 (fp32 master) + 8 (Adam) = 14 bytes a parameter
    assert checkpoint_bytes(SHOWO_PARAMS, SHOWO_PARAMS, bf16=True) == 14 * SHOWO_PARAMS
    assert checkpoint_bytes(100, 0, bf16=True) == 200  # nothing trained: the weights alone


def test_checkpoint_cost_takes_the_sooner_cadence():
    rates = CheckpointRates(1e9, 1e9, 1e9, 2e9, fixed_s=1.0)
    # 10 GB: 1 s fixed + 10 (rank's write) + 10 (to the driver) + 10 (driver's write) + 2 x 5 (sha)
    assert rates.seconds(10**10) == pytest.approx(41.0)
    # steps of 6 s: 100 steps = 600 s; 10 minutes lands at the boundary after 600 s: 606 s
    by_steps = checkpoint_cost(10**10, 6.0, 100, 10.0, rates)
    assert by_steps.interval_s == 600.0 and by_steps.overhead == pytest.approx(41 / 600)
    assert by_steps.loses_s == pytest.approx(600 + 6 + 41)  # the interval, a step, a save
    by_time = checkpoint_cost(10**10, 6.0, 200, 10.0, rates)
    assert by_time.interval_s == 606.0
    never = checkpoint_cost(10**10, 6.0, 0, 0.0, rates)
    assert math.isinf(never.interval_s) and never.overhead == 0.0 and math.isinf(never.loses_s)


def test_plan_prices_a_checkpoint_at_the_runs_cadence(capsys):
    assert main(["plan", "--config", "configs/showo_512_clip.yaml", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    ck = out["checkpoint"]
    assert ck["bytes"] == 14 * SHOWO_PARAMS  # learner.bf16: true, no LoRA
    step_s = out["workload"]["prompts_per_step"] * out["workload"]["samples_per_prompt"]
    step_s /= out["images_per_s"]
    assert ck["interval_s"] == pytest.approx(min(50 * step_s, 600 + step_s))  # its 50 steps
    assert ck["seconds"] == pytest.approx(CheckpointRates().seconds(14 * SHOWO_PARAMS))
    sets = ["--set", "run.checkpoint_every_steps=0", "--set", "run.checkpoint_every_minutes=30"]
    assert main(["plan", "--config", "configs/showo_512_clip.yaml", *sets]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("checkpoint: 20.27 GB") and "every 30." in line, line


def test_the_reward_side_counts_a_configs_components_per_image():
    from maskgrpo_ray.planner.cost_model import PROFILES
    from maskgrpo_ray.planner.reward_cost import (
        MASK2FORMER_SWIN_S_FLOPS,
        VIT_L14_IMAGE_FLOPS,
        reward_cost,
        with_rewards,
    )

    peak = 989e12  # H100 SXM dense bf16 (cost_model.PEAK_BF16)
    # Mask2Former Swin-S: 2 x 313 GFLOP (its paper's fvcore count at ~800 x 1067) x 0.75 for
    # 800 x 800 (x 800 / 1067) = 4.6935e11; plus (94 + 2 x 100) / 553 = 0.5316 ViT-L-14 crops
    assert pytest.approx(4.6935e11, rel=1e-4) == MASK2FORMER_SWIN_S_FLOPS
    geneval = 4.6935e11 + 294 / 553 * 2 * 304e6 * 257  # of 2 x 304M x 257 each
    assert VIT_L14_IMAGE_FLOPS == 2 * 304e6 * 257
    # GenEval at the H100's measured seconds (bench/bench_reward_gpu.py): Mask2Former 13.76 ms
    # at 800 px, 32 a batch, plus 0.5316 ViT-L-14 crops at 0.58 ms
    measured = 13.76e-3 + 294 / 553 * 0.58e-3
    seconds, text = reward_cost(["geneval"], "H100 SXM")
    assert seconds == pytest.approx(measured, rel=1e-9)
    assert "measured on an H100" in text
    # at a stated MFU instead, the FLOP count alone
    stated, _ = reward_cost(["geneval"], "H100 SXM", mfu=0.30)
    assert stated == pytest.approx(geneval / (0.30 * peak), rel=1e-4)
    # another device: the same efficiency at its own peak (A100: 312 TFLOP/s dense bf16)
    a100, _ = reward_cost(["geneval"], "A100")
    assert a100 == pytest.approx(measured * 989e12 / 312e12, rel=1e-9)
    both, _ = reward_cost(["clip", "geneval"], "H100 SXM")  # a composition: the sum
    assert both == pytest.approx(measured + 2 * 632e6 * 257 / (0.30 * peak), rel=1e-4)
    toy, text = reward_cost(["toy_rules"], "H100 SXM")
    assert toy == 0 and "not counted: ['toy_rules']" in text
    base = PROFILES["showo_512_h100"]
    p = with_rewards(base, ["geneval"])
    assert p.reward_seconds_per_image == pytest.approx(seconds)
    assert "Mask2Former Swin-S" in p.source and "CLIP ViT-H-14 at 30%" not in p.source
    assert with_rewards(base, ["clip"]).reward_seconds_per_image == base.reward_seconds_per_image


def test_plan_of_the_geneval_recipe_counts_its_reward(capsys):
    from maskgrpo_ray.cli import main

    assert main(["plan", "--config", "configs/showo_512_geneval.yaml", "--gpus", "16"]) == 0
    out = capsys.readouterr().out
    # measured on an H100: 13.76 ms + 0.5316 x 0.58 ms = 14.07 ms an image; 96 a step = 1.35 GPU-s
    assert "reward 14.07 GPU-ms" in out and "1.35 GPU-s a step" in out
    assert "Mask2Former Swin-S" in out and "another model's paper" in out
