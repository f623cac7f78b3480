"""The phase library and the single-process trainer on the toy world."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_runs import sets, tiny_toy

from maskgrpo_ray.algo.grpo import select_train_steps
from maskgrpo_ray.cli import main
from maskgrpo_ray.config import load_config
from maskgrpo_ray.pipeline.learner_core import TorchOptimizing, UpdatePlan, apply_update
from maskgrpo_ray.pipeline.learner_loss import accumulate_gradients, pair_log_probs, train_pairs
from maskgrpo_ray.pipeline.messages import TrainBatch
from maskgrpo_ray.pipeline.phases import generate
from maskgrpo_ray.pipeline.settings import settings_from_config
from maskgrpo_ray.worlds.toy.model import ToyModelSpec, ToyPolicy

PROMPTS = ["one red dot on the left", "three blue dots on the top", "two cyan dots on the right"]


def _batch(policy, transition, guidance=0.0, temperature=1.0, gumbel=1.0, likelihood="marginal"):
    rb = generate(
        policy,
        PROMPTS,
        [0, 1, 2],
        group_size=4,
        num_steps=5,
        temperature=temperature,
        gumbel_temperature=gumbel,
        guidance_scale=guidance,
        transition=transition,
        policy_version=0,
        generator=torch.Generator().manual_seed(0),
        remask_likelihood=likelihood,
    )
    return TrainBatch.from_rollout(
        rb, torch.randn(rb.num_samples, generator=torch.Generator().manual_seed(1))
    )


@pytest.mark.parametrize(
    ("transition", "guidance", "temperature", "likelihood"),
    [
        ("p1", 0.0, 1.0, "marginal"),
        ("p2", 1.5, 0.7, "marginal"),
        ("ar", 0.0, 1.0, "marginal"),
        ("p1", 2.0, 1.3, "marginal"),
        ("p1", 0.0, 1.0, "eq14"),
    ],
)
def test_ratio_is_one_before_the_first_update(transition, guidance, temperature, likelihood):
    torch.manual_seed(0)
    policy = ToyPolicy(ToyModelSpec(grid=4, d_model=32, layers=1)).eval()
    batch = _batch(policy, transition, guidance, temperature, likelihood=likelihood)
    # Gumbel tau_0 = 1 over 5 steps: the likelihood integrates the noise on steps 0-3 under
    # "marginal" (tau_t = .8, .48, .19, .04, 0) and ignores it under "eq14"
    expect_tau = likelihood == "marginal"
    assert bool((batch.likelihood_tau[:4] > 0.03).all()) == expect_tau
    samples, steps = train_pairs(batch, torch.arange(5))
    # the learner's batched recomputation (random micro-batch composition) vs the rollout cache
    perm = torch.randperm(len(samples))
    with torch.no_grad():
        logp = torch.cat(
            [
                pair_log_probs(policy, batch, samples[perm[i : i + 7]], steps[perm[i : i + 7]])
                for i in range(0, len(perm), 7)
            ]
        )
    old = batch.old_logp[samples[perm], steps[perm]]
    torch.testing.assert_close(logp, old, rtol=0, atol=2e-5)


def test_micro_batching_does_not_change_the_gradient():
    torch.manual_seed(0)
    policy = ToyPolicy(ToyModelSpec(grid=4, d_model=32, layers=1)).eval()
    batch = _batch(policy, "p1")
    grads = []
    for mb in (1000, 7):
        policy.zero_grad(set_to_none=True)
        accumulate_gradients(
            policy, batch, train_steps=torch.arange(5), micro_batch=mb, clip_low=0.2, clip_high=0.2
        )
        grads.append(torch.cat([p.grad.flatten() for p in policy.parameters()]))
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-6)


def test_update_moves_logp_of_positive_advantage_up():
    torch.manual_seed(0)
    policy = ToyPolicy(ToyModelSpec(grid=4, d_model=32, layers=1)).eval()
    batch = _batch(policy, "p2", gumbel=0.0)
    cfg = load_config("configs/toy.yaml", ["train.grad_clip_norm=0"])
    samples, steps = train_pairs(batch, torch.arange(5))
    with torch.no_grad():
        before = pair_log_probs(policy, batch, samples, steps)
    opt = TorchOptimizing(policy, torch.optim.SGD(policy.parameters(), lr=1e-3), 0.0)
    plan = UpdatePlan(train_steps=torch.arange(5), learning_rate=1e-3)
    apply_update(opt, batch, plan, settings_from_config(cfg).update)
    with torch.no_grad():
        after = pair_log_probs(policy, batch, samples, steps)
    adv = batch.advantages[samples]
    # a small gradient step increases sum A * logp (first-order)
    assert float((adv * (after - before)).sum()) > 0


def test_train_step_selection_counts_pairs():
    batch = _batch(ToyPolicy(ToyModelSpec(grid=4, d_model=32, layers=1)), "p1")
    s, t = train_pairs(batch, select_train_steps(5, "last", 2))
    assert len(s) == batch.num_samples * 2 and set(t.tolist()) == {3, 4}


def test_local_train_run_writes_all_outputs(tmp_path, monkeypatch):
    monkeypatch.setenv("MASKGRPO_CACHE_DIR", str(tmp_path / "cache"))
    run = tmp_path / "run"
    overrides = tiny_toy(3, 3, "logging.sample_grid_every_steps=2", quiet=False)
    args = ["train", "--config", "configs/toy.yaml", "--backend", "local", "--run-dir", str(run)]
    code = main([*args, *sets(overrides)])
    assert code == 0
    summary = json.loads((run / "summary.json").read_text())
    for key in ("base_accuracy", "final_accuracy", "steps", "wall_seconds", "samples_per_second"):
        assert summary[key] is not None, key
    assert summary["steps"] == 3 and summary["policy_version"] == 3
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    for key in (
        "reward_mean",
        "reward_std",
        "accuracy",
        "loss",
        "ratio_mean",
        "clip_frac",
        "kl",
        "filter_drop_rate",
        "policy_version_lag",
        "time/update",
        "samples_per_second",
        "image/colour_entropy",  # the monitors (docs/monitors.md), on by default
        "image/edges",
    ):
        assert key in rows[-1], key
    assert "probe/reward" in rows[0] and "probe/judge" in rows[0]  # the base model, probed
    assert (run / "reward_curve.png").exists() and (run / "config.json").exists()
    assert (run / "monitors.png").exists() and "monitors" in summary
    assert sorted(p.name for p in (run / "samples").iterdir()) == [
        "eval_tags_base.png",  # a held-out prompt per GenEval tag, the base model's
        "eval_tags_final.png",  # the same prompts and seed, the tuned model's
        "step_000000.png",
        "step_000002.png",
    ]
