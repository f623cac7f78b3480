"""Prompt metadata reaches the reward: a reward with ``uses_prompt_metadata`` (the toy GenEval
rule) gets each image's metadata in the single process, in a reward actor, and in a Ray run."""

from __future__ import annotations

import json
import os

import torch

from maskgrpo_ray.actors.reward import RewardActor
from maskgrpo_ray.cli import main
from maskgrpo_ray.pipeline.phases import generate, score_rewards
from maskgrpo_ray.pipeline.settings import RewardSettings
from maskgrpo_ray.prompts.loading import load_prompt_records
from maskgrpo_ray.rewards.base import RewardSpec, build_reward
from maskgrpo_ray.worlds.toy.rewards import ToyGenEvalReward, judge

TOY = os.path.join(os.path.dirname(__file__), "..", "configs", "toy.yaml")


def rollout():
    from maskgrpo_ray.config import load_config
    from maskgrpo_ray.pipeline.build import build_policy

    cfg = load_config(TOY, ["rollout.unmasking_steps=4"])
    torch.manual_seed(0)
    policy = build_policy(cfg.model)
    records = load_prompt_records("toy", "eval").records[:6]
    batch = generate(
        policy,
        [r.text for r in records],
        list(range(6)),
        group_size=4,
        num_steps=4,
        temperature=1.0,
        gumbel_temperature=0.0,
        guidance_scale=0.0,
        transition="p2",
        policy_version=0,
        generator=torch.Generator().manual_seed(1),
    )
    return batch, {r.text: r.meta for r in records}


def test_metadata_reward_equals_the_text_rule_and_fails_loudly_without_metadata():
    batch, table = rollout()
    reward = build_reward([RewardSpec("toy_geneval", 1.0, {"grid": 4})])
    with_meta = score_rewards(reward, batch, table)
    prompts = [p for p in batch.prompts for _ in range(batch.group_size)]
    want = judge(batch.images, prompts, 4)["correct"]
    assert torch.equal(with_meta.rewards, want) and torch.equal(with_meta.accuracy, want)
    assert 0 < float(want.mean()) < 1
    assert with_meta.reward_failures["toy_geneval"]["raised"] == 0
    without = score_rewards(reward, batch)  # no table: every sample lost and counted
    assert torch.isnan(without.rewards).all()
    assert without.reward_failures["toy_geneval"]["raised"] == batch.num_samples


def test_reward_actor_scores_with_the_metadata_it_was_sent():
    batch, table = rollout()
    settings = RewardSettings(specs=(RewardSpec("toy_geneval", 1.0, {"grid": 4}),))
    actor = RewardActor(settings, 0.0, 0)  # the actor class itself, in this process
    assert actor.set_prompt_metadata(table) == len(table)
    result = actor.score(batch.without_images(), batch.images)
    prompts = [p for p in batch.prompts for _ in range(batch.group_size)]
    assert torch.equal(result.rewards, judge(batch.images, prompts, 4)["correct"])
    assert isinstance(ToyGenEvalReward(4).uses_prompt_metadata, bool)


def test_a_ray_run_trains_on_the_metadata_reward(tmp_path):
    run = tmp_path / "run"
    argv = ["train", "--config", TOY, "--run-dir", str(run)]
    for s in (
        "train.steps=2",
        "train.prompts_per_step=4",
        "rollout.unmasking_steps=4",
        "eval.samples_per_prompt=2",
        "rollout.num_cpus_per_actor=0.25",
        "reward.num_cpus_per_actor=0.25",
        "learner.num_cpus_per_worker=0.25",
        "logging.progress_bar=false",
        "reward.components=[{kind: toy_geneval}]",
    ):
        argv += ["--set", s]
    assert main(argv) == 0
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(r["reward_failures/toy_geneval/raised"] == 0 for r in rows)
    assert all(0 <= r["accuracy"] <= 1 for r in rows)
    summary = json.loads((run / "summary.json").read_text())
    assert 0 <= summary["final_accuracy"] <= 1
