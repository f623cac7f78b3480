"""Reward failures are counted per component and kind, and their groups skipped, visibly.

Three faulty components next to the toy rules reward: one raises on a batch, one returns NaN /
+inf for single samples, one returns the wrong number of values. Which batch or sample fails is
set by the prompt, so every expected count is derived from the prompt stream.
"""

from __future__ import annotations

import json
import logging
import os

import pytest
import ray
import torch
from tiny_runs import NO_GRIDS, tiny_toy

from maskgrpo_ray.config import load_config
from maskgrpo_ray.loop import driver
from maskgrpo_ray.loop.local import LocalExecutor
from maskgrpo_ray.pipeline.build import build_policy
from maskgrpo_ray.pipeline.phases import REWARD_FAILURE_KINDS, filter_groups, generate, score
from maskgrpo_ray.prompts.loading import PromptStream, load_prompts
from maskgrpo_ray.rewards.base import CompositeReward
from maskgrpo_ray.worlds.toy.model import ToyModelSpec, ToyPolicy
from maskgrpo_ray.worlds.toy.rewards import ToyRuleReward

TOY = os.path.join(os.path.dirname(__file__), "..", "configs", "toy.yaml")
G = 3
WEIGHTS = {"toy_rules": 1.0, "raises": 1.0, "nonfinite": 0.5, "shape": 2.0}


def faulty_reward(*, raise_on: str, nan_on: str, inf_on: str, shape_on: str) -> CompositeReward:
    """Toy rules plus three components that fail on the named prompts (0.0 elsewhere).

    The classes are local so that Ray ships them by value to a reward actor.
    """

    class Raises:
        name = "raises"

        def __call__(self, images, prompts):
            if raise_on in prompts:
                raise RuntimeError("reward server down")
            return torch.zeros(len(prompts))

    class NonFinite:
        name = "nonfinite"

        def __call__(self, images, prompts):
            out = torch.zeros(len(prompts))
            if nan_on in prompts:
                out[prompts.index(nan_on)] = float("nan")  # the group's first sample
            if inf_on in prompts:
                out[len(prompts) - 1 - prompts[::-1].index(inf_on)] = float("inf")  # its last
            return out

    class BadShape:
        name = "shape"

        def __call__(self, images, prompts):
            return torch.zeros(len(prompts) - (shape_on in prompts))

    parts = [ToyRuleReward(grid=4), Raises(), NonFinite(), BadShape()]
    return CompositeReward([(r, WEIGHTS[r.name]) for r in parts])


def expected_failures(prompts: list[str], poison: dict[str, str]) -> dict[str, dict[str, int]]:
    """Samples lost per component and kind for one batch of groups of ``prompts``."""
    n = len(prompts) * G
    out = {name: dict.fromkeys(REWARD_FAILURE_KINDS, 0) for name in [*WEIGHTS, "accuracy"]}
    out["raises"]["raised"] = n if poison["raise_on"] in prompts else 0
    out["shape"]["bad_shape"] = n if poison["shape_on"] in prompts else 0
    out["nonfinite"]["nonfinite"] = (poison["nan_on"] in prompts) + (poison["inf_on"] in prompts)
    return out


def expected_invalid(prompts: list[str], poison: dict[str, str]) -> list[bool]:
    """Groups with a NaN total: every group of a batch that lost a component, else the groups
    holding a NaN / inf sample (prompts are distinct within a batch here)."""
    if poison["raise_on"] in prompts or poison["shape_on"] in prompts:
        return [True] * len(prompts)
    return [p in (poison["nan_on"], poison["inf_on"]) for p in prompts]


