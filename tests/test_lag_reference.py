"""The single process is the reference of the distributed run, synchronous and asynchronous.

Both backends draw a step's prompts from the same stream, cut them into the same chunks and
seed each chunk by (run seed, step, re-sample attempt, chunk index) in the group source, so
with the same weights they generate the same groups. With ``rollout.max_policy_lag`` 1 both
generate step k+1's groups with the weights before step k's update (Ray: in the background
while the learner trains; local: at once). The learners differ only in engine (DeepSpeed
ZeRO-0 vs a torch optimizer), so the trained weights agree to float32 round-off and the groups
(rewards, filter decisions, prompts) agree exactly as long as that round-off flips no sample.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tiny_runs import NO_GRIDS, RAY_SHARES, tiny_toy

from maskgrpo_ray.cli import main

SMALL = tiny_toy(
    4,
    4,
    "rollout.num_actors=2",  # two chunks of 2 prompts per call, on either backend
    NO_GRIDS,
    # the monitors over windows short enough for 4 steps (their figures must match too)
    "logging.monitors.probe_every_steps=2",
    "logging.monitors.window_steps=2",
    "logging.monitors.probe_window=2",
    "logging.monitors.baseline_steps=1",
    *RAY_SHARES,
)
MONITORED = ("image/", "probe/", "agreement/", "monitor/")
SAME_GROUPS = (  # what a step generated, decided and trained on: equal exactly
    "reward_mean",
    "accuracy",
    "groups_generated",
    "groups_dropped",
    "groups_invalid",
    "groups_trained",
    "prompts_trained",
    "policy_version",
    "policy_version_lag",
    "staleness/lag_mean",  # the staleness checks: the driver's, the same on either backend
    "staleness/lag_max",
    "staleness/samples_dropped",
    "filter_seen",
    "filter_dropped",
)
WEIGHT_ATOL = 1e-5  # float32 round-off of two optimizer implementations over 4 updates
# with GARDO and GDPO the runs move the weights less (up to 1e-3 here), and Adam turns the
# last-bit differences of near-zero gradients into full-size steps: the per-step gradient norms
# agree to 1e-6 (relative) and the final weights to 5e-5
DIVERSITY_WEIGHT_ATOL = 5e-5


# the diversity-aware, two-component rules: the driver's advantages from the reward actors'
# figures and parts (on Ray) equal the single process's. The figures are measured in `c`'s
# embedding, GARDO keeps its own space (the heaviest, `s`, first of the tie): the reward actors
# send diversity_train/* too, which the advantages read
DIVERSITY = (
    "reward.components=[{kind: toy_rules, args: {terms: score, name: s}}, "
    "{kind: toy_rules, args: {terms: correct, name: c}}]",
    "reward.diversity_embedding=c",
    "train.advantage=gdpo",
    "train.diversity.kind=gardo",
    "train.diversity.recentre=true",
)


def _run(tmp_path: Path, backend: str, lag: int, extra: tuple[str, ...] = ()) -> Path:
    run = tmp_path / f"{backend}-{lag}"
    args = ["train", "--backend", backend, "--run-dir", str(run)]
    for s in [*SMALL, f"rollout.max_policy_lag={lag}", *extra]:
        args += ["--set", s]
    assert main(args) == 0
    return run


def _rows(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    ("lag", "extra"),
    [
        (0, ()),
        pytest.param(1, (), marks=pytest.mark.ci),
        pytest.param(0, DIVERSITY, marks=pytest.mark.ci, id="0-gdpo-gardo"),
    ],
)
def test_ray_run_equals_the_local_run(tmp_path, monkeypatch, lag, extra):
    monkeypatch.setenv("MASKGRPO_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    local, ray_run = _run(tmp_path, "local", lag, extra), _run(tmp_path, "ray", lag, extra)
    a, b = _rows(local), _rows(ray_run)
    if extra:  # the first pass of every update reproduces the rollout's log-probs (ratio 1)
        assert all(r["ratio_mean"] == pytest.approx(1.0, abs=1e-6) for r in a + b)
        assert all("diversity/nn" in r for r in a + b)
        # both parts read the same cells: the two spaces agree here, exactly
        assert all(r["diversity_train/nn"] == r["diversity/nn"] for r in a + b)
        for ra, rb in zip(a, b):
            assert ra["grad_norm"] == pytest.approx(rb["grad_norm"], rel=1e-6)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [0, 1, 2, 3]
    for ra, rb in zip(a, b):
        for key in SAME_GROUPS:
            assert ra[key] == rb[key], (ra["step"], key, ra[key], rb[key])
        # the monitors (docs/monitors.md): image statistics from the reward actors, the probe,
        # the agreement, the rules and the probe's KL to the base (each rollout actor keeps a
        # frozen base), the same on both backends
        watched = {k for k in ra if k.startswith(MONITORED)}
        assert watched == {k for k in rb if k.startswith(MONITORED)}
        for key in watched:  # None: NaN both ways (e.g. no group to rank)
            want = None if rb[key] is None else pytest.approx(rb[key], rel=1e-6, abs=1e-9)
            assert ra[key] == want, (ra["step"], key, ra[key], rb[key])
    assert any("monitor/drift/dark" in r for r in a) and "probe/judge" in a[2]
    assert "probe/kl" in a[2] and "probe/kl" in b[2] and a[2]["probe/kl"] > 0
    if extra:
        assert all("agreement/s_vs_c" in r for r in a)
    # the on-policy check: at the same steps (lag 0) on both backends, the ratio 1 in both
    on = "onpolicy/first_ratio_max_abs_dev"
    assert [on in r for r in a] == [on in r for r in b] == [True] + [not lag] * 3
    assert all(r[on] < 1e-5 for r in a + b if on in r)
    # lag 1: every step after the first trains on rollouts one version behind
    assert [r["policy_version_lag"] for r in a] == ([0, 1, 1, 1] if lag else [0, 0, 0, 0])
    wa = load_file(str(local / "final_policy.safetensors"))
    wb = load_file(str(ray_run / "final_policy.safetensors"))
    assert wa.keys() == wb.keys()
    atol = DIVERSITY_WEIGHT_ATOL if extra else WEIGHT_ATOL
    worst, key_bias = _weight_gaps(wa, wb)
    assert worst <= atol, worst
    # 4 updates of Adam at lr 1e-3 move a weight by at most about 4e-3, round-off or not
    assert key_bias <= 4 * 1e-3, key_bias
    moved = max(float((wa[k] - w0).abs().max()) for k, w0 in _base(local).items())
    assert moved > (10 * atol if extra else 100 * atol)  # the runs trained: far above the tolerance


def _weight_gaps(wa: dict[str, torch.Tensor], wb: dict[str, torch.Tensor]) -> tuple[float, float]:
    """The largest difference between two final policies outside the attention's key biases,
    and inside them. A key bias adds the same ``q . b_k`` to every key of a query, which the
    softmax removes: its exact gradient is 0, so what it receives is round-off, and Adam scales
    that to steps of up to the learning rate. Those entries follow each run's round-off (1.5e-5
    apart here on 2026-11-27, where every other weight agreed to 1e-7), not its arithmetic."""
    worst, key_bias = 0.0, 0.0
    for k in wa:
        gap = (wa[k] - wb[k]).abs()
        if k.endswith("qkv.bias"):  # [3 d]: the query's, the key's, the value's biases
            d = gap.numel() // 3
            key_bias = max(key_bias, float(gap[d : 2 * d].max()))
            gap = torch.cat([gap[:d], gap[2 * d :]])
        worst = max(worst, float(gap.max()))
    return worst, key_bias


def _base(run: Path) -> dict[str, torch.Tensor]:
    """The base model's trained tensors (what the final policy is compared against)."""
    from maskgrpo_ray.config import load_config
    from maskgrpo_ray.pipeline.build import build_policy

    cfg = load_config("configs/toy.yaml", SMALL)
    policy = build_policy(cfg.model)
    names = load_file(str(run / "final_policy.safetensors")).keys()
    state = policy.state_dict()
    return {n: state[n] for n in names}


