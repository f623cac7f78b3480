"""The forward-process estimator (re-mask the final sample) and the ancestral sampler.

Expectations are derived, never read off the code under test: a hand-computed masked
log-prob, the exact mean over every mask of a size on an enumerable case, masks that depend on
(seed, draw) alone, and ratio 1 / KL 0 before the first update with the same seeds.
"""

from __future__ import annotations

import copy
import itertools
import math
import pickle

import pytest
import torch

from maskgrpo_ray.algo.estimators import (
    ForwardSettings,
    focus_step_counts,
    forward_masks,
    forward_query,
    mask_counts,
    masked_token_log_prob,
)
from maskgrpo_ray.algo.sampling import masked_share_before_steps, rollout
from maskgrpo_ray.config import ConfigError, load_config
from maskgrpo_ray.pipeline.learner_loss import accumulate_gradients, pair_log_probs, train_pairs
from maskgrpo_ray.pipeline.messages import TrainBatch
from maskgrpo_ray.pipeline.phases import generate
from maskgrpo_ray.pipeline.settings import settings_from_config
from maskgrpo_ray.worlds.toy.model import ToyModelSpec, ToyPolicy

PROMPTS = ["one red dot on the left", "three blue dots on the top", "two cyan dots on the right"]


def _forward(rule="stratified", reduction="mean", k=3, lo=0.25, hi=1.0):
    return ForwardSettings(
        num_draws=k, ratio_min=lo, ratio_max=hi, ratio_rule=rule, reduction=reduction
    )


def test_masked_log_prob_by_hand():
    # two tokens of a 3-token image, codebook of 2; logits chosen so that softmax is easy
    logits = torch.tensor([[[0.0, 0.0], [math.log(3.0), 0.0], [0.0, math.log(4.0)]]])
    targets = torch.tensor([[1, 0, 0]])
    mask = torch.tensor([[True, True, False]])
    # p(1) at pos 0 = 1/2; p(0) at pos 1 = 3/4; pos 2 is not masked
    expect_sum = math.log(0.5) + math.log(0.75)
    got = masked_token_log_prob(logits, targets, mask, "sum")
    torch.testing.assert_close(got, torch.tensor([expect_sum]))
    got = masked_token_log_prob(logits, targets, mask, "mean")
    torch.testing.assert_close(got, torch.tensor([expect_sum / 2]))


def test_masks_depend_on_seed_and_draw_alone():
    seeds = torch.tensor([11, 11, 12, 11])
    draws = torch.tensor([0, 1, 0, 0])
    counts = torch.tensor([5, 5, 5, 9])
    masks = forward_masks(seeds, draws, counts, 16)
    assert masks.sum(-1).tolist() == [5, 5, 5, 9]
    # one pair alone gives the same mask as inside a batch (the learner's micro-batches differ
    # from the rollout's draw-major passes)
    for i in range(4):
        alone = forward_masks(seeds[i : i + 1], draws[i : i + 1], counts[i : i + 1], 16)
        assert torch.equal(alone[0], masks[i])
    assert not torch.equal(masks[0], masks[1])  # another draw of the same sample
    assert not torch.equal(masks[0], masks[2])  # another sample's seed
    # a larger count of the same (seed, draw) extends the smaller mask (nested masks)
    assert bool((masks[0] <= masks[3]).all())


def test_mask_counts_rules():
    seeds = torch.tensor([1, 2, 3])
    strat = mask_counts(seeds, _forward("stratified", k=4, lo=0.2, hi=1.0), 10)
    # ratios 0.4, 0.6, 0.8, 1.0 of 10 tokens, the same for every sample (MaskGRPO's t_j)
    assert strat.tolist() == [[4, 6, 8, 10]] * 3
    uni = mask_counts(seeds, _forward("uniform", k=64, lo=0.3, hi=0.6), 100)
    assert int(uni.min()) >= 30 and int(uni.max()) <= 60
    assert torch.equal(uni, mask_counts(seeds, _forward("uniform", k=64, lo=0.3, hi=0.6), 100))
    assert not torch.equal(uni[0], uni[1])
    focus = torch.tensor([[3, 1], [2, 2], [9, 4]])
    got = mask_counts(seeds, _forward("step_focus", k=2), 8, focus)
    assert got.tolist() == [[3, 1], [2, 2], [8, 4]]  # clamped to L


def test_masks_are_uniform_over_subsets():
    # every 2-subset of 4 positions must come up with frequency 1/6
    n = 6000
    masks = forward_masks(torch.arange(n), torch.zeros(n, dtype=torch.long), torch.full((n,), 2), 4)
    keys = [tuple(m.nonzero().flatten().tolist()) for m in masks]
    freq = {s: keys.count(s) / n for s in itertools.combinations(range(4), 2)}
    se = math.sqrt((1 / 6) * (5 / 6) / n)
    assert sum(freq.values()) == pytest.approx(1.0)
    assert all(abs(f - 1 / 6) < 4 * se for f in freq.values()), freq