def test_score_counts_each_component_and_keeps_the_good_values(caplog):
    torch.manual_seed(0)
    policy = ToyPolicy(ToyModelSpec(grid=4, d_model=32, layers=1)).eval()
    prompts = load_prompts("toy")[:3]
    poison = {"nan_on": prompts[0], "inf_on": prompts[1], "raise_on": "-", "shape_on": "-"}
    rb = _rollout(policy, prompts, [7, 8, 9])
    with caplog.at_level(logging.WARNING, logger="maskgrpo_ray.pipeline.phases"):
        sb = score(faulty_reward(**poison), rb)
    assert sb.reward_failures == expected_failures(prompts, poison)
    rules = ToyRuleReward(grid=4)(rb.images, [p for p in prompts for _ in range(G)])
    # samples 0 (NaN) and 5 (inf, last of group 1) are lost; elsewhere the total is
    # 1 * rules + 1 * 0 + 0.5 * 0 + 2 * 0 = rules
    lost = torch.zeros(3 * G, dtype=torch.bool)
    lost[[0, 5]] = True
    assert (
        torch.isnan(sb.rewards[lost]).all()
        and torch.isnan(sb.reward_parts["nonfinite"][lost]).all()
    )
    torch.testing.assert_close(sb.rewards[~lost], rules[~lost], rtol=0, atol=0)
    torch.testing.assert_close(sb.reward_parts["toy_rules"], rules, rtol=0, atol=0)
    assert filter_groups(sb, None).invalid.tolist() == [True, True, False]
    assert (
        "reward component 'nonfinite': nonfinite on 2 of 9 samples, prompts [7, 8]" in caplog.text
    )
    assert "nan" in caplog.text and "inf" in caplog.text

    # raising and wrong shape: the whole batch, each with its own counter and warning
    poison = {"nan_on": "-", "inf_on": "-", "raise_on": prompts[2], "shape_on": prompts[2]}
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="maskgrpo_ray.pipeline.phases"):
        sb = score(faulty_reward(**poison), rb)
    assert sb.reward_failures == expected_failures(prompts, poison)
    assert torch.isnan(sb.rewards).all() and filter_groups(sb, None).invalid.all()
    torch.testing.assert_close(sb.reward_parts["toy_rules"], rules, rtol=0, atol=0)
    assert (
        "reward component 'raises': raised on 9 of 9 samples, prompts [7, 8, 9]: "
        "RuntimeError('reward server down')" in caplog.text
    )
    assert (
        "reward component 'shape': bad_shape on 9 of 9 samples, prompts [7, 8, 9]: returned (8,)"
        in caplog.text
    )


def test_plain_reward_that_raises_is_one_component_named_by_the_reward():
    torch.manual_seed(0)
    policy = ToyPolicy(ToyModelSpec(grid=4, d_model=32, layers=1)).eval()
    rb = _rollout(policy, load_prompts("toy")[:2], [0, 1])

    class Broken:
        name = "server"

        def __call__(self, images, prompts):
            raise RuntimeError("reward server down")

    bad = score(Broken(), rb)
    assert torch.isnan(bad.rewards).all() and bad.reward_parts == {} and bad.accuracy is None
    assert bad.reward_failures == {"server": {"raised": 2 * G, "nonfinite": 0, "bad_shape": 0}}
    res = filter_groups(bad, None)
    assert res.invalid.all() and not res.keep.any()


def _rollout(policy, prompts, positions):
    return generate(
        policy,
        prompts,
        positions,
        group_size=G,
        num_steps=2,
        temperature=1.0,
        gumbel_temperature=0.0,
        guidance_scale=0.0,
        transition="p1",
        policy_version=0,
        generator=torch.Generator().manual_seed(0),
    )


