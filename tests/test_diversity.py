"""Diversity figures (``maskgrpo_ray.algo.diversity``): distinct images per group and the mean
pairwise distance in the reward's embedding space, in training rows and in evaluation."""

from __future__ import annotations

import json
import math

import pytest
import torch
from tiny_runs import TINY_BASE, sets, tiny_toy

from maskgrpo_ray.algo.diversity import (
    CEILING,
    DISTINCT,
    LAYOUTS,
    NEAREST,
    PAIRWISE,
    distinct_first,
    expected_distinct_fraction,
    group_diversity,
    mean_pairwise_distance,
    reward_embedding,
)
from maskgrpo_ray.rewards.base import build_reward
from maskgrpo_ray.worlds.toy import world as toyworld
from maskgrpo_ray.worlds.toy.model import toy_prompts
from maskgrpo_ray.worlds.toy.rewards import ToyRuleReward

GRID, PX = 4, 8


def _images(cells: list[list[int]]) -> torch.Tensor:
    tokens = torch.tensor(cells, dtype=torch.long)  # [N, L] palette ids
    return toyworld.decode_palette(tokens, GRID, PX)


def test_distinct_counts_repeats_within_each_group_only():
    a, b, c = [1] * 16, [2] * 16, [3] * 16
    images = _images([a, a, b, a, c, c, c, c])  # two groups of 4
    got = distinct_first(images, 4)
    assert got.tolist() == [1, 0, 1, 0, 1, 0, 0, 0]
    assert got[:4].mean() == 0.5 and got[4:].mean() == 0.25  # 2 of 4, 1 of 4 distinct


def test_the_toy_embedding_distance_is_the_share_of_cells_that_differ():
    base = [0] * 16
    one = [1] + [0] * 15  # 1 of 16 cells differs from base
    four = [1, 2, 3, 4] + [0] * 12  # 4 differ from base, 3 from `one`
    images = _images([base, one, four])
    feats = ToyRuleReward(GRID).embed(images)
    d = mean_pairwise_distance(feats, 3)
    # sample 0: (1/16 + 4/16) / 2; sample 1: (1/16 + 3/16) / 2; sample 2: (4/16 + 3/16) / 2
    want = torch.tensor([5 / 32, 4 / 32, 7 / 32])
    torch.testing.assert_close(d, want, rtol=0, atol=1e-6)
    same = mean_pairwise_distance(ToyRuleReward(GRID).embed(_images([base, base])), 2)
    assert same.tolist() == [0.0, 0.0]
    assert torch.isnan(mean_pairwise_distance(feats[:1], 1)).all()  # a group of one


def test_the_embedding_is_the_heaviest_component_that_has_one():
    composite = build_reward([("toy_rules", 1.0, {}), ("toy_geneval", 3.0, {})])
    embed = reward_embedding(composite)
    assert embed is not None and embed.__self__ is composite.rewards["toy_geneval"]
    out = group_diversity(_images([[1] * 16, [1] * 16]), 2, embed)
    assert out[DISTINCT].tolist() == [1.0, 0.0] and out[PAIRWISE].tolist() == [0.0, 0.0]
    assert reward_embedding(object()) is None
    assert set(group_diversity(_images([[1] * 16]), 1, None)) == {DISTINCT}


EVAL_SAMPLES = "eval.samples_per_prompt=4"
SMALL = tiny_toy(2, 3, EVAL_SAMPLES, "run.export_final_policy=false", warmup=False)


def test_training_rows_and_the_eval_report_carry_diversity(tmp_path, monkeypatch):
    from maskgrpo_ray.cli import main

    monkeypatch.setenv("MASKGRPO_CACHE_DIR", str(tmp_path / "cache"))
    run = tmp_path / "run"
    args = ["train", "--backend", "local", "--run-dir", str(run)]
    for s in SMALL:
        args += ["--set", s]
    assert main(args) == 0
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        assert 1 / 6 <= r[DISTINCT] <= 1.0, r  # G = 6: at least one distinct image a group
        assert 0.0 <= r[PAIRWISE] <= 1.0, r
        assert 0.0 <= r[NEAREST] <= r[PAIRWISE] + 1e-6, r  # the nearest is at most the mean
        assert r[LAYOUTS] == r[DISTINCT], r  # a toy image is its cells: one layout, one image
    summary = json.loads((run / "summary.json").read_text())
    assert f"eval_{NEAREST}" in summary["base_eval"] and f"eval_{NEAREST}" in summary["final_eval"]
    # the ceiling of 4 samples: a k-dot prompt has C(8, k) correct images on the 4x4 grid
    counts = [toyworld.Caption.parse(p).count for p in toy_prompts("eval")]
    ceiling = sum(expected_distinct_fraction(math.comb(8, k), 4) for k in counts) / len(counts)
    for ev in (summary["base_eval"], summary["final_eval"]):
        assert ev[f"eval_{CEILING}"] == pytest.approx(ceiling, rel=1e-6)
        assert ev[f"eval_{LAYOUTS}"] == ev[f"eval_{DISTINCT}"]
    out = tmp_path / "eval"
    rc = main(
        ["eval", "--weights", "base", "--out", str(out), "--backend", "local"]
        + sets([TINY_BASE, EVAL_SAMPLES])
    )
    assert rc == 0
    report = json.loads((out / "report.json").read_text())
    means = report["means"]["base"]
    assert 0.25 <= means[DISTINCT] <= 1.0 and 0.0 <= means[PAIRWISE] <= 1.0, means
    md = (out / "report.md").read_text()
    assert DISTINCT in md and PAIRWISE in md and NEAREST in md
    assert LAYOUTS in md and CEILING in md
    assert means[CEILING] == pytest.approx(ceiling, rel=1e-6)
    assert 0.0 <= means[NEAREST] <= means[PAIRWISE] + 1e-6
    print({k: v for k, v in means.items() if k.startswith("diversity")})


@pytest.mark.parametrize("g", [2, 3])
def test_group_diversity_of_identical_groups_is_minimal(g):
    images = _images([[2] * 16] * (2 * g))
    out = group_diversity(images, g, ToyRuleReward(GRID).embed)
    assert out[DISTINCT].view(2, g).mean(-1).tolist() == pytest.approx([1 / g, 1 / g])
    assert out[PAIRWISE].tolist() == [0.0] * (2 * g)
    assert out[NEAREST].tolist() == [0.0] * (2 * g)
