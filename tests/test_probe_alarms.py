"""The probe alarms (docs/monitors.md, "Alarms that see collapse"): every probe against the
base's, in the base's own standard errors (``maskgrpo_ray.runlog.probe_alarms``)."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from maskgrpo_ray.runlog.monitors import image_statistics
from maskgrpo_ray.runlog.probe_alarms import (
    EVAL_ALARMS,
    EVAL_KEPT,
    IMAGE,
    PROBE_ALARMS,
    ProbeRules,
    base_figures,
    eval_alarm_flags,
    probe_alarm_flags,
    probe_rule_flags,
    probe_z,
    replay_alarms,
)

P, S = 8, 12  # the shapes world's probe: 8 prompts x 12 samples


def _draw(rng: random.Random, reward: float, judge: float, div: float) -> dict[str, list[float]]:
    """A made-up probe's per-prompt means: each prompt its own level plus sampling noise (the
    spread of a mean of S samples)."""
    out: dict[str, list[float]] = {"reward": [], "judge": [], "diversity": []}
    for p in range(P):
        out["reward"].append(reward + 0.3 * (p % 4) + rng.gauss(0, 1.0 / math.sqrt(S)))
        out["judge"].append(min(1.0, max(0.0, judge + rng.gauss(0, 0.45 / math.sqrt(S)))))
        out["diversity"].append(div + 0.02 * (p % 3) + rng.gauss(0, 0.05 / math.sqrt(S)))
    return out


def _series(levels: list[tuple[float, float, float]], seed: int = 0) -> list[dict]:
    """Rows of a made-up run: the base's two draws at step 0, then a probe every 10 steps at
    the given (reward, judge, diversity) levels, with training rows between."""
    rng = random.Random(seed)
    rows = [{"step": 0, **base_figures(_draw(rng, *levels[0]), _draw(rng, *levels[0]), S)}]
    for i, lv in enumerate(levels[1:], start=1):
        for s in range(10 * (i - 1) + 1, 10 * i):
            rows.append({"step": s, "reward_mean": 0.0})
        probe = _draw(rng, *lv)
        rows.append({"step": 10 * i, **base_figures(probe, {}, S)})
    return rows


def test_the_base_calibrates_itself_from_two_draws():
    rng = random.Random(1)
    a, b = _draw(rng, 20.0, 0.3, 0.4), _draw(rng, 20.0, 0.3, 0.4)
    base = base_figures(a, b, S)
    d = [x - y for x, y in zip(a["reward"], b["reward"], strict=True)]
    m = sum(d) / P
    sd = math.sqrt(sum((x - m) ** 2 for x in d) / (P - 1))
    assert base["probe/se/reward"] == pytest.approx(sd / math.sqrt(P))
    assert base["probe/reward"] == pytest.approx(sum(a["reward"]) / P)
    # two identical draws leave the figure's resolution as the unit, not zero
    same = base_figures({"judge": [0.5] * P}, {"judge": [0.5] * P}, S)
    assert same["probe/se/judge"] == pytest.approx(1.0 / (P * S))
    # one draw: no unit, no alarm can be scored against it
    assert not any(k.startswith("probe/se/") for k in base_figures(a, {}, S))


def test_reward_and_diversity_falling_trip_their_alarms():
    falling = _series([(20.0, 0.3, 0.40), (19.6, 0.3, 0.33), (19.0, 0.3, 0.25), (18.5, 0.3, 0.2)])
    first = replay_alarms(falling)
    assert first["reward_drop"] is not None and first["reward_drop"] <= 30, first
    assert first["diversity_loss"] is not None and first["diversity_loss"] <= 30, first
    assert first["judge_drop"] is None  # the judge held


def test_a_healthy_series_trips_none_on_many_seeds():
    # the reward and the judge rise, the diversity keeps 85% of the base's
    for seed in range(30):
        healthy = _series(
            [(20.0, 0.3, 0.40), (20.3, 0.33, 0.38), (20.6, 0.36, 0.36), (20.8, 0.4, 0.35)], seed
        )
        assert all(v is None for v in replay_alarms(healthy).values()), seed


def test_the_judge_falling_trips_judge_drop_and_replay_agrees_with_the_live_rule():
    rows = _series([(20.0, 0.4, 0.4), (20.5, 0.3, 0.4), (21.0, 0.1, 0.4), (21.0, 0.1, 0.4)], 3)
    first = replay_alarms(rows)  # below at 20 and 30: two probes in a row (persist_probes 2)
    assert first["judge_drop"] == 30, first
    assert replay_alarms(rows, ProbeRules(persist_probes=1))["judge_drop"] == 20
    # the live rule (row by row, as the driver's monitor) gives the same flags
    history: list[dict] = []
    for r in rows:
        r = {**r, **probe_alarm_flags(history, r, ProbeRules())}
        history.append(r)
    live = [r["step"] for r in history if r.get("monitor/alarm/judge_drop") == 1.0]
    assert live[0] == first["judge_drop"]
    # a looser threshold moves it later or removes it: replay answers without rerunning
    assert replay_alarms(rows, ProbeRules(judge_drop_se=1e6))["judge_drop"] is None


def test_persistence_needs_consecutive_probes():
    rows = _series([(20.0, 0.3, 0.4), (18.0, 0.3, 0.4), (20.0, 0.3, 0.4), (18.0, 0.3, 0.4)])
    assert replay_alarms(rows, ProbeRules(persist_probes=1))["reward_drop"] == 10
    assert replay_alarms(rows, ProbeRules(persist_probes=2))["reward_drop"] is None
    assert ProbeRules().persist_probes == 2  # the default: a one-probe dip does not trip


def _kl_rows(kl: float, entropy0: float = 0.23) -> list[dict]:
    rows = _series([(20.0, 0.3, 0.4), (20.0, 0.3, 0.4)])
    rows[0].update({"probe/kl": 0.0, "probe/entropy": entropy0})
    rows[-1]["probe/kl"] = kl
    return rows


def test_kl_excess_measures_the_kl_in_the_bases_own_entropy():
    h0, once = 0.23, ProbeRules(persist_probes=1)  # the rule at one probe
    share = once.kl_share
    assert replay_alarms(_kl_rows(1.05 * share * h0, h0), once)["kl_excess"] == 10
    assert replay_alarms(_kl_rows(0.95 * share * h0, h0), once)["kl_excess"] is None
    # the same KL against a base four times as uncertain is a quarter of the move: no alarm
    assert replay_alarms(_kl_rows(1.05 * share * h0, 4 * h0), once)["kl_excess"] is None
    # a run logged without the base's entropy (or without the KL) has no such rule
    rows = _kl_rows(10.0)
    del rows[0]["probe/entropy"]
    assert replay_alarms(rows, once)["kl_excess"] is None
    assert "kl_excess" not in probe_rule_flags(
        {"probe/kl": 10.0}, {"probe/entropy": 0.0}, ProbeRules()
    )


def test_probe_divergence_is_no_kl_and_the_rollouts_own_entropy_at_the_base():
    """At the base the KL is 0 and the entropy per token is the rollout's own negative
    log-likelihood per token (its old log-probs, the learner's likelihood being exact)."""
    import os

    from tiny_runs import TOY_G3

    from maskgrpo_ray.config import load_config
    from maskgrpo_ray.evaluation.generation import probe_divergence
    from maskgrpo_ray.pipeline.build import build_policy
    from maskgrpo_ray.pipeline.phases import generate

    toy = os.path.join(os.path.dirname(__file__), "..", "configs", "toy.yaml")
    policy = build_policy(load_config(toy, TOY_G3).model).eval()
    prompts = ["two red dots on the left", "one blue dot on the top"]
    rb = generate(policy, prompts, [0, 1], group_size=3, num_steps=4, temperature=1.0,
                  gumbel_temperature=0.0, guidance_scale=0.0, transition="p1",
                  policy_version=0, generator=torch.Generator().manual_seed(5))  # fmt: skip
    out = probe_divergence(policy, policy, rb)
    assert out["kl"].shape == out["entropy"].shape == (6,)
    assert torch.allclose(out["kl"], torch.zeros(6), atol=1e-6)
    own = -rb.old_logp.double().sum(-1) / rb.final_tokens.shape[1]
    assert torch.allclose(out["entropy"].double(), own, atol=1e-4)
    assert bool((out["entropy"] > 0).all())


# --------------------------------------------------------------------------- shapes renders


def _renders(seed: int, prompts: list, grid: int = 8, patch_px: int = 4) -> torch.Tensor:
    from maskgrpo_ray.worlds.shapes import scenes

    rng = np.random.default_rng(seed)
    out = [
        scenes.render(scenes.sample_scene(p, grid, rng, patch_px), grid, patch_px)
        for p in prompts
        for _ in range(S)
    ]
    return torch.from_numpy(np.stack(out))


def _image_draw(images: torch.Tensor) -> dict[str, list[float]]:
    """Per-prompt means of the image statistics and the judge's malformed share (what a probe
    summarises per prompt: ``evaluation.generation.summarize`` with one tag per prompt)."""
    from maskgrpo_ray.worlds.shapes.rewards import ShapesJudgeReward

    stats = image_statistics(images)
    stats["image/malformed"] = ShapesJudgeReward().malformed_share(images)
    out = {}
    for name in IMAGE:
        v = stats[f"image/{name}"].view(P, S)
        out[name] = [float(row[torch.isfinite(row)].mean()) for row in v]
    return out


def _blobs(images: torch.Tensor) -> torch.Tensor:
    """Each object smeared into a blob: every 4x4 patch (a token) filled with its most
    saturated pixel's colour, the shapes' outlines lost."""
    n, h, w, _ = images.shape
    x = (
        images.view(n, h // 4, 4, w // 4, 4, 3)
        .permute(0, 1, 3, 2, 4, 5)
        .reshape(n, h // 4, w // 4, 16, 3)
    )
    chroma = x.amax(-1).int() - x.amin(-1).int()
    pick = chroma.argmax(-1)  # [n, gh, gw]
    colour = torch.gather(x, 3, pick[..., None, None].expand(-1, -1, -1, 1, 3)).squeeze(3)
    return colour.repeat_interleave(4, 1).repeat_interleave(4, 2).contiguous()


def test_shapes_renders_swapped_for_black_or_blobs_trip_drift_and_fresh_renders_do_not():
    from maskgrpo_ray.worlds.shapes import scenes

    held_out = scenes.split_prompts(0)[1]
    prompts = list(held_out[:: max(1, len(held_out) // P)][:P])
    assert len(prompts) == P
    base = {"step": 0, "probe/reward": 1.0}
    base.update(
        base_figures(_image_draw(_renders(1, prompts)), _image_draw(_renders(2, prompts)), S)
    )
    rules = ProbeRules()

    def drift(images: torch.Tensor) -> dict[str, float]:
        row = {"probe/reward": 1.0, **base_figures(_image_draw(images), {}, S)}
        row.update(probe_z(row, base))
        return row

    fresh = drift(_renders(3, prompts))
    assert probe_rule_flags(fresh, base, rules)["probe_drift"] == 0.0, fresh
    black = drift(torch.zeros_like(_renders(3, prompts)))
    assert probe_rule_flags(black, base, rules)["probe_drift"] == 1.0, black
    blobs = drift(_blobs(_renders(3, prompts)))
    assert probe_rule_flags(blobs, base, rules)["probe_drift"] == 1.0, blobs


def test_every_probe_alarm_is_an_alarm_the_summary_counts():
    from maskgrpo_ray.runlog.monitors import ALARMS

    assert set(PROBE_ALARMS) <= set(ALARMS) and set(EVAL_ALARMS) <= set(ALARMS)


def test_the_evaluations_diversity_under_its_share_of_the_bases_trips_eval_diversity_loss():
    """The in-run evaluation's rule: its pairwise diversity against the base evaluation's, a
    plain share (the evaluation's 40 x 12 samples leave it little noise); off at share 0, silent
    where there is no evaluation or no base; the replay finds the first evaluation under it."""
    key, alarm = "eval_diversity/pairwise", "monitor/alarm/eval_diversity_loss"
    base, rules = {key: 0.20}, ProbeRules(eval_diversity_share=0.85)
    kept = eval_alarm_flags({"step": 19, key: 0.18}, base, rules)
    assert kept[EVAL_KEPT] == pytest.approx(0.9) and kept[alarm] == 0.0
    lost = eval_alarm_flags({"step": 39, key: 0.16}, base, rules)
    assert lost[EVAL_KEPT] == pytest.approx(0.8) and lost[alarm] == 1.0
    assert (
        eval_alarm_flags({"step": 39, key: 0.16}, base, ProbeRules(eval_diversity_share=0))[alarm]
        == 0.0
    )
    assert eval_alarm_flags({"step": 5, "reward_mean": 1.0}, base, rules) == {}  # no evaluation
    assert eval_alarm_flags({"step": 39, key: 0.16}, {}, rules) == {}  # no base
    rows = [{"step": s, "reward_mean": 0.0} for s in range(60)]
    rows[19][key], rows[39][key], rows[59][key] = 0.19, 0.15, 0.12
    assert replay_alarms(rows, rules, base)["eval_diversity_loss"] == 39
    assert replay_alarms(rows, rules)["eval_diversity_loss"] is None  # no base: not replayed


# --------------------------------------------------------------------------- a tiny run


def test_a_tiny_run_logs_the_probe_figures_and_its_kl(tmp_path, caplog):
    """The probe's figures land in metrics.jsonl (the base's two draws at step 0, a probe at
    step 2 and 4), the KL to the base is 0 at the base and positive once the policy moved,
    and replaying the rows gives what the run flagged."""
    import json

    from tiny_runs import NO_GRIDS, tiny_toy, train_argv

    from maskgrpo_ray.cli import main

    run = tmp_path / "run"
    over = tiny_toy(
        5,
        3,
        NO_GRIDS,
        "eval.samples_per_prompt=3",
        "train.learning_rate=0.01",
        "logging.monitors.probe_every_steps=2",
        "logging.monitors.probe_prompts=8",
        "eval.every_steps=2",
        "run.export_final_policy=false",
    )
    assert main(train_argv(run, over)) == 0
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [
        r for r in rows if "eval_diversity/pairwise" in r
    ]  # steps 1 and 3: the rule reads them
    assert [r["step"] for r in evals] == [1, 3] and all(EVAL_KEPT in r for r in evals)
    base, later = rows[0], [r for r in rows if r["step"] in (2, 4)]
    for key in ("reward", "kl", "entropy", "colour_entropy", "dark"):
        assert math.isfinite(base[f"probe/{key}"]), key
    assert base["probe/kl"] == pytest.approx(0.0, abs=1e-5)  # the policy is its base
    assert base["probe/entropy"] > 0 and base["probe/se/entropy"] > 0
    assert math.isfinite(base["probe/se/reward"]) and base["probe/se/reward"] > 0
    assert "probe/base_b/reward" in base and "probe/se/reward" not in later[0]
    assert all(r["probe/kl"] > 1e-4 for r in later), [r["probe/kl"] for r in later]
    assert all("probe/z/reward" in r for r in later)
    flagged = {
        name: next((r["step"] for r in rows if r.get(f"monitor/alarm/{name}") == 1.0), None)
        for name in (*PROBE_ALARMS, *EVAL_ALARMS)
    }
    summary = json.loads((run / "summary.json").read_text())
    assert replay_alarms(rows, ProbeRules(), summary["base_eval"]) == flagged
    assert set(PROBE_ALARMS) <= set(summary["monitors"]["alarms"])
    # the probe's KL and its second draw change nothing of what the run learns
    plain = tmp_path / "plain"
    assert main(train_argv(plain, [*over, "logging.monitors.probe_kl=false"])) == 0
    again = [json.loads(x) for x in (plain / "metrics.jsonl").read_text().splitlines()]
    assert "probe/kl" not in again[0] and "probe/entropy" not in again[0]
    assert [r["reward_mean"] for r in again] == [r["reward_mean"] for r in rows]


def test_stop_on_names_an_alarm():
    from maskgrpo_ray.config import Config

    with pytest.raises(ValueError, match="stop_on names .*not an alarm"):
        Config.model_validate({"logging": {"monitors": {"stop_on": ["judge_dorp"]}}})
    Config.model_validate({"logging": {"monitors": {"stop_on": ["judge_drop", "drift"]}}})
    no_eval = {"eval": {"every_steps": 0}, "logging": {"monitors": {"stop_on": EVAL_ALARMS}}}
    with pytest.raises(ValueError, match="eval_diversity_loss.*eval.every_steps=0"):
        Config.model_validate(no_eval)
    Config.model_validate({**no_eval, "eval": {"every_steps": 10}})


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_shapes_worlds_learned_reward_trips_no_probe_alarm_in_a_short_healthy_run(tmp_path):
    """The honest control: the shapes world's learned reward is not its judge (the toy's rule
    reward is), so its probe has its own noise; a short run at a small learning rate, whose
    policy barely moves, must trip no probe alarm (the base calibrated itself)."""
    import json

    from tiny_runs import NO_GRIDS, QUIET, train_argv

    from maskgrpo_ray.cli import main

    run = tmp_path / "shapes"
    over = [
        "train.steps=5",
        "train.prompts_per_step=4",
        "train.learning_rate=1e-5",
        "eval.every_steps=0",
        "eval.samples_per_prompt=6",
        "logging.monitors.probe_every_steps=2",
        "run.export_final_policy=false",
        NO_GRIDS,
        QUIET,
    ]
    argv = train_argv(run, over)
    argv[1:1] = ["--config", "configs/shapes.yaml"]
    assert main(argv) == 0
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert "probe/se/reward" in rows[0] and "probe/malformed" in rows[0]
    assert [r["step"] for r in rows if "probe/z/reward" in r] == [0, 2, 4]
    assert all(v is None for v in replay_alarms(rows).values()), [
        {k: r[k] for k in r if k.startswith("probe/z/")} for r in rows if "probe/z/reward" in r
    ]


# --------------------------------------------------------------------------- diagnostics


def test_group_figures_by_hand():
    from maskgrpo_ray.algo.grpo import group_advantages
    from maskgrpo_ray.pipeline.diagnostics import group_figures

    r = torch.tensor([1.0, 1.001, 0.999, 0.0, 2.0, 4.0])
    a = group_advantages(r, 3)
    got = group_figures(r, a, 3)
    assert got["groups/near_zero_std_share"] == 0.5
    assert got["groups/near_zero_abs_adv"] == pytest.approx(float(a[:3].abs().mean()))
    assert got["groups/near_zero_abs_adv"] > 0.5  # Eq. 12 blows the near-constant group up
    assert got["adv/abs_max"] == pytest.approx(float(a.abs().max()))


def test_diagnostics_measure_without_changing_the_run(tmp_path):
    """logging.diagnostics logs the update's size over the learning rate and the two
    half-batches' gradient cosine; the run learns exactly what it learns without them."""
    import json

    from tiny_runs import NO_GRIDS, tiny_toy, train_argv

    from maskgrpo_ray.cli import main

    base = tiny_toy(
        3, 4, NO_GRIDS, "logging.monitors.enabled=false", "run.export_final_policy=false"
    )
    rows = {}
    for name, extra in (("on", ["logging.diagnostics=true"]), ("off", [])):
        assert main(train_argv(tmp_path / name, [*base, *extra])) == 0
        text = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        rows[name] = [json.loads(x) for x in text]
    on, off = rows["on"], rows["off"]
    assert [r["reward_mean"] for r in on] == [r["reward_mean"] for r in off]
    assert [r["loss"] for r in on] == [r["loss"] for r in off]
    for r in on:
        assert -1.0 <= r["diag/grad_half_cosine"] <= 1.0
        assert r["diag/update_over_lr"] > 0
        assert "groups/near_zero_std_share" in r
    assert "diag/update_over_lr" not in off[0]


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (["train.kl_coef=0.04", "model.toy.pretrain_steps=0"], "train.kl_coef=0.04"),
        (["logging.monitors.stop_on=[judge_drop]", "logging.monitors.probe_prompts=0"], "stop_on"),
        (["logging.monitors.stop_on=[drift]", "logging.monitors.enabled=false"], "stop_on"),
        (["logging.monitors.stop_on=[kl_excess]", "logging.monitors.probe_kl=false"], "probe_kl"),
    ],
)
def test_a_lever_combination_that_cannot_work_is_refused_in_one_line(overrides, field):
    from maskgrpo_ray.config import load_config

    with pytest.raises(ValueError, match=field) as err:
        load_config("configs/toy.yaml", overrides)
    assert len([line for line in str(err.value).splitlines() if field in line]) == 1