def test_estimator_mean_over_seeds_equals_exact_mean_over_masks():
    """Unbiasedness: the seeded estimator's Monte Carlo mean equals the exact average of the
    masked log-likelihood over all C(L, c) masks of the chosen size, on a tiny policy."""
    torch.manual_seed(0)
    policy = ToyPolicy(ToyModelSpec(grid=2, d_model=16, layers=1, heads=2)).eval()
    length, vocab = policy.num_image_tokens, policy.codebook_size  # L = 4
    cond = policy.tokenize(["one red dot on the left"])
    final = torch.randint(0, vocab, (1, length))
    c = 2

    def value(mask: torch.Tensor) -> torch.Tensor:  # mask [M, L]
        state = torch.where(mask, torch.full_like(final.expand_as(mask), vocab), final)
        with torch.no_grad():
            logits = policy.conditioned(cond.expand(len(mask), -1))(state)
        return masked_token_log_prob(logits, final.expand_as(mask), mask, "sum")

    subsets = list(itertools.combinations(range(length), c))
    exact_masks = torch.zeros(len(subsets), length, dtype=torch.bool)
    for i, s in enumerate(subsets):
        exact_masks[i, list(s)] = True
    exact = float(value(exact_masks).mean())
    n = 3000
    q = forward_query(
        final.expand(n, -1),
        torch.arange(n) * 7 + 3,
        torch.full((n,), c),
        torch.zeros(n, dtype=torch.long),
        vocab,
        "sum",
    )
    with torch.no_grad():
        est = q.score(policy.conditioned(cond.expand(n, -1))(q.state))
    se = float(est.std()) / math.sqrt(n)
    assert abs(float(est.mean()) - exact) < 4 * se, (float(est.mean()), exact, se)
    assert float(est.std()) > 0  # the masks really vary


def test_focus_step_counts_by_hand():
    final = torch.tensor([[1, 2, 3, 4]])
    unmask_step = torch.tensor([[0, 1, 2, 3]])  # masked before each step: 4, 3, 2, 1
    # agreement per step (committed tokens agree): 0.25, 0.25, 0.75, 1.0; MaskFocus scores
    # t = 1 .. S-2 only: jumps t1 0, t2 0.5; then t0, then t3 (the final step)
    preds = torch.tensor([[[1, 0, 0, 0], [1, 0, 0, 0], [1, 2, 3, 0], [1, 2, 3, 4]]])
    assert focus_step_counts(preds, final, unmask_step, 1).tolist() == [[2]]
    assert focus_step_counts(preds, final, unmask_step, 2).tolist() == [[3, 2]]  # t1, t2
    assert focus_step_counts(preds, final, unmask_step, 3).tolist() == [[4, 3, 2]]  # + t0


def _toy(seed=0):
    torch.manual_seed(seed)
    return ToyPolicy(ToyModelSpec(grid=4, d_model=32, layers=1)).eval()


def _forward_batch(policy, fwd, *, sampler="showo", guidance=0.0, temperature=1.0, gumbel=1.0):
    rb = generate(
        policy,
        PROMPTS,
        [0, 1, 2],
        group_size=4,
        num_steps=5,
        temperature=temperature,
        gumbel_temperature=gumbel,
        guidance_scale=guidance,
        transition="p1",
        policy_version=0,
        generator=torch.Generator().manual_seed(0),
        sampler=sampler,
        forward=fwd,
    )
    adv = torch.randn(rb.num_samples, generator=torch.Generator().manual_seed(1))
    return rb, TrainBatch.from_rollout(rb, adv)


