"""Trajectory shrinkage (TraceRL): s consecutive unmasking steps scored in one forward pass at
the block's first state. Exact where every trained step starts its block, biased elsewhere, the
old log-probs recomputed under the same scoring so the first ratio is exactly 1, and the
forward passes per sample counted: ceil(S / s)."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch
from tiny_runs import TOY_G3

from maskgrpo_ray.algo.estimators import shrunk_rows
from maskgrpo_ray.algo.transition import step_log_prob
from maskgrpo_ray.config import load_config
from maskgrpo_ray.pipeline.build import build_policy
from maskgrpo_ray.pipeline.learner_core import (
    TorchOptimizing,
    UpdatePlanner,
    apply_update,
    backward_calls,
    build_optimizer,
)
from maskgrpo_ray.pipeline.learner_loss import (
    accumulate_gradients,
    input_rows,
    micro_batches,
    pair_log_probs,
    pair_query,
)
from maskgrpo_ray.pipeline.messages import TrainBatch
from maskgrpo_ray.pipeline.phases import generate
from maskgrpo_ray.pipeline.settings import settings_from_config

TOY = os.path.join(os.path.dirname(__file__), "..", "configs", "toy.yaml")
ALL = "train.unmasking_step_selection=all"
SMALL = TOY_G3


def _batch(policy, gumbel: float = 0.0, guidance: float = 0.0) -> TrainBatch:
    rb = generate(
        policy,
        ["two red dots on the left", "one blue dot on the top"],
        [0, 1],
        group_size=3,
        num_steps=4,
        temperature=1.0,
        gumbel_temperature=gumbel,
        guidance_scale=guidance,
        transition="p1",
        policy_version=0,
        generator=torch.Generator().manual_seed(5),
    )
    adv = torch.randn(rb.num_samples, generator=torch.Generator().manual_seed(6))
    return TrainBatch.from_rollout(rb, adv)


def _grad(policy, batch, units, shrinkage, micro_batch=4096):
    policy.zero_grad(set_to_none=True)
    m = accumulate_gradients(
        policy, batch, train_steps=units, micro_batch=micro_batch, clip_low=0.2, clip_high=0.28,
        shrinkage=shrinkage,
    )  # fmt: skip
    g = torch.cat([p.grad.flatten() for p in policy.parameters() if p.grad is not None])
    return g, m


def test_shrunk_rows_by_hand():
    # sample 0 steps 0..3, sample 1 steps 0, 1, 3; s = 2: blocks {0, 1} and {2, 3}
    steps = torch.tensor([0, 1, 2, 3, 0, 1, 3])
    ids = torch.tensor([0, 0, 0, 0, 1, 1, 1])
    rows, inverse, start = shrunk_rows(steps, 2, ids)
    assert start.tolist() == [0, 0, 2, 2, 0, 0, 2]
    # rows (sample, block start): (0, 0) (0, 2) (1, 0) (1, 2), each named by its first pair
    assert rows.tolist() == [0, 2, 4, 6]
    assert inverse.tolist() == [0, 0, 1, 1, 2, 2, 3]
    rows, inverse, _ = shrunk_rows(steps, 4, ids)  # one block: a row per sample
    assert rows.tolist() == [0, 4] and inverse.tolist() == [0, 0, 0, 0, 1, 1, 1]


def test_block_starts_are_exact_and_later_steps_are_biased():
    policy = build_policy(load_config(TOY, SMALL).model).eval()
    batch = _batch(policy)
    n = batch.num_samples
    samples = torch.arange(n).repeat_interleave(4)
    steps = torch.arange(4).repeat(n)
    with torch.no_grad():
        exact = pair_log_probs(policy, batch, samples, steps).view(n, 4)
        shrunk = pair_log_probs(policy, batch, samples, steps, shrinkage=2).view(n, 4)
    # the rollout cached the exact transition log-probs (same weights): s = 1 reproduces them
    torch.testing.assert_close(exact, batch.old_logp, rtol=0, atol=1e-5)
    # steps 0 and 2 start their blocks: scored from their own state, the same numbers
    torch.testing.assert_close(shrunk[:, [0, 2]], exact[:, [0, 2]], rtol=0, atol=1e-6)
    # steps 1 and 3 are scored from the state one step earlier (more masked): not the same
    assert (shrunk[:, [1, 3]] - exact[:, [1, 3]]).abs().max() > 1e-3


def test_gradient_equals_the_full_trajectory_where_blocks_are_exact():
    """s = 2 training only the block starts {0, 2}: every pair is scored from its own state, so
    the loss and gradient are the unshrunk ones (the row-sharing machinery changes nothing);
    s = 1 is the unshrunk code path itself."""
    policy = build_policy(load_config(TOY, SMALL).model).train()
    batch = _batch(policy)
    units = torch.tensor([0, 2])
    full, m_full = _grad(policy, batch, units, 1)
    shrunk, m_shrunk = _grad(policy, batch, units, 2)
    torch.testing.assert_close(shrunk, full, rtol=0, atol=1e-6)
    assert m_shrunk["loss"] == pytest.approx(m_full["loss"], abs=1e-6)
    # all four steps: a different gradient (steps 1 and 3 scored from earlier states)
    all_full, _ = _grad(policy, batch, torch.arange(4), 1)
    all_shrunk, _ = _grad(policy, batch, torch.arange(4), 2)
    assert (all_shrunk - all_full).norm() > 1e-3 * all_full.norm()


@pytest.mark.parametrize(("s", "passes"), [(1, 4), (2, 2), (3, 2), (4, 1)])
def test_forward_passes_per_sample_are_ceil_s_over_shrinkage(s, passes):
    policy = build_policy(load_config(TOY, SMALL).model).train()
    _, m = _grad(policy, _batch(policy), torch.arange(4), s)  # S = 4: ceil(4 / s) rows
    assert m["forward_passes_per_sample"] == passes


def test_micro_batches_count_rows_by_hand():
    # 2 samples x steps 0..3 at s = 2: rows (0, b0) (0, b1) (1, b0) (1, b1), 2 pairs each
    samples, steps = torch.arange(2).repeat_interleave(4), torch.arange(4).repeat(2)
    assert micro_batches(samples, steps, 3, 2) == [slice(0, 6), slice(6, 8)]  # 3 rows, 1 row
    assert micro_batches(samples, steps, 2, 2) == [slice(0, 4), slice(4, 8)]
    assert micro_batches(samples, steps, 3, 1) == [slice(0, 3), slice(3, 6), slice(6, 8)]
    # per-sample units: sample 0 steps 0, 1, 3 (rows b0, b1), sample 1 steps 1, 2 (b0, b1)
    samples, steps = torch.tensor([0, 0, 0, 1, 1]), torch.tensor([0, 1, 3, 1, 2])
    assert micro_batches(samples, steps, 1, 2) == [slice(0, 2), slice(2, 3), slice(3, 4)] + [
        slice(4, 5)
    ]
    assert micro_batches(samples, steps, 3, 2) == [slice(0, 4), slice(4, 5)]
    assert input_rows(torch.tensor([0, 1, 3]), 2) == 2 and input_rows(torch.arange(4), 1) == 4


def test_micro_batches_count_rows_and_never_cut_a_block():
    """24 pairs (6 samples x 4 steps) at s = 2 in micro-batches of 3 rows: 12 rows (6 samples x
    2 blocks) in 4 micro-batches of 6 pairs, each block forwarded once (before, micro-batches of
    3 pairs cut blocks: 16 rows); the update's backward calls are those the learner group plans
    (``backward_calls`` on the plan's rows per sample)."""
    policy = build_policy(load_config(TOY, SMALL).model).train()
    calls = []
    policy.zero_grad(set_to_none=True)
    m = accumulate_gradients(
        policy, _batch(policy), train_steps=torch.arange(4), micro_batch=3, clip_low=0.2,
        clip_high=0.28, shrinkage=2, backward=lambda loss: (calls.append(1), loss.backward()),
    )  # fmt: skip
    assert m["forward_passes_per_sample"] == 2.0 and len(calls) == 4
    up = settings_from_config(
        load_config(TOY, [*SMALL, ALL, "train.trajectory_shrinkage=2"])
    ).update
    plan = UpdatePlanner(up).plan(0, 6, 3)
    assert plan.rows_per_sample(2, 4) == 2
    assert backward_calls(replace(up, micro_batch_pairs=3), 6, 2) == 4


def test_shrunk_pairs_are_scored_on_the_rows_forwarded(monkeypatch):
    """Under s = 2 the 24 pairs of 6 samples x 4 steps share 12 input rows: the log_softmax
    (and the Gumbel marginal's reads) run on those 12 rows, not on 24 copies (``logits[inverse]``
    before issue 57), with the values and gradients of scoring each pair on its own copy."""
    policy = build_policy(load_config(TOY, SMALL).model).eval()
    batch = _batch(policy, gumbel=1.0)  # remasking noise: the marginal scores p1
    n = batch.num_samples
    samples, steps = torch.arange(n).repeat_interleave(4), torch.arange(4).repeat(n)
    q = pair_query(batch, samples, steps, policy.codebook_size, shrinkage=2)
    assert q.rows is not None and len(q.rows) == 2 * n
    with torch.no_grad():
        logits = policy.conditioned(batch.cond_ids[samples][q.rows])(q.state) / batch.temperature
    logits.requires_grad_(True)
    rows_seen: list[int] = []
    real = torch.log_softmax

    def spy(x, *a, **k):
        rows_seen.append(x.shape[0])
        return real(x, *a, **k)

    monkeypatch.setattr(torch, "log_softmax", spy)
    per_row = q.score(logits)
    monkeypatch.setattr(torch, "log_softmax", real)
    assert rows_seen == [2 * n]  # once, on the rows forwarded
    (g_row,) = torch.autograd.grad(per_row.sum(), logits)
    _, inverse, _ = shrunk_rows(steps, 2, samples)
    t = steps.view(-1, 1)
    per_pair = step_log_prob(
        logits[inverse], batch.unmask_step[samples] >= t, batch.unmask_step[samples] == t,
        batch.final_tokens[samples], "p1", gumbel_tau=batch.likelihood_tau[steps],
    )  # fmt: skip
    (g_pair,) = torch.autograd.grad(per_pair.sum(), logits)
    assert bool((batch.likelihood_tau[steps] > 0).any())
    torch.testing.assert_close(per_row, per_pair, rtol=0, atol=1e-5)
    torch.testing.assert_close(g_row, g_pair, rtol=1e-5, atol=1e-6)


def _update(cfg_over, batch, policy):
    cfg = load_config(TOY, [*SMALL, *cfg_over])
    up = settings_from_config(cfg).update
    opt = TorchOptimizing(policy, build_optimizer(up, policy), up.grad_clip_norm)
    plan = UpdatePlanner(up).plan(0, batch.num_samples, batch.group_size)
    return apply_update(opt, batch, plan, up)


@pytest.mark.parametrize("s", [2, 4])
def test_ratio_is_one_on_the_first_epoch(s):
    """The learner recomputes the old log-probs under the shrunk scoring before the first pass
    (the same computation on the same micro-batches): the first ratio is exactly 1. The
    rollout's own (exact) log-probs would not give 1 at the steps inside a block."""
    policy = build_policy(load_config(TOY, SMALL).model)
    batch = _batch(policy)
    m = _update(
        [f"train.trajectory_shrinkage={s}", "train.micro_batch_pairs_per_gpu=5", ALL], batch, policy
    )
    assert m["ratio_mean"] == 1.0  # against the recomputed old log-probs: exactly 1
    # the on-policy check: the block starts (steps 0, 2 at s = 2; 0 at s = 4) against the
    # rollout's cached log-probs, the same weights: 1 to round-off, not exactly (not a copy)
    assert m["onpolicy_measured_share"] == (2 if s == 2 else 1) / 4
    assert m["first_ratio_abs_dev_max"] < 1e-5 and m["abs_log_ratio_max"] < 1e-5
    assert m["forward_passes_per_sample"] == 4 / s  # rows never cut by a micro-batch
    policy = build_policy(load_config(TOY, SMALL).model)
    with torch.no_grad():
        n = batch.num_samples
        shrunk = pair_log_probs(
            policy, batch, torch.arange(n).repeat_interleave(4), torch.arange(4).repeat(n), s
        ).view(n, 4)
    assert (shrunk - batch.old_logp).abs().max() > 1e-3  # what keeping the rollout's would do


def test_shrinkage_needs_the_trajectory_estimator_and_at_most_s_steps():
    with pytest.raises(ValueError, match="trajectory_shrinkage=8"):
        load_config(TOY, [*SMALL, "train.trajectory_shrinkage=8"])
    with pytest.raises(ValueError, match="needs likelihood.estimator trajectory"):
        load_config(
            TOY, [*SMALL, ALL, "train.trajectory_shrinkage=2", "likelihood.estimator=forward"]
        )


class _CollectiveCounting(TorchOptimizing):
    """A rank whose forwards are collectives (ZeRO-3): pads backwards with a replayed forward
    (as ``learner.worker.DeepSpeedOptimizing`` does at stage 2/3) and counts the model calls."""

    collective_forward = True

    def __init__(self, policy, settings):
        super().__init__(policy, build_optimizer(settings, policy), settings.grad_clip_norm)
        self.calls = 0
        inner = policy.conditioned

        def conditioned(*a, **k):
            fn = inner(*a, **k)

            def counted(tokens):
                self.calls += 1
                return fn(tokens)

            return counted

        policy.conditioned = conditioned

    def pad_backward(self, replay):
        loss = replay()
        assert loss is not None
        self.backward(loss)


@pytest.mark.parametrize("collective", [True, False])
def test_ranks_call_the_model_equally_often_when_forwards_are_collective(collective):
    """Two ranks with 4 and 2 samples at s = 2, micro-batches of 3 rows: rank 0 takes 8 rows
    in 3 micro-batches, rank 1 4 rows in 2, so the group plans 3 backward calls. Under ZeRO-3
    every forward gathers parameters, a collective: the no-grad recompute is padded like the
    backward (issue 57), each rank calls the model 3 + 3 times. Without collective forwards
    the recompute is not padded (rank 1: 2 + 3)."""
    cfg = load_config(
        TOY, [*SMALL, ALL, "train.trajectory_shrinkage=2", "train.micro_batch_pairs_per_gpu=3"]
    )
    up = settings_from_config(cfg).update
    batch = _batch(build_policy(cfg.model))
    plan = UpdatePlanner(up).plan(0, batch.num_samples, batch.group_size)
    shards = [batch.rows(0, 4), batch.rows(4, 6)]
    calls = max(backward_calls(up, s.num_samples, plan.rows_per_sample(2, 4)) for s in shards)
    assert calls == 3
    counts = []
    for shard in shards:
        opt = _CollectiveCounting(build_policy(cfg.model), up)
        opt.collective_forward = collective
        apply_update(opt, shard, plan, up, normalizer=12.0, num_backward=calls)
        counts.append(opt.calls)
    assert counts == ([6, 6] if collective else [6, 5])
