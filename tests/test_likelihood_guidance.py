"""``train.likelihood_guidance_scale``: the learner trains a likelihood with another guidance
than the sampler's (0: the conditional logits alone, as DanceGRPO). Its old log-probs are
recomputed under that likelihood, so the first ratio is 1; the update is the one of a batch
whose rollout had been scored with that guidance; the rollout's guidance itself changes
nothing."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
from test_trajectory_shrinkage import ALL, SMALL, TOY, _batch, _update

from maskgrpo_ray.config import load_config
from maskgrpo_ray.pipeline.build import build_policy
from maskgrpo_ray.pipeline.learner_loss import pair_log_probs
from maskgrpo_ray.pipeline.messages import TrainBatch

GUIDED = 2.0  # the sampler's guidance


def _guided_batch(policy) -> TrainBatch:
    return _batch(policy, guidance=GUIDED)


def _rescored(policy, batch: TrainBatch, guidance: float) -> TrainBatch:
    """The batch as a rollout scored with ``guidance`` would have cached it (every pair)."""
    b = replace(batch, guidance_scale=guidance)
    n, u = b.old_logp.shape
    with torch.no_grad():
        logp = pair_log_probs(
            policy, b, torch.arange(n).repeat_interleave(u), torch.arange(u).repeat(n)
        )
    return replace(b, old_logp=logp.view(n, u).float())


def _weights(policy) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in policy.parameters()])


def test_the_unguided_likelihood_is_trained_with_a_first_ratio_of_one():
    base = build_policy(load_config(TOY, SMALL).model)
    batch = _guided_batch(base)
    unguided = _rescored(base, batch, 0.0)
    # the sampler's cached log-probs are another likelihood's: kept, the first ratio is off 1
    assert (unguided.old_logp - batch.old_logp).abs().max() > 1e-2

    a, b, c = (copy.deepcopy(base) for _ in range(3))
    m = _update(["train.likelihood_guidance_scale=0", ALL], batch, a)
    assert m["ratio_mean"] == 1.0  # against the recomputed old log-probs: exactly 1
    assert m["first_ratio_abs_dev_max"] < 1e-5  # the check compares with them, not the rollout's
    # the same update as a batch whose rollout was scored without guidance
    _update([ALL], unguided, b)
    torch.testing.assert_close(_weights(a), _weights(b), rtol=0, atol=1e-6)
    # and not the guided likelihood's update
    _update([ALL], batch, c)
    assert (_weights(a) - _weights(c)).abs().max() > 1e-4


def test_the_rollouts_own_guidance_changes_nothing():
    base = build_policy(load_config(TOY, SMALL).model)
    batch = _guided_batch(base)
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    m_a = _update([f"train.likelihood_guidance_scale={GUIDED}", ALL], batch, a)
    m_b = _update([ALL], batch, b)
    assert torch.equal(_weights(a), _weights(b))
    assert m_a["loss"] == m_b["loss"]


def test_a_negative_guidance_is_refused_naming_the_field():
    with pytest.raises(Exception, match="likelihood_guidance_scale"):
        load_config(TOY, [*SMALL, "train.likelihood_guidance_scale=-1"])