@pytest.mark.parametrize(
    ("rule", "reduction", "sampler", "guidance", "temperature"),
    [
        ("stratified", "mean", "showo", 0.0, 1.0),
        ("uniform", "sum", "ancestral", 1.5, 0.7),
        ("step_focus", "mean", "showo", 0.0, 1.3),
    ],
)
def test_forward_ratio_is_one_before_the_first_update(
    rule, reduction, sampler, guidance, temperature
):
    policy = _toy()
    rb, batch = _forward_batch(
        policy,
        _forward(rule, reduction),
        sampler=sampler,
        guidance=guidance,
        temperature=temperature,
    )
    assert rb.estimator == "forward" and rb.unmask_step is None and rb.sampled is None
    assert rb.old_logp.shape == (12, 3) and rb.mask_counts is not None
    samples, draws = train_pairs(batch, torch.arange(3))
    perm = torch.randperm(len(samples), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logp = torch.cat(
            [
                pair_log_probs(policy, batch, samples[perm[i : i + 5]], draws[perm[i : i + 5]])
                for i in range(0, len(perm), 5)
            ]
        )
    torch.testing.assert_close(logp, batch.old_logp[samples[perm], draws[perm]], rtol=0, atol=2e-5)


def test_reference_uses_the_same_masks_kl_is_zero_and_ratio_moves_after_updates():
    policy = _toy()
    _, batch = _forward_batch(policy, _forward("uniform", "mean"))
    ref = copy.deepcopy(policy).requires_grad_(False)
    m = accumulate_gradients(
        policy,
        batch,
        train_steps=torch.arange(3),
        micro_batch=7,
        clip_low=0.2,
        clip_high=0.2,
        kl_coef=0.5,
        ref_policy=ref,
    )
    assert m["kl"] == 0.0 and m["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    # inner updates: after two optimizer steps on the same batch the ratio is real (not 1)
    opt = torch.optim.SGD(policy.parameters(), lr=0.05)
    for _ in range(2):
        opt.zero_grad()
        m = accumulate_gradients(
            policy,
            batch,
            train_steps=torch.arange(3),
            micro_batch=7,
            clip_low=0.2,
            clip_high=0.2,
            kl_coef=0.5,
            ref_policy=ref,
        )
        opt.step()
    assert m["kl"] > 0 and m["abs_log_ratio_max"] > 1e-4


def test_forward_record_is_smaller_than_the_trajectory_record():
    policy = _toy()
    rb_f, _ = _forward_batch(policy, _forward(k=2))
    rb_t = generate(
        policy,
        PROMPTS,
        [0, 1, 2],
        group_size=4,
        num_steps=5,
        temperature=1.0,
        gumbel_temperature=1.0,
        guidance_scale=0.0,
        transition="p1",
        policy_version=0,
        generator=torch.Generator().manual_seed(0),
    )

    def record_bytes(rb):
        return sum(
            x.numel() * x.element_size()
            for x in (rb.unmask_step, rb.old_logp, rb.mask_seed, rb.mask_counts, rb.sampled)
            if x is not None
        )

    # trajectory: unmask_step [N, L] long + old_logp [N, S]; forward: seed + counts [N, K]
    n, length = rb_t.final_tokens.shape
    assert record_bytes(rb_t) == n * length * 8 + n * 5 * 4
    assert record_bytes(rb_f) == n * 8 + n * 2 * 8 + n * 2 * 4
    assert len(pickle.dumps(rb_f)) < len(pickle.dumps(rb_t))


def test_ancestral_sampler_commits_on_schedule_and_p2_is_exact():
    length, steps = 64, 4
    shares = masked_share_before_steps(steps, length)
    assert shares[0] == 1.0 and shares[-1] == 0.0
    vocab = 5
    logits = torch.randn(1, length, vocab)
    n = 400
    traj = rollout(
        lambda tok: logits.expand(len(tok), -1, -1),
        torch.full((n, length), vocab),
        vocab,
        num_steps=steps,
        kind="p2",
        sampler="ancestral",
        generator=torch.Generator().manual_seed(0),
    )
    assert bool((traj.final_tokens < vocab).all())
    # the expected share committed by each step is k_t - k_{t+1} (independent Bernoullis)
    for t in range(steps):
        got = float((traj.unmask_step == t).float().mean())
        want = shares[t] - shares[t + 1]
        se = math.sqrt(want * (1 - want) / (n * length)) + 1e-9
        assert abs(got - want) < 5 * se + 1e-6, (t, got, want)
    # p2 of an ancestral step is the committed tokens' log-prob (positions are policy-free)
    logp = torch.log_softmax(logits[0], -1)
    committed = (traj.unmask_step == 0)[0]
    want0 = float(logp[committed, traj.final_tokens[0][committed]].sum())
    assert float(traj.old_logp[0, 0]) == pytest.approx(want0, abs=1e-5)


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (
            [
                "likelihood.estimator=forward",
                "train.unmasking_step_selection=last",
                "train.unmasking_steps_trained=2",
            ],
            "train.unmasking_step_selection='last'",
        ),
        (["rollout.sampler=ancestral"], "rollout.sampler='ancestral'"),
        (
            ["likelihood.forward.mask_ratio_min=0.9", "likelihood.forward.mask_ratio_max=0.5"],
            "mask_ratio_min=0.9",
        ),
        (
            [
                "likelihood.estimator=forward",
                "train.unmasking_step_selection=all",
                "likelihood.forward.mask_ratios=step_focus",
                "likelihood.forward.mask_draws=9",
            ],
            "mask_draws=9",
        ),
    ],
)
def test_bad_forward_configs_fail_naming_the_field(overrides, needle):
    with pytest.raises(ConfigError) as err:
        load_config("configs/toy.yaml", overrides)
    assert needle in str(err.value)


