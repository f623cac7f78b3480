"""The step-signal probe and the ``auto`` selection (issue 39).

* the measurement's math against hand-computed Gram matrices and against the pairwise
  normalise-and-dot the bench used before it shared the library's code;
* ``auto``'s rule on a hand-made measurement, and the planner training what it chose;
* a run with the probe on the toy gives the figures ``bench/step_signal.py`` gives on the same
  weights and batches, and learns exactly the weights a run without it learns;
* a short run on Ray (two learner ranks: the gradients summed across ranks) measures what one
  process measures, and ``auto`` trains the steps it measured.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import logging
import math
import statistics
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tiny_runs import NO_GRIDS, RAY_SHARES, crash_at_step, tiny_toy

from maskgrpo_ray.algo.step_signal import (
    select_by_signal,
    shuffle_within_groups,
    signal_of_grams,
    top_by_excess,
)
from maskgrpo_ray.cli import main
from maskgrpo_ray.config import ConfigError, load_config
from maskgrpo_ray.loop.step_signal_probe import ProbeSpec, StepSignal
from maskgrpo_ray.pipeline.learner_core import UpdatePlanner
from maskgrpo_ray.pipeline.settings import settings_from_config

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------ the measurement's math


def test_signal_of_grams_by_hand():
    # step 0: g1 = g2 = (1, 0), g3 = (0, 1): pair cosines 1, 0, 0 -> mean 1/3. Jackknife: leave
    # out batch 1 -> the pair (2, 3): 0; batch 2 -> (1, 3): 0; batch 3 -> (1, 2): 1; their mean
    # 1/3, deviations -1/3, -1/3, 2/3, var = (K-1)/K sum dev^2 = 2/3 x 6/9 = 4/9 -> se 2/3
    # (= 2(K-1)/(K-2) x sd(per-batch means 1/2, 1/2, 0) / sqrt(3) = 4 x 1/6); norms 1, 1, 1.
    # step 1: (2, 0), (0, 3), (0, 0): a zero gradient has cosine 0 with everything (the eps of
    # torch's normalize), the others are orthogonal: cos 0, se 0; norms 2, 3, 0 -> 5/3.
    v0 = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
    v1 = torch.tensor([[2.0, 0.0], [0.0, 3.0], [0.0, 0.0]])
    grams = torch.stack([v0 @ v0.T, v1 @ v1.T]).double()
    out = signal_of_grams(grams)
    assert out["cos"] == pytest.approx([1 / 3, 0.0], abs=1e-12)
    assert out["cos_se"] == pytest.approx([2 / 3, 0.0], abs=1e-12)
    assert out["norm"] == pytest.approx([1.0, 5 / 3], abs=1e-12)
    with pytest.raises(ValueError, match="K >= 3"):
        signal_of_grams(grams[:, :2, :2])


def test_signal_of_grams_equals_the_pairwise_cosines():
    """Loop against vectorised: the bench's former normalise-then-dot over every pair, and the
    jackknife over batches computed by leaving each batch out, on random gradients."""
    g = torch.Generator().manual_seed(0)
    vecs = torch.randn(5, 6, 40, generator=g, dtype=torch.float64)  # [S, K, P]
    vecs[2, 1] = 0.0  # a zero gradient
    out = signal_of_grams(vecs @ vecs.transpose(1, 2))
    for t in range(5):
        v = torch.nn.functional.normalize(vecs[t], dim=-1)
        pairs = {(i, j): float(v[i] @ v[j]) for i, j in itertools.combinations(range(6), 2)}
        left = [statistics.fmean(c for ij, c in pairs.items() if i not in ij) for i in range(6)]
        jack = math.sqrt(5 / 6 * sum((u - statistics.fmean(left)) ** 2 for u in left))
        assert out["cos"][t] == pytest.approx(statistics.fmean(pairs.values()), abs=1e-12)
        assert out["cos_se"][t] == pytest.approx(jack, abs=1e-12)
        assert out["norm"][t] == pytest.approx(float(vecs[t].norm(dim=-1).mean()), abs=1e-12)


def test_shuffle_is_a_permutation_within_each_group():
    adv = torch.arange(12, dtype=torch.float32)  # 3 groups of 4
    out = shuffle_within_groups(adv, 4, torch.Generator().manual_seed(3))
    for b in range(3):
        assert sorted(out[4 * b : 4 * b + 4].tolist()) == adv[4 * b : 4 * b + 4].tolist()
    g = torch.Generator().manual_seed(3)  # one randperm per group, in order
    want = torch.cat([adv[4 * b : 4 * b + 4][torch.randperm(4, generator=g)] for b in range(3)])
    assert torch.equal(out, want)


# ------------------------------------------------------------------ auto's rule

# a hand-made measurement: floor 0 +- 0.05 everywhere, se 0.05: spread sqrt(2) 0.05 = 0.0707,
# so at margin 2 a step passes above 0.1414: steps 2 (0.6), 3 (0.3) and 4 (0.2)
HAND = StepSignal(
    cos=[0.05, 0.0, 0.6, 0.3, 0.2],
    cos_se=[0.05] * 5,
    floor=[0.0] * 5,
    floor_se=[0.05] * 5,
    norm=[1.0] * 5,
    norm_floor=[1.0] * 5,
)
NOISE = StepSignal(
    [0.01, 0.03, -0.02, 0.0, 0.02], [0.05] * 5, [0.0] * 5, [0.05] * 5, [1.0] * 5, [1.0] * 5
)


def test_auto_rule_on_a_hand_made_measurement():
    args = HAND.cos, HAND.cos_se, HAND.floor, HAND.floor_se
    assert select_by_signal(*args, cap=5, margin=2.0) == [2, 3, 4]
    assert select_by_signal(*args, cap=2, margin=2.0) == [2, 3]  # the two standing highest
    assert select_by_signal(*args, cap=5, margin=0.0) == [0, 2, 3, 4]  # above the floor at all
    assert select_by_signal(*args, cap=5, margin=5.0) == [2]  # 0.6 > 5 x 0.0707 only
    assert HAND.passing(2.0) == [2, 3, 4]
    n = NOISE.cos, NOISE.cos_se, NOISE.floor, NOISE.floor_se
    assert select_by_signal(*n, cap=2, margin=2.0) == []
    assert top_by_excess(NOISE.cos, NOISE.floor, 2) == [1, 4]


def _planner(cap: int = 2) -> UpdatePlanner:
    sets = [
        "rollout.unmasking_steps=5",
        "train.unmasking_step_selection=auto",
        f"train.unmasking_steps_trained={cap}",
        "train.step_signal_every_steps=4",
    ]
    return UpdatePlanner(settings_from_config(load_config(ROOT / "configs/toy.yaml", sets)).update)


def test_the_planner_trains_what_the_probe_measured(caplog):
    p = _planner(cap=2)
    with caplog.at_level(logging.WARNING):
        assert p.plan(0).train_steps.tolist() == [0, 1, 2, 3, 4]  # no measurement yet: all
    assert "no measurement yet" in caplog.text
    assert p.observe(HAND) == [2, 3]
    assert p.plan(1).train_steps.tolist() == [2, 3]
    # a later probe that finds nothing above the floor keeps the last selection
    assert p.observe(NOISE) == [2, 3] and p.plan(2).train_steps.tolist() == [2, 3]
    # the state a checkpoint keeps carries the selection
    q = _planner(cap=2)
    q.load_state(p.state())
    assert q.plan(3).train_steps.tolist() == [2, 3]
    # the first probe finding nothing: the cap steps standing highest, with a WARNING
    r = _planner(cap=2)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert r.observe(NOISE) == [1, 4]
    assert "first probe" in caplog.text
    # a planner whose selection is not auto ignores probes
    other = UpdatePlanner(settings_from_config(load_config(ROOT / "configs/toy.yaml")).update)
    assert other.observe(HAND) is None and other.state().dtype == torch.uint8


@pytest.mark.parametrize(
    ("sets", "match"),
    [
        (
            ["train.unmasking_step_selection=auto", "train.unmasking_steps_trained=2"],
            "train.unmasking_step_selection='auto' with train.step_signal_every_steps=0",
        ),
        (
            [
                "train.unmasking_step_selection=auto",
                "train.unmasking_steps_trained=2",
                "train.step_signal_every_steps=5",
                "likelihood.estimator=forward",
            ],
            "likelihood.estimator='forward'",
        ),
        (
            ["train.step_signal_every_steps=5", "likelihood.estimator=forward"],
            "train.step_signal_every_steps=5 with likelihood.estimator='forward'",
        ),
        (
            ["train.step_signal_every_steps=5", "learner.zero_stage=2"],
            "learner.zero_stage=2",
        ),
        (["train.step_signal_every_steps=5", "train.step_signal_batches=2"], "step_signal_batches"),
    ],
)
def test_probe_and_auto_mistakes_end_in_one_line(sets, match):
    with pytest.raises(ConfigError, match=match):
        load_config(ROOT / "configs/toy.yaml", ["train.unmasking_step_selection=all", *sets])


# ------------------------------------------------------------------ runs

SMALL = tiny_toy(
    None,
    4,
    "rollout.num_actors=2",
    "train.unmasking_step_selection=all",
    "train.unmasking_steps_trained=0",
    "eval.every_steps=0",
    NO_GRIDS,
    *RAY_SHARES,
    "train.step_signal_batches=3",
    "train.step_signal_prompts_per_batch=2",
)


def _bench():
    spec = importlib.util.spec_from_file_location(
        "step_signal_bench", ROOT / "bench/step_signal.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _train(run: Path, backend: str, sets: list[str]) -> list[dict]:
    args = ["train", "--backend", backend, "--run-dir", str(run)]
    for s in [*SMALL, *sets]:
        args += ["--set", s]
    assert main(args) == 0
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def _row_signal(row: dict) -> StepSignal:
    def get(name: str) -> list[float]:
        keys = sorted(k for k in row if k.startswith(f"step_signal/{name}/"))
        return [row[k] for k in keys]

    return StepSignal(
        *(get(n) for n in ("cos", "cos_se", "floor", "floor_se", "norm", "norm_floor"))
    )


# the run's probe and the bench run the same functions on the same tensors in one process, so
# they agree to the last bit here; the tolerance only absorbs a different thread count
SAME_PROCESS_ATOL = 1e-6


@pytest.mark.slow
@pytest.mark.ci
def test_probe_matches_the_bench_and_changes_nothing_learned(tmp_path):
    """A toy run probing every 2 steps: its probe of step 2 equals bench/step_signal.py on the
    step-2 checkpoint with that probe's batches; the run's final weights equal a run without
    the probe (the probe has its own RNG streams); the plot and the summary are written."""
    probe = ["train.steps=3", "train.step_signal_every_steps=2", "run.checkpoint_every_steps=2"]
    rows = _train(tmp_path / "probe", "local", probe)
    _train(tmp_path / "plain", "local", ["train.steps=3", "run.checkpoint_every_steps=2"])
    a = load_file(str(tmp_path / "probe/final_policy.safetensors"))
    b = load_file(str(tmp_path / "plain/final_policy.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert [r["step"] for r in rows if "step_signal/cos/0" in r] == [0, 2]
    bench = _bench()
    cfg = load_config(tmp_path / "probe/config.json")
    policy = bench.policy_of(cfg, tmp_path / "probe/checkpoints/step_000002")
    got = bench.measure(cfg, policy, ProbeSpec.of_run(cfg.run.seed, 2, 3, 2))
    want = _row_signal(rows[2])
    for name in ("cos", "cos_se", "floor", "floor_se", "norm", "norm_floor"):
        assert getattr(got, name) == pytest.approx(getattr(want, name), abs=SAME_PROCESS_ATOL)
    summary = json.loads((tmp_path / "probe/summary.json").read_text())
    assert summary["step_signal"]["last_probe_step"] == 2
    assert summary["step_signal"]["cos"] == pytest.approx(want.cos)
    assert (tmp_path / "probe/step_signal.png").stat().st_size > 0


# two ranks sum their shards' gradients (all_reduce) where one process sums all pairs: the
# same terms in another order, float32; the cosines move in the 7th digit (1e-4 is generous)
RANKS_ATOL = 1e-4


@pytest.mark.slow
@pytest.mark.ci
def test_probe_and_auto_on_ray(tmp_path):
    """On Ray (the rollout actors generate the probe batches, two learner ranks measure them):
    the probe of step 0 equals the bench's on the base weights, and auto trains the steps its
    measurement selects (select_by_signal on the logged figures, or its announced fallback)."""
    sets = [
        "train.steps=2",
        "learner.num_workers=2",
        "train.step_signal_every_steps=1",
        "train.unmasking_step_selection=auto",
        "train.unmasking_steps_trained=2",
    ]
    rows = _train(tmp_path / "ray", "ray", sets)
    cfg = load_config(tmp_path / "ray/config.json")
    bench = _bench()
    from maskgrpo_ray.pipeline.build import build_policy

    got = bench.measure(
        cfg, build_policy(cfg.model).eval(), ProbeSpec.of_run(cfg.run.seed, 0, 3, 2)
    )
    want = _row_signal(rows[0])
    for name in ("cos", "cos_se", "floor", "floor_se", "norm", "norm_floor"):
        assert getattr(got, name) == pytest.approx(getattr(want, name), abs=RANKS_ATOL)
    # the selection each step trained is the rule's on that step's logged measurement (a fresh
    # planner fed the same figures in order: its fallbacks included)
    planner = UpdatePlanner(settings_from_config(cfg).update)
    for row in rows:
        assert row["auto_steps"] == planner.observe(_row_signal(row))
        assert 1 <= len(row["auto_steps"]) <= 2 and row["auto_steps_trained"] == len(
            row["auto_steps"]
        )


@pytest.mark.slow
def test_auto_resumes_with_its_selection(tmp_path, monkeypatch):
    """auto's selection is in the checkpoint: a run cut after the step-2 checkpoint (its
    selection from the probe of step 0; the next probe at step 3) resumes to the weights and
    selections of the uninterrupted run."""
    from maskgrpo_ray.checkpoints.run_store import latest_checkpoint

    sets = [
        "train.steps=5",
        "train.step_signal_every_steps=3",
        "train.unmasking_step_selection=auto",
        "train.unmasking_steps_trained=2",
        "run.checkpoint_every_steps=2",
    ]
    full = _train(tmp_path / "full", "local", sets)
    with crash_at_step(monkeypatch, 3), pytest.raises(KeyboardInterrupt):
        _train(tmp_path / "cut", "local", sets)
    assert latest_checkpoint(tmp_path / "cut").name == "step_000002"
    assert main(["train", "--resume", str(tmp_path / "cut")]) == 0
    cut = [json.loads(x) for x in (tmp_path / "cut/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in cut] == [0, 1, 2, 3, 4]
    assert [r.get("auto_steps") for r in cut] == [r.get("auto_steps") for r in full]
    a = load_file(str(tmp_path / "full/final_policy.safetensors"))
    b = load_file(str(tmp_path / "cut/final_policy.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
