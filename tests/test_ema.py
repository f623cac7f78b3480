"""``train.ema_decay``: the weights' moving average (Flow-GRPO's EMA) that evaluation and the
exported policy use, while rollouts and updates keep the live weights.

The arithmetic and the swap are checked on a small module against a hand computation; the
executor's evaluation against the same evaluation of a policy that holds the EMA as its live
weights; whole toy runs for what the run keeps (training unchanged, the export and the
checkpoint's EMA, a resume that continues it bit for bit); the refusal of ZeRO-3; and (slow)
the Ray backend against the local one with the EMA on.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tiny_runs import NO_GRIDS, crash_at_step, tiny_toy, train_argv

from maskgrpo_ray.cli import main
from maskgrpo_ray.config import ConfigError, load_config
from maskgrpo_ray.pipeline.ema import ParameterEma, ema_decay_at, swapped_in

DECAY = 0.3  # under the warm-up's (1 + n) / (10 + n) at n = 1, 2, the cap from n = 3 on


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """One toy base for the module's runs (pre-trained once, in seconds)."""
    return tmp_path_factory.mktemp("cache")


def _module() -> torch.nn.Module:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    m[1].bias.requires_grad_(False)  # frozen: no shadow, never touched
    return m


# ------------------------------------------------------------------ the arithmetic


def test_decay_follows_flow_grpos_warm_up():
    # d_n = min(d, (1 + n) / (10 + n)): 2/11 at n = 1; (1 + n) / (10 + n) = 0.3 at n = 20/7,
    # so n = 2 still takes the warm-up (3/12) and n = 3 the cap (4/13 > 0.3)
    assert ema_decay_at(DECAY, 1) == pytest.approx(2 / 11)
    assert ema_decay_at(DECAY, 2) == pytest.approx(0.25)
    assert ema_decay_at(DECAY, 3) == DECAY
    # Flow-GRPO's 0.9 is reached at n = 80 ((1 + 80) / 90 = 0.9) and held after
    assert ema_decay_at(0.9, 79) == pytest.approx(80 / 89) and ema_decay_at(0.9, 79) < 0.9
    assert ema_decay_at(0.9, 80) == pytest.approx(0.9) and ema_decay_at(0.9, 500) == 0.9


def test_updates_match_a_hand_computation_in_float64():
    m = _module()
    trained = {n: p for n, p in m.named_parameters() if p.requires_grad}
    assert set(trained) == {"0.weight", "0.bias", "1.weight"}  # the frozen bias has no shadow
    ema = ParameterEma(m, DECAY)
    assert set(ema.shadow) == set(trained)
    want = {n: p.detach().double().clone() for n, p in trained.items()}  # e_0 = theta_0
    frozen = m[1].bias.detach().clone()
    g = torch.Generator().manual_seed(1)
    for n in range(1, 6):
        with torch.no_grad():  # an "optimizer step": every trained tensor moves
            for p in trained.values():
                p.add_(torch.randn(p.shape, generator=g))
        out = ema.update(m)
        d = min(DECAY, (1 + n) / (10 + n))
        sq = 0.0
        for name, p in trained.items():
            want[name] = d * want[name] + (1 - d) * p.detach().double()
            sq += float((want[name] - p.detach().double()).square().sum())
        assert out["ema/decay"] == pytest.approx(d, abs=0)
        assert out["ema/distance"] == pytest.approx(math.sqrt(sq), rel=1e-6)
        for name, s in ema.shadow.items():
            torch.testing.assert_close(s.double(), want[name], rtol=0, atol=1e-6)
    assert ema.updates == 5
    assert torch.equal(m[1].bias, frozen)


def test_swap_in_holds_the_ema_and_gives_the_live_weights_back_exactly():
    m = _module()
    ema = ParameterEma(m, 0.9)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.5)
    ema.update(m)
    live = {n: p.detach().clone() for n, p in m.named_parameters()}
    with ema.applied(m):
        for n, p in m.named_parameters():
            want = ema.shadow[n] if n in ema.shadow else live[n]
            assert torch.equal(p.detach(), want), n
            assert not torch.equal(p.detach(), live[n]) or n not in ema.shadow
    assert all(torch.equal(p, live[n]) for n, p in m.named_parameters())
    # an error inside the block: the live weights are back all the same
    with pytest.raises(RuntimeError, match="inside"), ema.applied(m):
        raise RuntimeError("inside")
    assert all(torch.equal(p, live[n]) for n, p in m.named_parameters())
    with pytest.raises(KeyError, match="unknown"), swapped_in(m, {"nope": torch.zeros(1)}):
        pass