def test_local_run_skips_failed_groups_and_logs_cumulative_counts(tmp_path, monkeypatch):
    monkeypatch.setenv("MASKGRPO_CACHE_DIR", str(tmp_path / "cache"))
    steps, b = 4, 3
    cfg = load_config(
        TOY,
        tiny_toy(
            steps,
            b,
            "run.backend=local",
            f"rollout.samples_per_prompt={G}",
            "filter.enabled=false",  # no drops and re-samples: one batch per step
            f"rollout.prompts_per_chunk={b}",  # one scored call per step (a raise hits it all)
            NO_GRIDS,
            warmup=False,
        ),
    )
    train_prompts = load_prompts("toy", "train")
    plan = PromptStream(train_prompts, cfg.run.seed, cfg.data.shuffle)
    batches = [plan.take(b)[0] for _ in range(steps)]
    assert len({p for batch in batches for p in batch}) == steps * b  # distinct: simple counts
    # step 0: one NaN sample; 1: a component raises; 2: wrong shape; 3: one +inf sample
    poison = {
        "nan_on": batches[0][0],
        "raise_on": batches[1][0],
        "shape_on": batches[2][1],
        "inf_on": batches[3][2],
    }
    policy = build_policy(cfg.model)
    ex = LocalExecutor(cfg, policy, faulty_reward(**poison), None)
    trained: list[torch.Tensor] = []
    real_update = ex.update

    def update(tb):
        trained.append(tb.cond_ids)
        return real_update(tb)

    ex.update = update  # type: ignore[method-assign]
    stream = PromptStream(train_prompts, cfg.run.seed, cfg.data.shuffle)
    driver.train(cfg, ex, tmp_path / "run", stream, load_prompts("toy", "eval")[:2])

    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(steps))
    cumulative: dict[str, float] = {}
    kept_batches = []
    for batch, row in zip(batches, rows):
        invalid = expected_invalid(batch, poison)
        assert row["groups_generated"] == b
        assert row["groups_invalid"] == sum(invalid)
        assert row["groups_trained"] == b - sum(invalid)
        for name, kinds in expected_failures(batch, poison).items():
            for kind, n in kinds.items():
                key = f"reward_failures/{name}/{kind}"
                cumulative[key] = cumulative.get(key, 0) + n
                assert row[key] == cumulative[key], (row["step"], key)
        kept = [p for p, bad in zip(batch, invalid) if not bad]
        if kept:
            kept_batches.append(kept)
        else:
            assert row["reward_mean"] is None  # every total is NaN: nothing finite to average
    # the totals the derivation gives: 9 raised, 9 bad shape, 2 non-finite samples
    assert (
        cumulative["reward_failures/raises/raised"],
        cumulative["reward_failures/shape/bad_shape"],
        cumulative["reward_failures/nonfinite/nonfinite"],
    ) == (b * G, b * G, 2)
    # the learner saw exactly the valid groups (steps 0 and 3: two groups each)
    assert [len(k) for k in kept_batches] == [2, 2] and len(trained) == 2
    for cond, kept in zip(trained, kept_batches):
        assert torch.equal(cond, policy.tokenize(kept).repeat_interleave(G, dim=0))
    assert [r["policy_version"] for r in rows] == [0, 1, 1, 1]


@pytest.mark.timeout(300)
def test_reward_actor_reports_the_same_counts(ray_cluster):
    from maskgrpo_ray.actors.reward import RemoteRewardActor
    from maskgrpo_ray.pipeline.messages import RewardResult
    from maskgrpo_ray.pipeline.settings import settings_from_config

    torch.manual_seed(0)
    policy = ToyPolicy(ToyModelSpec(grid=4, d_model=32, layers=1)).eval()
    prompts = load_prompts("toy")[:3]
    poison = {
        "nan_on": prompts[0],
        "inf_on": prompts[1],
        "raise_on": prompts[2],
        "shape_on": prompts[2],
    }
    rb = _rollout(policy, prompts, [0, 1, 2])
    reward = faulty_reward(**poison)
    local = score(reward, rb)
    cfg = load_config(TOY, ["reward.num_cpus_per_actor=0.25"])
    settings = settings_from_config(cfg).reward
    actor = RemoteRewardActor.options(num_cpus=0.25).remote(settings, 0.0, 0, reward)
    try:
        remote = [ray.get(actor.score.remote(rb), timeout=120) for _ in range(2)]
        stats = ray.get(actor.stats.remote(), timeout=60)
    finally:
        ray.kill(actor)
    once = expected_failures(prompts, poison)
    for sb in remote:
        assert isinstance(sb, RewardResult)  # scores only: the rollout is not sent back
        assert sb.reward_failures == local.reward_failures == once
        torch.testing.assert_close(sb.rewards, local.rewards, equal_nan=True, rtol=0, atol=0)
    expect = {"reward_batches": 2.0}
    for name, kinds in once.items():
        for kind, n in kinds.items():
            expect[f"reward_failures/{name}/{kind}"] = 2.0 * n
    assert stats == expect
    # two batches of 3 groups x G: every sample raised and misshaped, a NaN and an inf each
    assert expect["reward_failures/raises/raised"] == expect["reward_failures/shape/bad_shape"]
    assert (
        expect["reward_failures/raises/raised"],
        expect["reward_failures/nonfinite/nonfinite"],
    ) == (2 * 3 * G, 4)