def test_settings_route_the_forward_estimator():
    cfg = load_config(
        "configs/toy.yaml",
        [
            "likelihood.estimator=forward",
            "train.unmasking_step_selection=all",
            "likelihood.forward.mask_draws=3",
            "rollout.sampler=ancestral",
        ],
    )
    s = settings_from_config(cfg)
    assert s.rollout.forward is not None and s.rollout.forward.num_draws == 3
    assert s.update.num_steps == 3 and s.rollout.sampler == "ancestral"
    assert s.eval.sampler == "ancestral"
    assert settings_from_config(load_config("configs/toy.yaml")).rollout.forward is None


def test_one_draw_per_inner_update_equals_updates_on_each_draw_in_turn():
    """``draws_per_update: one`` (MaskGRPO's one mask ratio per inner iteration): inner update
    i trains draw i mod K only; four updates equal four by-hand updates on draws 0, 1, 0, 1."""
    from maskgrpo_ray.pipeline.learner_core import TorchOptimizing, UpdatePlanner, apply_update

    cfg = load_config(
        "configs/toy.yaml",
        [
            "likelihood.estimator=forward",
            "train.unmasking_step_selection=all",
            "likelihood.forward.mask_draws=2",
            "likelihood.forward.draws_per_update=one",
            "train.updates_per_batch=4",
            "train.warmup_updates=0",
            "train.grad_clip_norm=0",
        ],
    )
    s = settings_from_config(cfg).update
    plan = UpdatePlanner(s).plan(0)
    assert plan.units_per_pass == 1
    assert [plan.units_for_pass(i).tolist() for i in range(4)] == [[0], [1], [0], [1]]
    policy = _toy()
    _, batch = _forward_batch(policy, _forward(k=2))
    by_hand = copy.deepcopy(policy).train()
    apply_update(
        TorchOptimizing(policy, torch.optim.SGD(policy.parameters(), lr=1.0), 0.0), batch, plan, s
    )
    sgd = torch.optim.SGD(by_hand.parameters(), lr=plan.learning_rate)
    for k in (0, 1, 0, 1):
        sgd.zero_grad()
        accumulate_gradients(
            by_hand,
            batch,
            train_steps=torch.tensor([k]),
            micro_batch=s.micro_batch_pairs,
            clip_low=s.clip_low,
            clip_high=s.clip_high,
            guards=s.guards,
        )
        sgd.step()
    for a, b in zip(policy.parameters(), by_hand.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    with pytest.raises(ConfigError, match="draws_per_update='one'"):
        load_config(
            "configs/toy.yaml",
            [
                "likelihood.estimator=forward",
                "train.unmasking_step_selection=all",
                "likelihood.forward.draws_per_update=one",
                "train.updates_per_batch=2",
            ],
        )


def test_complementary_pairs_score_every_token_exactly_once_per_pair():
    fwd = ForwardSettings(
        num_draws=4,
        ratio_min=0.2,
        ratio_max=1.0,
        ratio_rule="uniform",
        reduction="sum",
        coupling="complementary",
    )
    seeds = torch.tensor([3, 11, 2**40 + 7])
    counts = mask_counts(seeds, fwd, 16)  # [N, K]
    assert ((counts[:, 0::2] + counts[:, 1::2]) == 16).all()  # each pair covers L
    assert (counts >= 1).all() and (counts <= 15).all()  # and neither mask is empty
    for j in (0, 2):
        draws = torch.full((3,), j)
        a = forward_masks(seeds, draws, counts[:, j], 16, "complementary")
        b = forward_masks(seeds, draws + 1, counts[:, j + 1], 16, "complementary")
        assert not (a & b).any() and (a | b).all()  # disjoint, and together every position
        # the first of a pair is the uncoupled mask: coupling changes only the second draw
        assert torch.equal(a, forward_masks(seeds, draws, counts[:, j], 16))
    # the coupled batch's ratio is 1 before the first update (rollout and learner agree)
    policy = _toy()
    _, batch = _forward_batch(policy, fwd)
    assert batch.forward_coupling == "complementary"
    samples, draws = train_pairs(batch, torch.arange(4))
    with torch.no_grad():
        logp = pair_log_probs(policy, batch, samples, draws)
    torch.testing.assert_close(logp, batch.old_logp[samples, draws], rtol=0, atol=5e-5)
    with pytest.raises(ConfigError, match="mask_draws must be even"):
        load_config(
            "configs/toy.yaml",
            ["likelihood.forward.coupling=complementary", "likelihood.forward.mask_draws=3"],
        )