def test_state_round_trip_and_a_checkpoint_without_one(caplog):
    m = _module()
    ema = ParameterEma(m, DECAY)
    for _ in range(3):
        with torch.no_grad():
            m[0].weight.mul_(1.5)
        ema.update(m)
    other = ParameterEma(_module(), DECAY)
    other.load_state_dict(ema.state_dict())
    assert other.updates == 3
    assert all(torch.equal(other.shadow[n], s) for n, s in ema.shadow.items())
    # a checkpoint with no EMA: it starts again from the loaded weights, and says so
    with caplog.at_level(logging.WARNING, logger="maskgrpo_ray.pipeline.ema"):
        other.resume(m, None, "ckpt")
    assert "holds no EMA" in caplog.text
    assert other.updates == 0
    assert all(
        torch.equal(other.shadow[n], p.detach())
        for n, p in m.named_parameters()
        if n in other.shadow
    )
    with pytest.raises(ValueError, match="differ"):
        ParameterEma(torch.nn.Linear(3, 4), DECAY).load_state_dict(ema.state_dict())


# ------------------------------------------------------------------ the refusal


def test_ema_with_zero_3_is_refused_in_one_line_naming_the_fix():
    with pytest.raises(ConfigError) as err:
        load_config("configs/toy.yaml", ["train.ema_decay=0.9", "learner.zero_stage=3"])
    msg = str(err.value)
    assert "train.ema_decay=0.9" in msg and "learner.zero_stage=3" in msg
    assert "zero_stage 0-2" in msg and "ema_decay 0" in msg
    rule = [line for line in msg.splitlines() if "train.ema_decay" in line]
    assert len(rule) == 1
    for ok in (["train.ema_decay=0.9", "learner.zero_stage=2"], ["learner.zero_stage=3"]):
        load_config("configs/toy.yaml", ok)
    with pytest.raises(ConfigError, match="train.ema_decay"):
        load_config("configs/toy.yaml", ["train.ema_decay=1.0"])


# ------------------------------------------------------------------ the executor


def test_evaluation_is_the_emas_and_leaves_the_live_weights(cache, monkeypatch):
    """The executor's evaluation, grid and export with the EMA on equal those of a policy whose
    live weights are the EMA; they differ from the live policy's; the live weights come back
    exactly. With ``ema_decay`` 0 there is no EMA: evaluation is the live policy's."""
    from maskgrpo_ray.loop.local import LocalExecutor
    from maskgrpo_ray.pipeline.build import build_policy, build_reward_from_settings
    from maskgrpo_ray.pipeline.settings import settings_from_config
    from maskgrpo_ray.prompts.loading import load_prompts

    monkeypatch.setenv("MASKGRPO_CACHE_DIR", str(cache))
    cfg = load_config("configs/toy.yaml", tiny_toy(1, 2, "train.ema_decay=0.9"))
    prompts = load_prompts("toy", "eval")[:6]
    reward = build_reward_from_settings(settings_from_config(cfg).reward)
    ex = LocalExecutor(cfg, build_policy(cfg.model), reward, None)
    g = torch.Generator().manual_seed(3)
    for _ in range(3):  # three "optimizer steps" far from the base, each followed by the EMA's
        with torch.no_grad():
            for p in ex.policy.parameters():
                if p.requires_grad:
                    p.add_(0.3 * torch.randn(p.shape, generator=g))
        ex.ema.update(ex.policy)
    live = {n: p.detach().clone() for n, p in ex.policy.named_parameters()}
    with_ema, images = ex.evaluate(prompts), ex.eval_images(prompts[:2])
    assert all(torch.equal(p, live[n]) for n, p in ex.policy.named_parameters())
    exported = ex.policy_state()
    assert all(torch.equal(exported[n], ex.ema.shadow[n]) for n in exported)

    ema, ex.ema = ex.ema, None  # decay 0: no EMA, the live weights throughout
    live_eval = ex.evaluate(prompts)
    assert all(torch.equal(v, live[n]) for n, v in ex.policy_state().items())
    assert live_eval["eval_reward"] != with_ema["eval_reward"]
    with swapped_in(ex.policy, ema.shadow):  # the EMA as live weights: the same figures
        assert ex.evaluate(prompts) == pytest.approx(with_ema, nan_ok=True, rel=0, abs=0)
        assert torch.equal(ex.eval_images(prompts[:2]), images)


