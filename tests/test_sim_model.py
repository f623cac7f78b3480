"""The simulated accelerator (``model.kind: sim``): real tensors, the profile's time, the
target's bytes x ``bytes_scale``. What is tested is what cannot depend on the machine's load:
the seconds the clock charges (exact: the profile's formula) and that a call lasts at least its
simulated time (it sleeps until then). How far a loaded machine overruns it is a benchmark's
figure (``bench/bench_cluster_sim.py`` prints the clock's overrun), never a timed test."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
import torch
import yaml

from maskgrpo_ray.cli import main
from maskgrpo_ray.config import ConfigError, load_config
from maskgrpo_ray.rewards.base import build_reward
from maskgrpo_ray.worlds.toy.model import ToyModelSpec, ToyPolicy
from maskgrpo_ray.worlds.toy.sim import SimModelConfig, SimPolicy, image_side, workload_of

TOY = Path(__file__).parents[1] / "configs" / "toy.yaml"
SIM = Path(__file__).parents[1] / "configs" / "sim_showo512.yaml"

# a profile with round numbers (seconds per unit, at time_scale 1)
HAND = {
    "base": "showo_512_h100",
    "rollout_seconds_per_image_step": 0.004,
    "learner_seconds_per_pair": 0.003,
    "reward_seconds_per_image": 0.002,
    "weight_bytes": 40_000_000,
    "sync_bytes_per_second": 400e6,  # a weight load: 0.1 s
}


def _timed(call, simulated: float, repeats: int = 2) -> None:
    """Every repeat lasts at least ``simulated`` (the clock sleeps until then)."""
    for _ in range(repeats):
        t0 = time.perf_counter()
        call()
        assert time.perf_counter() - t0 >= simulated


def _policy(time_scale: float = 1.0, bytes_scale: float = 0.01) -> SimPolicy:
    torch.manual_seed(0)
    toy = ToyPolicy(ToyModelSpec(grid=4, cell_px=8, d_model=16, layers=1, heads=2))
    sim = SimModelConfig(profile=HAND, time_scale=time_scale, bytes_scale=bytes_scale)
    return SimPolicy(toy, sim)


def test_a_rollout_call_lasts_images_times_the_profile_and_a_learner_call_pairs_times_it():
    pol = _policy(time_scale=2.0)  # calls of about 0.06 s
    cond = pol.tokenize(["one red dot on the left"] * 8)
    fn = pol.conditioned(cond)
    tokens = torch.full((8, 16), pol.mask_index)
    with torch.no_grad():
        pol.toy.conditioned(cond)(tokens)  # warm-up: torch's first call initialises kernels
        # 8 images, one unmasking step (a fresh function: a stream's first call)
        _timed(lambda: pol.conditioned(cond)(tokens), 8 * 0.004 * 2.0)
        assert fn(tokens).shape == (8, 16, pol.codebook_size)

    # gradient on: a learner pass over 8 (sample, unit) pairs, forward to the end of backward
    def learner_pass() -> None:
        fn(tokens).sum().backward()

    _timed(learner_pass, 8 * 0.003 * 2.0)
    assert pol.ballast.grad is not None and not pol.ballast.grad.any()  # all-reduced, zero
    # the values are the tiny model's own: the simulation adds time, never changes numbers
    with torch.no_grad():
        assert torch.equal(fn(tokens), pol.toy.conditioned(cond)(tokens))
    # 4 no-grad calls of 8 images, 2 learner passes of 8 pairs (charged unscaled)
    assert pol.clock.simulated_s == pytest.approx(4 * 8 * 0.004 + 2 * 8 * 0.003)


def test_a_learner_pass_is_held_at_the_end_of_its_backward():
    """The hold runs after every gradient of the tiny model exists (its node is the backward's
    last), so the backward's real compute lies inside the simulated time, not after it."""
    pol = _policy(time_scale=1.0)
    fn = pol.conditioned(pol.tokenize(["one red dot on the left"] * 4))
    seen: list[bool] = []
    hold = pol.clock.hold

    def spy(began: float, simulated_s: float) -> float:
        seen.append(all(p.grad is not None for p in pol.toy.parameters() if p.requires_grad))
        return hold(began, simulated_s)

    pol.clock.hold = spy  # type: ignore[method-assign]
    logits = fn(torch.full((4, 16), pol.mask_index))
    assert seen == []  # the forward alone charges nothing: its time is the pass's
    logits.logsumexp(-1).sum().backward()
    assert seen == [True]


def test_successive_rollout_calls_are_one_stream():
    """Host work between two calls of one logits function (the sampler's) is inside the next
    call's simulated time: each call's duration starts where the previous call's work ended,
    not where the call began."""
    pol = _policy(time_scale=1.0)
    fn = pol.conditioned(pol.tokenize(["one red dot on the left"] * 2))
    tokens = torch.full((2, 16), pol.mask_index)
    starts: list[float] = []
    ends: list[float] = []
    hold = pol.clock.hold

    def spy(began: float, simulated_s: float) -> float:
        starts.append(began)
        ends.append(hold(began, simulated_s))
        return ends[-1]

    pol.clock.hold = spy  # type: ignore[method-assign]
    with torch.no_grad():
        before = time.perf_counter()
        for _ in range(3):
            fn(tokens)
            time.sleep(0.002)  # host work between calls
    assert before <= starts[0] and starts[1:] == ends[:-1]
    assert all(b - a >= 2 * 0.004 - 1e-9 for a, b in zip(ends, ends[1:], strict=False))


