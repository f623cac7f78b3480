"""Issue 53's benches on made-up records whose answer is known: bench/why_seeds_fail.py (the
separation figure, AUC, and the per-run figures), the sweep's verdict and its noise
(bench/recipe_sweep.py), the alarms' calibration and the world's reference diversity."""

from __future__ import annotations

import math

import numpy as np
import torch

from bench import why_seeds_fail as w


def test_auc_orders_pairs_and_counts_ties_half():
    assert w.auc([3.0, 4.0], [1.0, 2.0]) == 1.0
    assert w.auc([1.0, 2.0], [3.0, 4.0]) == 0.0
    assert w.auc([1.0, 3.0], [2.0]) == 0.5
    assert w.auc([2.0], [2.0]) == 0.5
    assert math.isnan(w.auc([float("nan")], [1.0]))


def _record(slope: float, kl: float, gain: float) -> dict:
    rows = [
        {"step": float(s), "reward_mean": 20.0 + slope * s, "learning_rate": 1e-4 * min(s + 1, 5),
         "grad_norm": 1.0, "agreement/a_vs_b": 0.4 if s < 10 else 0.1}
        for s in range(60)
    ]  # fmt: skip
    for s in (0, 10, 20, 30):
        rows[s].update({"probe/kl": kl * s, "probe/z/diversity": -s / 10})
    base = {"eval_accuracy/tag_mean": 0.3, "eval_reward": 20.0, "eval_diversity/pairwise": 1.0}
    final = {"eval_accuracy/tag_mean": 0.3 + gain, "eval_reward": 21.0,
             "eval_diversity/pairwise": 0.9}  # fmt: skip
    return {"variant": "v", "seed": 0, "rows": rows, "base": base, "final": final}


def test_figures_read_the_first_steps_and_the_probe_at_or_before_them():
    f = w.figures(_record(0.5, 0.01, 0.1), by=20)
    assert math.isclose(f["reward/slope_per_step"], 0.5)
    assert f["update/learning_rate"] == 5e-4  # the peak, after warm-up
    assert math.isclose(f["probe/kl"], 0.2) and math.isclose(f["probe/z_diversity"], -2.0)
    assert math.isclose(f["reward/agreement_early"], 0.4)
    assert math.isclose(f["reward/agreement_fall_over_run"], 0.3)


def test_a_figure_that_tells_the_failed_runs_apart_has_auc_one():
    recs = [
        _record(0.1, kl, g) for kl, g in ((0.05, -0.1), (0.04, -0.05), (0.001, 0.1), (0.002, 0.2))
    ]
    a = w.analyse(recs, by=20)
    assert [r["failed"] for r in a["runs"]] == [True, True, False, False]
    sep = {s["figure"]: s for s in a["separation"]}
    assert sep["probe/kl"]["auc"] == 1.0 and sep["update/grad_norm"]["auc"] == 0.5
    assert a["separation"][0]["auc"] in (0.0, 1.0)  # the strongest first


def test_the_sweeps_gain_se_is_binomial_per_tag_by_hand():
    from bench import recipe_sweep as rs
    from maskgrpo_ray.worlds.shapes.scenes import EVAL_PER_TAG

    acc = {f"eval_accuracy/{t}": 0.5 for t in EVAL_PER_TAG}
    r = {"config": rs.CONFIG, "overrides": ["eval.samples_per_prompt=4"], "base": acc, "final": acc}
    var = sum(0.5 / (n * 4) for n in EVAL_PER_TAG.values())
    assert math.isclose(rs.gain_se(r), var**0.5 / len(EVAL_PER_TAG))
    assert math.isnan(rs.gain_se({**r, "final": {}}))


