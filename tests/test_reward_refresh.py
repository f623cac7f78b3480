"""``reward.refresh`` (issue 53, Adv-GRPO's online reward, arXiv 2511.20256): the shapes world's
learned reward trained during RL on reference renders against the policy's samples.

The refresh raises the reference-vs-sample margin on the samples it trained on (the margin
recomputed here through the reward's own scoring), is deterministic in its inputs and seed, and
leaves evaluation's frozen copy as loaded; a kind that cannot refresh and the Ray backend are
refused before anything starts; a run with the refresh off, or on but never due, is the run of
today; a run resumed from a checkpoint refreshes exactly as an uninterrupted one.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from test_shapes_world import TINY_WORLD
from tiny_runs import NO_GRIDS, QUIET, train_argv

from maskgrpo_ray.cli import main
from maskgrpo_ray.config import ConfigError, load_config
from maskgrpo_ray.errors import UserError
from maskgrpo_ray.pipeline.build import build_policy, build_reward_from_settings
from maskgrpo_ray.pipeline.phases import generate
from maskgrpo_ray.pipeline.reward_refresh import check_reward_refresh, make_refresher
from maskgrpo_ray.pipeline.settings import settings_from_config
from maskgrpo_ray.weights.safe_files import load_torch_file
from maskgrpo_ray.worlds.shapes.reward_refresh import reference_renders

ON = ["run.backend=local", "reward.refresh.enabled=true"]


@pytest.fixture(scope="module")
def shipped():
    """The shipped shapes reward and a batch of the shipped base policy's samples (2 prompts,
    G = 4, 4 unmasking steps: cheap, and far from the references)."""
    cfg = load_config("configs/shapes.yaml", [*ON, "reward.refresh.replay_prompts=8"])
    s = settings_from_config(cfg)
    policy = build_policy(cfg.model)
    kw = {**s.rollout.kwargs(), "group_size": 4, "num_steps": 4}
    prompts = ["a red circle", "a square left of a triangle"]
    rb = generate(policy, prompts, [0, 1], policy_version=0, generator=torch.Generator().manual_seed(0), **kw)  # fmt: skip
    return cfg, s, rb


def _margin(reward, refs: torch.Tensor, images: torch.Tensor, texts: list[str], g: int) -> float:
    """mean_u (mean reference score - mean sample score), through the reward's own scoring."""
    u, r = refs.shape[:2]
    s_ref = reward(refs.flatten(0, 1), [t for t in texts for _ in range(r)]).view(u, r)
    s_smp = reward(images, [t for t in texts for _ in range(g)]).view(u, g)
    return float((s_ref.mean(1) - s_smp.mean(1)).mean())


def test_refresh_raises_the_margin_it_trained_on_deterministically_and_eval_stays_frozen(shipped):
    cfg, s, rb = shipped
    prompts = [p for p in rb.prompts for _ in range(rb.group_size)]
    runs = []
    for seed in [(0, 5), (0, 5), (0, 6)]:
        reward = build_reward_from_settings(s.reward)
        loaded = {k: v.clone() for k, v in reward.rewards["shapes_clip"].model.state_dict().items()}
        refresher = make_refresher(cfg, reward)
        assert refresher is not None
        part = refresher.part
        figures = part.refresh(rb.images, prompts, seed)
        runs.append((figures, part.model.state_dict(), refresher, reward, loaded))
    (f0, w0, refresher, reward, loaded), (f1, w1, *_), (_, w2, *_) = runs
    # the references are the seed's first draws: the margin before and after, recomputed
    refs = reference_renders(
        list(rb.prompts), 2, refresher.part.model, np.random.default_rng([0, 5])
    )
    texts, g = list(rb.prompts), rb.group_size
    before = _margin(refresher.frozen, refs, rb.images, texts, g)
    after = _margin(refresher.part, refs, rb.images, texts, g)
    assert f0["margin_before"] == pytest.approx(before, rel=1e-4, abs=1e-4)
    assert f0["margin"] == pytest.approx(after, rel=1e-4, abs=1e-4)
    assert after > before + 0.05, (before, after)  # the references now outscore the samples more
    assert f0["prompts"] == 2 and f0["skipped_samples"] == 0
    # deterministic: the same inputs and seed give the same weights and figures; another seed not
    assert {k: v for k, v in f0.items() if k != "seconds"} == {k: v for k, v in f1.items() if k != "seconds"}  # fmt: skip
    assert all(torch.equal(w0[k], w1[k]) for k in w0)
    assert any(not torch.equal(w0[k], w2[k]) for k in w0)
    # evaluation scores with the frozen original: the weights as loaded, untouched
    frozen = refresher.frozen
    assert refresher.eval_reward(reward).rewards["shapes_clip"] is frozen
    assert all(torch.equal(frozen.model.state_dict()[k], loaded[k]) for k in loaded)
    assert any(not torch.equal(w0[k], loaded[k]) for k in loaded)