# ------------------------------------------------------------------ whole runs


RUN = tiny_toy(4, 3, NO_GRIDS, "run.checkpoint_every_steps=2")
TRAINING = ("reward_mean", "accuracy", "loss", "grad_norm", "groups_trained", "prompts_trained")


def _rows(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def _trained(run: Path, step: int) -> tuple[dict[str, torch.Tensor], dict]:
    """(the live trained tensors, the EMA state) of the run's checkpoint at ``step``."""
    folder = run / "checkpoints" / f"step_{step:06d}"
    ema = torch.load(folder / "ema.pt", weights_only=True)
    policy = torch.load(folder / "policy.pt", weights_only=True)
    return {n: policy[n] for n in ema["shadow"]}, ema


@pytest.fixture(scope="module")
def runs(tmp_path_factory, cache):
    """Three local toy runs of 4 steps: EMA off, on, and on but cut at step 3 (checkpoint at 2,
    written by the asynchronous snapshot) and resumed."""
    root = tmp_path_factory.mktemp("ema_runs")
    mp = pytest.MonkeyPatch()
    mp.setenv("MASKGRPO_CACHE_DIR", str(cache))
    try:
        on = (*RUN, f"train.ema_decay={DECAY}")
        assert main(train_argv(root / "off", RUN)) == 0
        assert main(train_argv(root / "on", on)) == 0
        cut = (*on, "run.checkpoint_async=true")
        with crash_at_step(mp, 3), pytest.raises(KeyboardInterrupt):
            main(train_argv(root / "cut", cut))
        assert main(["train", "--resume", str(root / "cut")]) == 0
    finally:
        mp.undo()
    return root


def test_training_is_unchanged_and_the_export_is_the_ema(runs):
    off, on = _rows(runs / "off"), _rows(runs / "on")
    for a, b in zip(off, on, strict=True):  # rollouts and updates keep the live weights
        for key in TRAINING:
            assert a[key] == b[key], (a["step"], key)
        assert "ema/distance" not in a and b["ema/distance"] > 0
        # one optimizer step per update: the n-th update's decay, n = the step's version + 1
        n = b["policy_version"] + 1  # the version the step's rollouts were made with
        assert b["ema/decay"] == pytest.approx(ema_decay_at(DECAY, n), abs=0)
    live, ema = _trained(runs / "on", 4)
    assert ema["updates"] == on[-1]["policy_version"] + 1 == 4
    # the run's last live weights are the EMA-off run's final policy, bit for bit
    final_off = load_file(str(runs / "off" / "final_policy.safetensors"))
    assert final_off.keys() == live.keys()
    assert all(torch.equal(final_off[n], live[n]) for n in live)
    # the exported policy is the EMA; the last row's distance is ||EMA - live||
    final_on = load_file(str(runs / "on" / "final_policy.safetensors"))
    assert all(torch.equal(final_on[n], ema["shadow"][n]) for n in live)
    gap = math.sqrt(sum(float((ema["shadow"][n] - live[n]).double().square().sum()) for n in live))
    assert on[-1]["ema/distance"] == pytest.approx(gap, rel=1e-6)
    # evaluation: the base (step 0, the EMA is the base) the same, the final the EMA's
    s_off, s_on = (json.loads((runs / r / "summary.json").read_text()) for r in ("off", "on"))
    assert s_on["base_eval"] == pytest.approx(s_off["base_eval"], nan_ok=True, rel=0, abs=0)
    assert s_on["final_eval"]["eval_reward"] != s_off["final_eval"]["eval_reward"]


def test_a_resumed_run_continues_the_same_ema(runs):
    live_a, ema_a = _trained(runs / "on", 4)
    live_b, ema_b = _trained(runs / "cut", 4)
    assert ema_b["updates"] == ema_a["updates"] == 4
    for n in live_a:
        assert torch.equal(ema_a["shadow"][n], ema_b["shadow"][n]), n
        assert torch.equal(live_a[n], live_b[n]), n
    a, b = _rows(runs / "on"), _rows(runs / "cut")
    assert [r["ema/distance"] for r in a] == [r["ema/distance"] for r in b]
    fa = load_file(str(runs / "on" / "final_policy.safetensors"))
    fb = load_file(str(runs / "cut" / "final_policy.safetensors"))
    assert all(torch.equal(fa[n], fb[n]) for n in fa)


# ------------------------------------------------------------------ Ray against local


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_ray_evaluates_the_same_ema_as_local(tmp_path, monkeypatch):
    """Lag 1: the next step's rollouts run on the rollout actors while the driver evaluates,
    so a rollout that saw the EMA would change the groups; the evaluation rows (held-out every
    2 steps, the monitor probe, base and final) and the exported EMA match the local run's."""
    monkeypatch.setenv("MASKGRPO_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    from test_lag_reference import SMALL, WEIGHT_ATOL, _weight_gaps

    small = [*SMALL, "rollout.max_policy_lag=1", "eval.every_steps=2", f"train.ema_decay={DECAY}"]
    local, ray_run = tmp_path / "local", tmp_path / "ray"
    assert main(train_argv(local, small)) == 0
    assert main(train_argv(ray_run, small, backend="ray")) == 0
    a, b = _rows(local), _rows(ray_run)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [0, 1, 2, 3]
    evaluated = 0
    for ra, rb in zip(a, b, strict=True):
        for key in TRAINING[:2] + ("groups_trained", "prompts_trained", "policy_version"):
            assert ra[key] == rb[key], (ra["step"], key)
        assert ra["ema/distance"] == pytest.approx(rb["ema/distance"], rel=1e-3)
        # the probe's KL is the local run's only (its frozen base; test_lag_reference)
        watched = {k for k in ra if k.startswith(("eval_", "probe/")) and not k.endswith("/kl")}
        assert watched <= set(rb), sorted(watched - set(rb))
        for key in watched:
            want = None if rb[key] is None else pytest.approx(rb[key], rel=1e-6, abs=1e-9)
            assert ra[key] == want, (ra["step"], key)
        evaluated += any(k.startswith("eval_") for k in ra)
    assert evaluated == 1  # step 1 (step 3 is the last: the final evaluation)
    s_a, s_b = (json.loads((r / "summary.json").read_text()) for r in (local, ray_run))
    for part in ("base_eval", "final_eval"):
        assert s_a[part] == pytest.approx(s_b[part], nan_ok=True, rel=1e-6, abs=1e-9)
    wa = load_file(str(local / "final_policy.safetensors"))
    wb = load_file(str(ray_run / "final_policy.safetensors"))
    assert wa.keys() == wb.keys()
    worst, key_bias = _weight_gaps(wa, wb)  # the EMA mixes the live weights: the same bounds
    assert worst <= WEIGHT_ATOL and key_bias <= 4e-3, (worst, key_bias)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_ray_resume_continues_learner_rank_0s_ema(tmp_path, monkeypatch):
    """The Ray checkpoint keeps rank 0's EMA (``learner/ema.pt``, from the asynchronous
    snapshot); a run cut at step 3 and resumed from step 2 ends with the uninterrupted run's."""
    from tiny_runs import ONE_OF_EACH

    monkeypatch.setenv("MASKGRPO_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    on = [*RUN, *ONE_OF_EACH, f"train.ema_decay={DECAY}", "run.checkpoint_async=true"]
    full, cut = tmp_path / "full", tmp_path / "cut"
    assert main(train_argv(full, on, backend="ray")) == 0
    with crash_at_step(monkeypatch, 3), pytest.raises(KeyboardInterrupt):
        main(train_argv(cut, on, backend="ray"))
    assert main(["train", "--resume", str(cut)]) == 0

    def ema(run: Path) -> dict:
        path = run / "checkpoints" / "step_000004" / "learner" / "ema.pt"
        return torch.load(path, weights_only=True)

    a, b = ema(full), ema(cut)
    assert a["updates"] == b["updates"] == 4
    for n, s in a["shadow"].items():  # DeepSpeed's restored optimizer: round-off at most
        torch.testing.assert_close(b["shadow"][n], s, rtol=0, atol=1e-6)
    ra, rb = _rows(full), _rows(cut)
    assert [r["ema/distance"] for r in ra] == pytest.approx([r["ema/distance"] for r in rb])
    fa = load_file(str(full / "final_policy.safetensors"))
    assert all(torch.equal(fa[n], a["shadow"][n]) for n in fa)  # the export is the EMA