def test_alarm_calibration_counts_caught_and_false_alarms(monkeypatch):
    from bench import alarm_calibration as ac
    from maskgrpo_ray.runlog.probe_alarms import ProbeRules

    recs = [_record(0.1, 0.05, -0.2), _record(0.1, 0.05, -0.2), _record(0.1, 0.0, 0.2)]
    for i, r in enumerate(recs):
        r["seed"] = i
    # seed 0 (failed) alarmed at 10, seed 1 (failed) only at 50, seed 2 (healthy) at 30
    firsts = {0: {"judge_drop": 10}, 1: {"reward_drop": 50}, 2: {"probe_drift": 30}}
    monkeypatch.setattr(ac, "replay_alarms", lambda rows, rules, base: firsts[rows[0]["seed"]])
    monkeypatch.setattr(ac, "_probe_rows", lambda r: r["rows"])  # the fake reads the seed
    for i, r in enumerate(recs):
        r["rows"][0]["seed"] = i
    s = ac.score(recs, ProbeRules())
    assert (s["caught"], s["failed"], s["false"], s["healthy"]) == (1, 2, 1, 1)


def test_alarm_calibration_scores_the_front_on_seeds_it_was_not_chosen_on(monkeypatch):
    """--choose-seeds/--confirm-seeds: the front comes from the chosen runs alone; every row
    carries its score on the held-out runs, which can disagree with the chosen ones."""
    from bench import alarm_calibration as ac

    chosen = [_record(0.1, 0.05, -0.2), _record(0.1, 0.0, 0.2)]  # failed, healthy
    held = [_record(0.1, 0.0, 0.2), _record(0.1, 0.0, 0.2)]  # two healthy
    for i, r in enumerate([*chosen, *held]):
        r["seed"] = i
        r["rows"][0]["seed"] = i

    def replay(rows, rules, base):  # seed 0 alarms at any threshold; held-out 3 below judge 4
        s = rows[0]["seed"]
        return {"judge_drop": 10} if s == 0 or (s == 3 and rules.judge_drop_se < 4) else {}

    monkeypatch.setattr(ac, "replay_alarms", replay)
    monkeypatch.setattr(ac, "_probe_rows", lambda r: r["rows"])
    c = ac.calibrate(chosen, held)
    assert (c["today"]["caught"], c["today"]["false"]) == (1, 0)
    assert (c["today"]["confirm"]["healthy"], c["today"]["confirm"]["false"]) == (2, 1)
    assert all(g["caught"] == 1 and g["false"] == 0 for g in c["front"])
    for g in c["front"]:  # each row scored on the held-out runs by its own thresholds
        assert g["confirm"]["false"] == int(g["rules"]["judge_drop_se"] < 4)
    c["choose_seeds"], c["confirm_seeds"] = "0-1", "2-3"
    md = ac.markdown(c)
    assert "false, held out" in md and "seeds 2-3 (0 failed, 2 healthy)" in md
    assert "confirm" not in ac.calibrate(chosen)["today"]


def test_the_learned_reward_falls_only_beyond_its_noise_where_the_record_has_it():
    from bench import recipe_sweep as rs

    r = _record(0.1, 0.0, 0.2)
    r["final"]["eval_reward"] = 19.91  # -0.09
    assert "reward falls" in rs.per_run(r)["failed"]  # no se recorded: any fall
    r["base"]["eval_reward_se"], r["final"]["eval_reward_se"] = 0.03, 0.04
    v = rs.per_run(r)
    assert math.isclose(v["reward_se"], 0.05)
    assert "reward falls" not in v["failed"]  # -0.09 is under 2 se: inside the noise
    r["final"]["eval_reward"] = 19.89  # -0.11
    assert "reward falls" in rs.per_run(r)["failed"]


