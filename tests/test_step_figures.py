"""The driver's per-step reward figures: every generated group vs the groups trained on."""

from __future__ import annotations

import math
import os

import pytest
import torch

from maskgrpo_ray.config import load_config
from maskgrpo_ray.loop import driver
from maskgrpo_ray.pipeline.messages import ScoredBatch
from maskgrpo_ray.pipeline.phases import FilterResult, generate
from maskgrpo_ray.pipeline.settings import step_settings
from maskgrpo_ray.prompts.loading import PromptStream, load_prompts
from maskgrpo_ray.worlds.toy.model import ToyModelSpec, ToyPolicy

TOY = os.path.join(os.path.dirname(__file__), "..", "configs", "toy.yaml")
NAN = float("nan")
# rewards per (prompt, attempt), G = 2: prompt 0 kept at once; 1 dropped (std 0), then kept;
# 2 invalid (a NaN, never re-sampled); 3 dropped twice (exhausted with max_resamples = 1)
TABLE = {
    (0, 0): [1.0, 0.0],
    (1, 0): [0.5, 0.5],
    (2, 0): [NAN, 1.0],
    (3, 0): [0.25, 0.25],
    (1, 1): [0.0, 0.6],
    (3, 1): [0.75, 0.75],
}


class TableExecutor:
    """Real rollouts of a tiny toy policy, rewards from TABLE; keeps groups with std > 0."""

    policy_version = 0
    chunk_prompts = 4  # one chunk per call
    runs_ahead = False

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.policy = ToyPolicy(ToyModelSpec(grid=4, d_model=32, layers=1)).eval()
        self.prompts = load_prompts("toy")[:4]
        self.attempts = [0, 0, 0, 0]
        self.trained: list[torch.Tensor] = []

    def generate_and_score(self, chunks, traffic) -> ScoredBatch:
        (chunk,) = chunks
        prompts, positions = chunk.prompts, chunk.positions
        rb = generate(
            self.policy,
            prompts,
            positions,
            group_size=2,
            num_steps=2,
            temperature=1.0,
            gumbel_temperature=0.0,
            guidance_scale=0.0,
            transition="p1",
            policy_version=0,
            generator=torch.Generator().manual_seed(len(self.trained)),
        )
        rewards = []
        for p in positions:
            rewards += TABLE[(p, self.attempts[p])]
            self.attempts[p] += 1
        r = torch.tensor(rewards)
        acc = torch.where(torch.isfinite(r), (r >= 0.5).float(), NAN)  # "correct" iff r >= 0.5
        return ScoredBatch(rb, r, {}, acc).validate()

    def filter(self, scored: ScoredBatch, traffic) -> FilterResult:
        r = scored.rewards.view(-1, 2)
        invalid = ~torch.isfinite(r).all(1)
        stds = torch.nan_to_num(r).std(1)
        return FilterResult(~invalid & (stds > 0), invalid, stds)

    def update(self, batch):
        self.trained.append(batch.cond_ids)
        return {}

    def sync_weights(self) -> float:
        return 0.0

    def filter_stats(self) -> dict[str, float]:
        return {}

    def filter_state(self) -> None:
        return None

    def load_filter_state(self, state: None) -> None:
        pass

    def extra_metrics(self) -> dict[str, float]:
        return {}


def _source(ex, cfg, prompts, skip=0):
    """The prompts in order (positions 0, 1, ...), the first ``skip`` already taken."""
    stream = PromptStream(prompts, seed=0, shuffle=False)
    stream.take(skip)
    cfg = cfg.model_copy(
        update={"train": cfg.train.model_copy(update={"prompts_per_step": 4 - skip})}
    )
    return driver.make_source(ex, cfg, stream)


def test_reward_figures_describe_every_generated_group_and_the_kept_ones_apart():
    cfg = load_config(TOY, ["filter.max_resamples=1", "rollout.samples_per_prompt=2"])
    ex = TableExecutor()
    out, _ = driver.run_step(ex, step_settings(cfg), 0, _source(ex, cfg, ex.prompts))
    row = out.row
    # generated: attempt 0 (4 groups) + attempt 1 (prompts 1, 3); the NaN sample is left out:
    #   finite rewards 1, 0, .5, .5, 1, .25, .25 | 0, .6, .75, .75 -> 5.6 / 11
    #   correct (r >= .5): 1, 0, 1, 1, 1, 0, 0 | 0, 1, 1, 1 -> 7 / 11
    # kept: prompt 0 (1, 0) and prompt 1's second attempt (0, .6) -> 1.6 / 4; correct 2 / 4
    assert row["reward_mean"] == pytest.approx(5.6 / 11, abs=1e-6)
    finite = [1, 0, 0.5, 0.5, 1, 0.25, 0.25, 0, 0.6, 0.75, 0.75]
    mean = sum(finite) / 11
    std = math.sqrt(sum((x - mean) ** 2 for x in finite) / 10)
    assert row["reward_std"] == pytest.approx(std, abs=1e-6)
    assert row["accuracy"] == pytest.approx(7 / 11, abs=1e-6)
    assert row["reward_mean_kept"] == pytest.approx(0.4, abs=1e-6)
    assert row["accuracy_kept"] == pytest.approx(0.5, abs=1e-6)
    counts = {k: row[k] for k in ("groups_generated", "groups_dropped", "groups_invalid")}
    assert counts == {"groups_generated": 6.0, "groups_dropped": 3.0, "groups_invalid": 1.0}
    assert (row["groups_exhausted"], row["groups_trained"]) == (1.0, 2.0)
    # the update saw exactly prompts 0 and 1 (kept order), G = 2 samples each
    expect = ex.policy.tokenize(ex.prompts[:2]).repeat_interleave(2, dim=0)
    assert len(ex.trained) == 1 and torch.equal(ex.trained[0], expect)


def test_reward_figures_when_nothing_survives():
    # every group invalid or dropped: the all-groups figures still describe them, kept are NaN
    cfg = load_config(TOY, ["filter.max_resamples=0", "rollout.samples_per_prompt=2"])
    ex = TableExecutor()
    row = driver.run_step(ex, step_settings(cfg), 0, _source(ex, cfg, ex.prompts, skip=1))[0].row
    # finite rewards .5, .5, 1, .25, .25 -> 2.5 / 5; correct 1, 1, 1, 0, 0 -> 3 / 5
    assert row["reward_mean"] == pytest.approx(0.5, abs=1e-6)
    assert row["accuracy"] == pytest.approx(0.6, abs=1e-6)
    assert math.isnan(row["reward_mean_kept"]) and math.isnan(row["accuracy_kept"])
    assert row["groups_trained"] == 0.0 and ex.trained == []
