"""``maskgrpo plan --config`` plans the config's own loop (``rollout.max_policy_lag``) and
prints the recipe's quality evidence beside its speed (issue 39)."""

from __future__ import annotations

import json
import math

import pytest

from maskgrpo_ray.cli import main
from maskgrpo_ray.config.evidence import recipe_keys
from maskgrpo_ray.planner.cost_model import PROFILES

PAPER = "configs/showo_512_clip.yaml"


def _paper_step_seconds(rollout_gpus: int, learner_gpus: int) -> tuple[float, float, float]:
    """R, L, W of the paper's step (B = 16, G = 6, all 50 of S = 50 steps trained) on a split
    of the showo_512_h100 profile, by hand: R = ceil(B / n_r) G S c_roll, L = ceil(B G / n_l)
    S c_pair, W = bytes / bandwidth."""
    p = PROFILES["showo_512_h100"]
    R = math.ceil(16 / rollout_gpus) * 6 * 50 * p.rollout_seconds_per_image_step
    L = math.ceil(96 / learner_gpus) * 50 * p.learner_seconds_per_pair
    return R, L, p.weight_bytes / p.sync_bytes_per_second


def test_a_lag_0_config_is_planned_synchronous(capsys):
    assert main(["plan", "--config", PAPER, "--gpus", "16", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["asynchronous"] is False and out["recommended"] == {
        "rollout_gpus": 4,
        "learner_gpus": 12,
    }
    R, L, W = _paper_step_seconds(4, 12)
    assert out["images_per_s"] == pytest.approx(96 / (R + L + W), rel=1e-12)
    assert out["images_per_gpu_s"] == pytest.approx(96 / (R + L + W) / 16, rel=1e-12)
    # 0.334 at the stated 40% / 35% MFUs; 0.132 at the MFUs measured on an H100 (docs/gpu.md)
    assert round(out["images_per_gpu_s"], 3) == 0.132
    assert out["rollout_busy"] == pytest.approx(R / (R + L + W))
    assert out["learner_busy"] == pytest.approx((L + W) / (R + L + W))
    # --async plans the same config as if its rollouts ran one version ahead: max(R, L + W)
    assert main(["plan", "--config", PAPER, "--gpus", "16", "--async", "--json"]) == 0
    fast = json.loads(capsys.readouterr().out)
    assert fast["asynchronous"] is True
    assert fast["images_per_s"] == pytest.approx(96 / max(R, L + W), rel=1e-12)
    assert round(fast["images_per_gpu_s"], 3) == 0.238  # 0.622 at the stated MFUs
    # a lag-1 config is planned asynchronous without a flag
    lag1 = ["--set", "rollout.max_policy_lag=1", "--json"]
    assert main(["plan", "--config", PAPER, "--gpus", "16", *lag1]) == 0
    assert json.loads(capsys.readouterr().out)["images_per_s"] == fast["images_per_s"]


def _busy_line(out: str) -> str:
    """The plan's summary line (the checkpoint's line may follow it)."""
    return next(x for x in out.splitlines() if x.startswith("recommended:"))


def test_the_busy_line_names_the_planned_loop(capsys):
    assert main(["plan", "--profile", "showo_512_h100", "--gpus", "16", "--sync"]) == 0
    last = _busy_line(capsys.readouterr().out)
    assert "(synchronous)" in last and "(asynchronous)" not in last
    R, L, W = _paper_step_seconds(4, 12)
    assert f"busy: rollout GPUs {R / (R + L + W):.2f}, learner GPUs" in last
    assert main(["plan", "--profile", "showo_512_h100", "--gpus", "16"]) == 0
    last = _busy_line(capsys.readouterr().out)
    assert "(asynchronous)" in last and "(synchronous)" not in last


def test_the_plan_prints_the_recipes_evidence_beside_its_speed(capsys):
    assert main(["plan", "--config", PAPER, "--gpus", "16"]) == 0
    last = _busy_line(capsys.readouterr().out)
    assert "img/GPU/s" in last and "Evidence: paper: GenEval 0.73 (Show-o base 0.53)" in last
    red = "configs/showo_512_clip_unmasking_reduction.yaml"
    assert main(["plan", "--config", red, "--gpus", "16"]) == 0
    last = _busy_line(capsys.readouterr().out)
    assert (
        "Evidence: paper: GenEval 0.66" in last and "(0.328 img/GPU/s)" in last
    )  # 0.827 at the stated MFUs
    assert main(["plan", "--config", "configs/showo_256_clip.yaml", "--gpus", "16"]) == 0
    assert "Evidence: no quality evidence; shared levers: shapes world" in capsys.readouterr().out
    # a --set that changes the recipe voids the file's evidence; plumbing does not
    subset = [
        "--set",
        "train.unmasking_step_selection=last",
        "--set",
        "train.unmasking_steps_trained=6",
    ]
    assert main(["plan", "--config", PAPER, *subset, "--json"]) == 0
    ev = json.loads(capsys.readouterr().out)["evidence"]
    assert ev["source"] == "none" and "no quality evidence for this recipe" in ev["line"]
    assert ev["changed"] == ["train.unmasking_step_selection", "train.unmasking_steps_trained"]
    assert main(["plan", "--config", PAPER, "--set", "rollout.num_actors=4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["evidence"]["source"] == "paper"
    # a profile is not a recipe
    assert main(["plan", "--profile", "showo_512_h100", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["evidence"]["source"] == "none"


def test_the_plan_states_the_probes_cost(capsys):
    """The step-signal probe every 50 steps at the defaults (K = 6 batches of B = 16 prompts)
    on the paper's step: 2 K S P / (N B) = 2 x 6 x 50 / 50 = 12 learner pairs and K P / (N B)
    = 0.12 rollout images per trained image; it keeps the recipe's evidence."""
    assert main(["plan", "--config", PAPER, "--set", "train.step_signal_every_steps=50"]) == 0
    out = capsys.readouterr().out
    assert "adds 12.00 learner pairs and 0.120 rollout images per trained image" in out
    assert "Evidence: paper: GenEval 0.73" in out


def test_recipe_keys_are_what_can_change_what_is_learned():
    keys = [
        "run.seed",
        "learner.num_workers",
        "rollout.num_actors",
        "reward.num_gpus_per_actor",
        "train.micro_batch_pairs_per_gpu",
        "train.step_signal_every_steps",
        "data.prompts",
        "eval.every_steps",
        "train.learning_rate",
        "rollout.max_policy_lag",
        "rollout.unmasking_steps",
        "train.steps",
        "filter.enabled",
    ]
    assert recipe_keys(keys) == [
        "train.learning_rate",
        "rollout.max_policy_lag",
        "rollout.unmasking_steps",
        "train.steps",
        "filter.enabled",
    ]