def test_a_record_is_named_by_the_variant_its_key_matches_today():
    """The default moved (issue 53): a run recorded as "default (shapes.yaml)" at lr 5e-4 is
    today's "lr 5e-4 (first default)", one at KL 0 today's "KL 0 (...)", one without the
    anchor "no anchor (default before)"; a run of today's default recorded under a lever's name
    is the default; one that no variant reproduces keeps its name."""
    from bench import paper_table as pt
    from bench import recipe_sweep as rs
    from bench import toy_lab as lab

    def key(over: list[str]) -> str:
        return lab.Job("x", tuple(over), 3, 60, config=rs.CONFIG, extra=tuple(pt.COMMON)).key()

    before = {"key": key([*rs.BEFORE, *rs.NO_ANCHOR]), "seed": 3, "steps": 60, "variant": "x"}
    assert rs.label(before) == "lr 5e-4 (first default)"
    no_kl = {"key": key(["train.kl_coef=0", *rs.NO_ANCHOR]), "seed": 3, "steps": 60, "variant": "y"}
    assert rs.label(no_kl) == "KL 0 (the paper's)"
    no_anchor = {"key": key(rs.NO_ANCHOR), "seed": 3, "steps": 60, "variant": rs.DEFAULT}
    assert rs.label(no_anchor) == "no anchor (default before)"
    anchored = ["train.anchor_unmasking_steps=4", "train.anchor_kl_coef=0.1"]
    now = {"key": key(anchored), "seed": 3, "steps": 60, "variant": "anchor first 4 steps, KL 0.1"}
    assert rs.label(now) == rs.DEFAULT
    larger = {"key": key(["train.learning_rate=3e-4"]), "seed": 3, "steps": 60, "variant": "z"}
    assert rs.label(larger) == "anchored, lr 3e-4"  # a lever on today's default: no NO_ANCHOR
    odd = {"key": key(["train.learning_rate=7e-4"]), "seed": 3, "steps": 60, "variant": "odd"}
    assert rs.label(odd) == "odd" and rs.label({"seed": 3, "variant": "v"}) == "v"


def test_each_rule_alone_and_the_base_entropy_filled_from_the_records_seed():
    from bench import alarm_calibration as ac

    runs = [
        {"failed": True, "alarms": {"kl_excess": 20, "judge_drop": 50}},
        {"failed": False, "alarms": {"judge_drop": 10}},
    ]
    a = ac.alone(runs)
    assert a["kl_excess"] == {"caught": 1, "false": 0}
    assert a["judge_drop"] == {"caught": 0, "false": 1}  # at 50: too late to count as caught
    assert ac.youden({"caught": 3, "failed": 4, "false": 1, "healthy": 4}) == 0.5
    r, other = _record(0.1, 0.0, 0.2), _record(0.1, 0.0, 0.2)
    r["seed"], other["seed"] = 3, 4
    for x in (r, other):
        x["rows"][0]["probe/se/reward"] = 0.1
    table = {"seeds": {"3": {"a": 0.2, "b": 0.21}}}
    assert ac.with_base_entropy([r, other], table) == 1  # seed 4 has no measurement
    assert r["rows"][0]["probe/entropy"] == 0.2 and "probe/entropy" not in other["rows"][0]
    r["rows"][0]["probe/entropy"] = 0.3  # a run that logged its own keeps it
    assert ac.with_base_entropy([r], table) == 0 and r["rows"][0]["probe/entropy"] == 0.3


def test_verdict_clarity_puts_each_run_in_its_class():
    """A clear failure is far below its base or its diversity (two of the diversity's noise under
    the 75% line); a borderline one fails the sweep's rule by less; a clear success gains at least
    one standard error and keeps two of the noise above the line."""
    from bench import alarm_calibration as ac

    def v(gain, reward=0.5, kept=0.9, failed=()):
        return {"gain": gain, "gain_se": 0.03, "reward_change": reward, "reward_se": 0.2,
                "diversity_kept": kept, "failed": list(failed)}  # fmt: skip

    sd = 0.05  # the lines: 0.75 * exp(-0.1) = 0.679 and 0.75 * exp(0.1) = 0.829
    assert ac.clarity(v(-0.07, failed=["below base"]), sd) == "clear failure"
    assert ac.clarity(v(0.1, reward=-0.5, failed=["reward falls"]), sd) == "clear failure"
    assert ac.clarity(v(0.1, kept=0.67, failed=["diversity"]), sd) == "clear failure"
    assert ac.clarity(v(0.1, kept=0.69, failed=["diversity"]), sd) == "borderline failure"
    assert ac.clarity(v(0.1, kept=0.69, failed=["diversity"]), 0.02) == "clear failure"
    assert ac.clarity(v(0.01), sd) == "borderline healthy"  # a gain under one standard error
    assert ac.clarity(v(0.1, kept=0.82), sd) == "borderline healthy"
    assert ac.clarity(v(0.1, kept=0.84), sd) == "clear healthy"
    assert ac.clarity(v(0.1, reward=-0.1), sd) == "borderline healthy"
    assert ac.clarity(v(0.1), sd) == "clear healthy"
    nan = float("nan")  # a record without the reward's standard error: its fall is never clear
    assert ac.clarity({**v(0.1, reward=-3.0, failed=["reward falls"]), "reward_se": nan}, sd) == (
        "borderline failure"
    )
    runs = [{"clarity": "clear failure", "alarms": {"judge_drop": 10}},
            {"clarity": "clear failure", "alarms": {"kl_excess": 50}},
            {"clarity": "clear healthy", "alarms": {}}]  # fmt: skip
    c = ac.by_clarity(runs)
    assert c["clear failure"] == {"runs": 2, "timely": 1, "any": 2}
    assert c["clear healthy"] == {"runs": 1, "timely": 0, "any": 0}
    assert c["borderline failure"]["runs"] == 0