def test_trained_bytes_and_images_follow_bytes_scale():
    for bs in (1e-3, 1e-2):
        pol = _policy(bytes_scale=bs)
        trained = sum(p.numel() * p.element_size() for p in pol.parameters() if p.requires_grad)
        assert abs(trained - HAND["weight_bytes"] * bs) <= 4  # one float32 of rounding
        side = image_side(pol.profile, bs, 4)
        assert side % 4 == 0 and abs(side - 512 * math.sqrt(bs)) <= 4 / 2 + 1e-9
        img = pol.decode_images(torch.zeros(2, 16, dtype=torch.long))
        assert img.shape == (2, side, side, 3) and img.dtype == torch.uint8


def test_a_weight_load_lasts_the_sync_time():
    pol = _policy(time_scale=1.0)
    state = {k: v.clone() for k, v in pol.state_dict().items()}
    _timed(lambda: pol.load_state_dict(state, strict=False), 40e6 / 400e6)  # bytes / bandwidth
    charged = pol.clock.simulated_s
    assert charged == pytest.approx(2 * 0.1)
    pol.load_state_dict({k: v for k, v in state.items() if k != "ballast"}, strict=False)
    assert pol.clock.simulated_s == charged  # not a weight sync: no simulated time


def test_sim_cost_reward_takes_its_time_and_scores_nothing():
    r = build_reward([("sim_cost", 0.0, {"seconds_per_image": 0.01, "time_scale": 2.0})])
    images = torch.zeros(5, 8, 8, 3, dtype=torch.uint8)
    _timed(lambda: r.score(images, ["a"] * 5), 5 * 0.01 * 2.0)
    total, parts = r.score(images, ["a"] * 5)
    assert not total.any() and not parts["sim_cost"].any()


def _sim_tree(**extra) -> dict:
    tree = yaml.safe_load(TOY.read_text())
    tree["model"] = {
        "kind": "sim",
        "toy": tree["model"]["toy"],  # the toy config's cached base model
        "args": {"profile": HAND, "time_scale": 1.0, "bytes_scale": 0.001},
    }
    tree["reward"]["components"] = [
        {"kind": "toy_rules", "weight": 1.0},
        {"kind": "sim_cost", "weight": 0.0},
    ]
    for k, v in extra.items():
        section, field = k.split("__")
        tree.setdefault(section, {})[field] = v
    return tree


def test_config_errors_name_the_sim_fields(tmp_path):
    bad = _sim_tree()
    bad["reward"]["components"] = [{"kind": "toy_rules", "weight": 1.0}]
    (tmp_path / "a.yaml").write_text(yaml.safe_dump(bad))
    with pytest.raises(ConfigError, match="sim_cost"):
        load_config(tmp_path / "a.yaml")
    with pytest.raises(ConfigError, match="not a built-in cost profile"):
        load_config(SIM, ["model.args.profile=showo_2048_h100"])
    with pytest.raises(ConfigError, match="time_scale"):
        load_config(SIM, ["model.args.time_scale=0"])
    cfg = load_config(SIM)
    w = workload_of(cfg)
    assert (w.prompts_per_step, w.samples_per_prompt, w.unmasking_steps) == (16, 6, 50)
    assert w.pairs_per_sample == 50


def test_a_local_step_takes_the_profiles_time(tmp_path, monkeypatch):
    """One process (the reference), B = 4 prompts of G = 2, S = 8 steps, every step trained,
    no filter: the collection lasts at least N S c_rollout + N c_reward and the update at least
    N S c_pair, at time_scale 1."""
    tree = _sim_tree(
        train__prompts_per_step=4,
        train__steps=2,
        train__unmasking_step_selection="all",
        filter__enabled=False,
        eval__every_steps=0,
        eval__samples_per_prompt=1,
    )
    tree["rollout"]["samples_per_prompt"] = 2
    (tmp_path / "sim.yaml").write_text(yaml.safe_dump(tree))
    run = tmp_path / "run"
    args = ["train", "--config", str(tmp_path / "sim.yaml"), "--backend", "local"]
    assert main([*args, "--run-dir", str(run), "--set", "logging.progress_bar=false"]) == 0
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    n, s = 8, 8
    assert len(rows) == 2
    assert min(r["time/generate_score"] for r in rows) >= n * s * 0.004 + n * 0.002
    assert min(r["time/update"] for r in rows) >= n * s * 0.003


def test_the_clock_holds_a_call_to_its_simulated_time_and_counts_overruns():
    from maskgrpo_ray.worlds.toy.sim import SimClock

    clock = SimClock(time_scale=0.5)
    began = time.perf_counter()
    clock.hold(began, 0.2)  # 0.1 s of wall time from `began`
    assert time.perf_counter() >= began + 0.1 and clock.slept_s > 0
    clock.hold(time.perf_counter() - 1.0, 0.2)  # the real work already took 1 s: no sleep
    assert clock.over_s == pytest.approx(0.9, abs=0.05)
    assert clock.simulated_s == pytest.approx(0.4)