def test_a_reward_that_cannot_refresh_and_the_ray_backend_are_refused():
    judge = load_config("configs/shapes.yaml", [*ON, "reward.refresh.component=shapes_judge"])
    with pytest.raises(UserError) as err:
        check_reward_refresh(judge)
    msg = str(err.value)
    assert "\n" not in msg and "reward.refresh.component='shapes_judge'" in msg
    assert "set reward.refresh.enabled false" in msg
    with pytest.raises(ConfigError, match=r"run.backend=local"):
        load_config("configs/shapes.yaml", ["reward.refresh.enabled=true"])  # the config's ray
    with pytest.raises(ConfigError, match=r"reward.refresh.component='clip' is no reward"):
        load_config("configs/shapes.yaml", [*ON, "reward.refresh.component=clip"])
    # the validate command (the train command's preflight) refuses it too
    sets = _sets([*ON, "reward.refresh.component=shapes_judge"])
    assert main(["validate", "--config", "configs/shapes.yaml", *sets]) != 0


def _sets(overrides: list[str]) -> list[str]:
    return [a for o in overrides for a in ("--set", o)]


def _run(run: Path, evals: Path, steps: int, *extra: str) -> list[dict]:
    """A tiny shapes run on the local backend (2 prompts of 3 samples a step, 2 eval prompts)."""
    small = [
        f"train.steps={steps}",
        "train.prompts_per_step=2",
        "rollout.samples_per_prompt=3",
        "rollout.unmasking_steps=4",
        "eval.samples_per_prompt=1",
        "eval.every_steps=0",
        "filter.enabled=false",
        f"data.eval_prompts={evals}",
        "reward.refresh.replay_prompts=4",
        "logging.monitors.enabled=false",
        QUIET,
        NO_GRIDS,
    ]
    argv = train_argv(run, [*TINY_WORLD, *small, *extra])
    assert main(["train", "--config", "configs/shapes.yaml", *argv[1:]]) == 0
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    """The tiny world's cache (pre-trained once for the module) and a 2-prompt eval file."""
    folder = tmp_path_factory.mktemp("world")
    evals = folder / "eval.txt"
    evals.write_text("a circle\nfour circles\n")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MASKGRPO_CACHE_DIR", str(folder / "cache"))
        yield evals


WALL_CLOCK = ("seconds", "per_second", "busy", "eta", "time/")  # figures of time, not of the run


def test_off_is_todays_run_and_a_resumed_run_refreshes_as_an_uninterrupted_one(tmp_path, world):
    """Off: no refresher is built, no figure or file of it; on, the refresh after step ``s``
    changes nothing of step ``s`` (its row is the run without it, bit for bit) and the next
    step's learned reward. Cut after step 0 and resumed, the run's step 1 and the refreshed
    reward and optimiser it checkpoints are the uninterrupted run's, exactly."""
    off = _run(tmp_path / "off", world, 2, "reward.refresh.enabled=false")
    whole = _run(tmp_path / "whole", world, 2, "reward.refresh.enabled=true")
    assert not any(k.startswith("refresh/") for r in off for k in r)
    assert not (tmp_path / "off" / "checkpoints" / "step_000002" / "reward_refresh.pt").exists()
    same = {k: v for k, v in whole[0].items() if not k.startswith("refresh/")}
    assert {k: v for k, v in same.items() if not any(w in k for w in WALL_CLOCK)} == {
        k: v for k, v in off[0].items() if not any(w in k for w in WALL_CLOCK)
    }
    assert whole[0]["refresh/margin"] > whole[0]["refresh/margin_before"]
    assert whole[1]["reward/shapes_clip"] != off[1]["reward/shapes_clip"]
    _run(tmp_path / "cut", world, 1, "reward.refresh.enabled=true")  # its end: a checkpoint
    resumed = _run(tmp_path / "cut", world, 2, "reward.refresh.enabled=true")  # goes on there
    assert resumed[-1]["step"] == 1
    a = load_torch_file(tmp_path / "whole" / "checkpoints" / "step_000002" / "reward_refresh.pt")
    b = load_torch_file(tmp_path / "cut" / "checkpoints" / "step_000002" / "reward_refresh.pt")
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[i][m], sb[i][m]) for i in sa for m in ("exp_avg", "exp_avg_sq"))
    for key in ("reward/shapes_clip", "refresh/margin", "refresh/loss", "loss"):
        assert whole[1][key] == resumed[-1][key], key