def test_the_diversity_noise_is_the_spread_of_the_bases_two_probe_draws(monkeypatch):
    """sd(log(b / a)) over distinct bases, scaled to the evaluation's prompts; a base seen in
    several records counts once; under three bases there is no figure."""
    from bench import recipe_sweep as rs

    monkeypatch.setattr(rs, "_probe_over_eval", lambda config: 0.25)

    def rec(seed, a, b):
        return {
            "seed": seed,
            "rows": [{"step": 0, "probe/diversity": a, "probe/base_b/diversity": b}],
        }

    ratios = [1.1, 0.9, 1.0]
    recs = [rec(s, 0.2, 0.2 * q) for s, q in enumerate(ratios)]
    recs.append(rec(0, 0.2, 0.2 * 1.1))  # the same base again (another recipe on seed 0)
    recs.append({"seed": 9, "rows": [{"step": 0}]})  # recorded before the probe alarms
    sd, bases = rs.diversity_noise(recs)
    logs = [math.log(q) for q in ratios]
    mean = sum(logs) / 3
    assert bases == 3
    assert math.isclose(sd, (sum((x - mean) ** 2 for x in logs) / 3) ** 0.5 * 0.5)
    assert math.isnan(rs.diversity_noise(recs[:2])[0])
    assert rs.clearly_lost(0.71, 0.02) and not rs.clearly_lost(
        0.73, 0.02
    )  # line: 0.75 e^-0.04 = 0.72
    assert rs.clearly_lost(0.74, float("nan")) and not rs.clearly_lost(0.76, float("nan"))


def test_the_worlds_correct_scenes_are_judged_correct_and_measured_as_the_model_is():
    """The reference diversity draws correct scenes only (the judge passes every one) and is the
    mean pairwise layout distance per prompt: larger for counting (several free places) than for
    a one-colour prompt; no figure (NaN) for a prompt drawn once."""
    from bench import shapes_world as sw
    from maskgrpo_ray.worlds.shapes import judge, scenes
    from maskgrpo_ray.worlds.shapes.policy import WorldSpec

    w = WorldSpec()
    _, held = scenes.split_prompts()
    rng = np.random.default_rng(0)
    for q in held:
        objs = [scenes.sample_scene(q, w.grid, rng, w.patch_px) for _ in range(3)]
        imgs = torch.from_numpy(np.stack([scenes.render(o, w.grid, w.patch_px) for o in objs]))
        assert judge.judge(imgs, [q.metadata()] * 3, w.patch_px)["geneval"].min() == 1.0
    ref = sw.reference_diversity(w, list(held), 6)
    assert set(ref["tags"]) == {q.tag for q in held} and ref["samples"] == 6
    assert ref["tags"]["counting"] > ref["tags"]["colors"] > 0.0
    assert 0.0 < ref["pairwise_layout"] < 1.0
    assert math.isnan(sw.reference_diversity(w, list(held)[:2], 1)["pairwise_layout"])