def test_local_lag_two_trains_two_versions_behind(tmp_path):
    """``max_policy_lag`` 2 in one process: steps k+1 and k+2 are submitted during step k's
    update and generated at once with the weights before it, so from the third step on every
    step trains on rollouts exactly two versions old; every prompt is trained at most once."""
    rows = _rows(_run(tmp_path, "local", 2))
    assert [r["policy_version_lag"] for r in rows] == [0, 1, 2, 2]
    assert [r["staleness/lag_max"] for r in rows] == [0, 1, 2, 2]
    assert [r["policy_version"] for r in rows] == [0, 1, 2, 3]
    trained = [p for r in rows for p in r["prompts_trained"]]
    assert len(trained) == len(set(trained)) > 0


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_ray_lag_two_never_waits_and_stays_within_two_versions(tmp_path, monkeypatch):
    """On Ray the rollouts of lag 2 run through the weight syncs (a chunk takes the version its
    actor holds when it starts): not reproducible bit for bit, but never more than two
    versions behind, and every prompt is trained at most once."""
    monkeypatch.setenv("MASKGRPO_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    rows = _rows(_run(tmp_path, "ray", 2))
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert all(0 <= r["policy_version_lag"] <= 2 for r in rows)
    # per chunk: the worst lag is the batch's, nothing dropped, the on-policy check at step 0
    assert all(r["staleness/lag_max"] == r["policy_version_lag"] for r in rows)
    assert all(r["staleness/samples_dropped"] == 0 for r in rows)
    assert rows[0]["onpolicy/first_ratio_max_abs_dev"] < 1e-5
    assert rows[0]["policy_version_lag"] == 0 and max(r["policy_version_lag"] for r in rows) >= 1
    trained = [p for r in rows for p in r["prompts_trained"]]
    assert len(trained) == len(set(trained)) > 0
