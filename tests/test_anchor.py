"""Anchored unmasking steps (``train.anchor_unmasking_steps``): the first m steps trained towards
the base model only, with a k3 KL of their transitions and no reward advantage."""

from __future__ import annotations

import os

import pytest
import torch
from tiny_runs import TOY_G3

from maskgrpo_ray.config import ConfigError, load_config
from maskgrpo_ray.pipeline.build import build_policy
from maskgrpo_ray.pipeline.learner_core import (
    TorchOptimizing,
    UpdatePlanner,
    apply_update,
    backward_calls,
    build_optimizer,
    reference_policy,
)
from maskgrpo_ray.pipeline.learner_loss import (
    Anchor,
    accumulate_gradients,
    pair_log_probs,
    train_pairs,
)
from maskgrpo_ray.pipeline.messages import TrainBatch
from maskgrpo_ray.pipeline.phases import generate
from maskgrpo_ray.pipeline.settings import settings_from_config

TOY = os.path.join(os.path.dirname(__file__), "..", "configs", "toy.yaml")
SMALL = TOY_G3
ANCHORED = [
    *SMALL,
    "train.unmasking_step_selection=last",
    "train.unmasking_steps_trained=1",
    "train.anchor_unmasking_steps=2",
    "train.anchor_kl_coef=0.5",
]


def _batch(policy) -> TrainBatch:
    rb = generate(
        policy,
        ["two red dots on the left", "one blue dot on the top"],
        [0, 1],
        group_size=3,
        num_steps=4,
        temperature=1.0,
        gumbel_temperature=0.0,
        guidance_scale=0.0,
        transition="p1",
        policy_version=0,
        generator=torch.Generator().manual_seed(5),
    )
    adv = torch.randn(rb.num_samples, generator=torch.Generator().manual_seed(6))
    return TrainBatch.from_rollout(rb, adv)


def _grads(policy) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in policy.parameters() if p.grad is not None])


def test_the_anchor_gradient_is_the_k3_of_the_anchored_transitions():
    policy = build_policy(load_config(TOY, SMALL).model).train()
    batch = _batch(policy)
    ref = build_policy(load_config(TOY, SMALL).model).eval()
    with torch.no_grad():  # move the policy away from the reference, so k3 > 0
        for p in policy.parameters():
            p.add_(0.01 * torch.randn_like(p))
    anchor = Anchor(torch.tensor([0, 1]), coef=0.5)
    policy.zero_grad(set_to_none=True)
    out = accumulate_gradients(
        policy,
        batch,
        train_steps=torch.tensor([3]),
        micro_batch=5,
        clip_low=0.2,
        clip_high=0.28,
        ref_policy=ref,
        anchor=anchor,
    )
    got = _grads(policy)
    # by hand: the trained step's clipped surrogate (ratio is not 1 here: old log-probs are
    # the unperturbed policy's) plus 0.5 x the mean over the 12 anchored pairs of
    # k3(d) = exp(d) - d - 1, d = log pi_ref - log pi, per transition
    policy.zero_grad(set_to_none=True)
    s, t = train_pairs(batch, torch.tensor([3]))
    logp = pair_log_probs(policy, batch, s, t)
    ratio = torch.exp(logp - batch.old_logp[s, t])
    a = batch.advantages[s]
    surrogate = -torch.minimum(ratio * a, ratio.clamp(0.8, 1.28) * a).mean()
    sa, ta = train_pairs(batch, torch.tensor([0, 1]))
    with torch.no_grad():
        ref_lp = pair_log_probs(ref, batch, sa, ta)
    d = ref_lp - pair_log_probs(policy, batch, sa, ta)
    k3 = torch.exp(d) - d - 1
    (surrogate + 0.5 * k3.mean()).backward()
    want = _grads(policy)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * float(want.abs().max()))
    assert out["anchor_kl"] == pytest.approx(float(k3.mean()), rel=1e-4)
    assert float(k3.mean()) > 1e-3  # the anchor term is really there


def test_the_first_anchored_update_is_the_plain_one_and_the_second_is_not():
    results = []
    for overrides in (ANCHORED, [o for o in ANCHORED if "anchor" not in o]):
        cfg = load_config(TOY, overrides)
        s = settings_from_config(cfg).update
        policy = build_policy(cfg.model)
        batch = _batch(policy)
        opt = TorchOptimizing(policy, build_optimizer(s, policy), s.grad_clip_norm)
        ref = reference_policy(s, policy)
        planner = UpdatePlanner(s)
        states = []
        for i in range(2):
            apply_update(opt, batch, planner.plan(i, 6, 3), s, ref_policy=ref)
            states.append(torch.cat([p.detach().flatten().clone() for p in policy.parameters()]))
        results.append(states)
    (a1, a2), (p1, p2) = results
    # policy == reference at the first update: d = 0 exactly, so k3's gradient is exactly 0
    assert torch.equal(a1, p1)
    assert not torch.equal(a2, p2)


def test_backward_calls_count_the_anchored_micro_batches():
    s = settings_from_config(load_config(TOY, [*ANCHORED, "train.micro_batch_pairs_per_gpu=4"]))
    # 9 samples: 9 trained pairs -> 3 micro-batches of 4; 18 anchored pairs -> 5
    assert backward_calls(s.update, 9, 1) == 3 + 5


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["train.anchor_unmasking_steps=2"], "anchor_kl_coef=0.0"),
        (["train.anchor_unmasking_steps=9", "train.anchor_kl_coef=0.1"], "at most"),
        (
            [
                "train.anchor_unmasking_steps=2",
                "train.anchor_kl_coef=0.1",
                "likelihood.estimator=forward",
                "train.unmasking_step_selection=all",
            ],
            "likelihood.estimator trajectory",
        ),
    ],
)
def test_bad_anchor_configs_fail_naming_the_field(overrides, needle):
    with pytest.raises(ConfigError) as err:
        load_config(TOY, overrides)
    assert needle in str(err.value) and "anchor_unmasking_steps" in str(err.value)