def test_the_calibration_replays_the_probe_rows_alone_and_ranks_each_early_figure():
    """The grid replays a run's slimmed probe rows (step, ``probe/*``): the same first steps as
    the whole run's rows. ``separability``: per probe step, the chance that a failed run's
    figure is worse than a healthy run's; the KL counted in the base's entropy, turned so that
    lower is worse."""
    from bench import alarm_calibration as ac
    from maskgrpo_ray.runlog.probe_alarms import ProbeRules, replay_alarms

    def rec(gain: float, z_div: float, kl: float, seed: int) -> dict:
        r = _record(0.1, 0.0, gain)
        r["seed"] = seed
        base = {"probe/reward": 20.0, "probe/diversity": 1.0, "probe/entropy": 0.2,
                "probe/se/reward": 0.1, "probe/se/diversity": 0.05}  # fmt: skip
        r["rows"][0].update(base)
        for s in (10, 20, 30):
            r["rows"][s].update({"probe/reward": 20.0 - s / 100, "probe/kl": kl,
                                 "probe/diversity": 1.0 + 0.05 * z_div})  # fmt: skip
        return r

    runs = [rec(-0.2, -4.0, 0.5, 0), rec(-0.2, -1.0, 0.1, 1), rec(0.2, -2.0, 0.05, 2),
            rec(0.2, 0.0, 0.06, 3)]  # fmt: skip
    runs[1]["rows"][19]["eval_diversity/pairwise"] = 0.7  # the evaluation: 70% of the base's
    for r in runs:
        slim = ac._probe_rows(r)
        assert replay_alarms(slim, None, r["base"]) == replay_alarms(r["rows"], None, r["base"])
        assert all(set(x) <= {"step", ac.EVAL_DIV} | {k for k in x if k.startswith("probe/")}
                   for x in slim)  # fmt: skip
    assert (
        replay_alarms(ac._probe_rows(runs[1]), None, runs[1]["base"])["eval_diversity_loss"] == 19
    )
    only = ProbeRules(judge_drop_se=1e9, reward_drop_se=1e9, diversity_share=0, kl_share=1e9)
    caught = ac.score(runs, only)  # the evaluation's rule alone
    assert [x["alarms"] for x in caught["runs"]][:2] == [{}, {"eval_diversity_loss": 19}]
    sig = ac.early_signal(runs[0], 20)
    assert math.isclose(sig["diversity"], -4.0) and math.isclose(sig["kl"], -2.5)
    assert math.isclose(sig["reward"], -2.0)
    assert ac.early_signal(runs[0], 40) == {}  # no probe there
    sep = ac.separability(runs, (10, 30))
    # failed: seeds 0-1 (diversity -4, -1; KL 2.5, 0.5 of the entropy); healthy: 2-3
    assert sep["10"]["kl"] == 1.0  # every failed run further from its base than every healthy
    assert sep["10"]["diversity"] == 0.75  # -4 < -2, -4 < 0, -1 < 0; not -1 < -2
    assert sep["30"]["reward"] == 0.5  # the same fall on every run: no information
    # the in-run evaluation: the judge's gain, the reward's change, log(diversity kept)
    for r, g in zip(runs, (-0.1, 0.05, 0.1, 0.2), strict=True):
        r["curve"] = [{"step": 0, **r["base"]},
                      {"step": 20, **r["base"], "eval_accuracy/tag_mean": 0.3 + g,
                       "eval_diversity/pairwise": 0.5}]  # fmt: skip
    e = ac.eval_signal(runs[0], 20)
    assert math.isclose(e["eval judge"], -0.1) and e["eval reward"] == 0.0
    assert math.isclose(e["eval diversity"], math.log(0.5))
    assert ac.eval_signal(runs[0], 40) == {}
    sep = ac.separability(runs, (10,))
    assert sep["20"]["eval judge"] == 1.0 and sep["20"]["eval diversity"] == 0.5
    assert "eval judge" not in sep["10"] and set(sep) == {"10", "20", "40"}
    assert "| step | judge | reward |" in "\n".join(ac.separability_lines({"separability": sep}))
