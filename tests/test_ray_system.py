"""The Ray actor-learner system on a real local cluster (no local mode).

One module-scoped cluster bound to loopback; one executor (2 rollout actors, 1 reward actor,
the filter actor and a DeepSpeed learner of world size 2 on gloo) shared by the tests in
order. Waits are ``ray.get(..., timeout=...)``, never sleeps.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import ray
import torch

from maskgrpo_ray.config import Config, load_config
from maskgrpo_ray.loop import driver
from maskgrpo_ray.loop.collect import seeded_chunks
from maskgrpo_ray.pipeline.data_plane import Traffic, fetch_rollout
from maskgrpo_ray.pipeline.phases import make_train_batch
from maskgrpo_ray.prompts.loading import PromptStream, load_prompts

TOY = os.path.join(os.path.dirname(__file__), "..", "configs", "toy.yaml")
SMALL = [
    "train.steps=2",
    "train.prompts_per_step=4",
    "rollout.unmasking_steps=4",
    "eval.samples_per_prompt=1",
    "rollout.num_actors=2",
    "reward.num_actors=1",
    "learner.num_workers=2",
    "rollout.num_cpus_per_actor=0.25",
    "reward.num_cpus_per_actor=0.25",
    "learner.num_cpus_per_worker=0.25",
    "logging.progress_bar=false",
    "logging.sample_grid_every_steps=1",
    "filter.warmup_groups=4",
]


def chunks_of(ex, prompts, positions, step=0):
    """A step's chunks as the group source cuts and seeds them (the same seeds every call)."""
    return seeded_chunks(prompts, positions, ex.chunk_prompts, ex.run_seed, step)


def small_cfg(*extra: str) -> Config:
    return load_config(TOY, [*SMALL, *extra])


@pytest.fixture(scope="module")
def executor(ray_cluster):
    from maskgrpo_ray.backend.ray_executor import RayExecutor

    ex = RayExecutor(small_cfg(), timeout_s=300)
    yield ex
    ex.shutdown()


def rollout_versions(ex) -> dict[int, tuple[int, float]]:
    refs = {i: ex.fleet.rollout_handle(i).status.remote() for i in ex.fleet.rollout_actor_ids()}
    out = {i: ray.get(r, timeout=60) for i, r in refs.items()}
    return {i: (s["version"], s["weights_checksum"]) for i, s in out.items()}


def learner_digest(ex) -> list[float]:
    return [sum(float(t.double().sum()) for t in s.values()) for s in ex.learner.all_ranks_state()]


@pytest.mark.slow
@pytest.mark.ci
@pytest.mark.timeout(900)
def test_end_to_end_toy_run(executor, tmp_path):
    """A 2-step run: ranks identical after each step, rollouts of step k+1 carry version k,
    rollout replicas hold the learner's weights, metrics.jsonl complete, outputs written."""
    ex, cfg = executor, small_cfg()
    train_prompts = load_prompts("toy", "train")
    eval_prompts = load_prompts("toy", "eval")[:4]
    seen: list[tuple[int, dict]] = []

    def on_step_end(step, row):
        ex.on_step_end(step, row)
        ranks = learner_digest(ex)
        assert ranks[0] == ranks[1], "learner ranks diverged"
        versions = rollout_versions(ex)
        for version, total in versions.values():
            assert version == step + 1  # synced after the update of step `step`
            assert total == pytest.approx(ranks[0], rel=1e-6, abs=1e-6)
        seen.append((step, row))

    stream = PromptStream(train_prompts, cfg.run.seed, cfg.data.shuffle)
    summary = driver.train(cfg, ex, tmp_path, stream, eval_prompts, on_step_end=on_step_end)
    assert [s for s, _ in seen] == [0, 1]
    for step, row in seen:
        assert row["policy_version"] == step  # generated with version k at step k
        assert row["policy_version_lag"] == 0
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    need = {
        "reward_mean",
        "groups_generated",
        "groups_trained",
        "loss",
        "weight_sync_seconds",
        "weight_sync_bytes",
        "time/generate_score",
        "time/filter",
        "time/update",
        "time/sync",
        "samples_per_second",
        "filter_drop_rate",
        "chunks_reissued",
        "learner_world_size",
        "rollout_actors",
    }
    for r in rows:
        assert need <= set(r), need - set(r)
        assert r["groups_generated"] >= cfg.train.prompts_per_step
        assert r["learner_world_size"] == 2 and r["rollout_actors"] == 2
        assert r["weight_sync_bytes"] > 0
    assert summary["policy_version"] == 2 and summary["backend"] == "ray"
    assert (tmp_path / "summary.json").exists() and (tmp_path / "reward_curve.png").exists()
    assert sorted(p.name for p in (tmp_path / "samples").iterdir()) == [
        "step_000000.png",
        "step_000001.png",
    ]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_killed_rollout_actor_chunk_reissued_exactly_once(executor):
    """An actor dies in the middle of a step: its chunk goes to another actor with the same
    seed, every prompt is generated once (same samples as a run without the crash), and the
    update trains on each prompt's group exactly once."""
    ex = executor
    prompts = load_prompts("toy", "train")[:8]
    positions = list(range(100, 108))
    version = ex.policy_version
    clean = ex.generate_and_score(chunks_of(ex, prompts, positions), Traffic())
    before = ex.counters["chunks_reissued"]
    victim = ex.fleet.rollout_actor_ids()[0]
    ray.kill(ex.fleet.rollout_handle(victim), no_restart=True)  # dies before its next chunk
    crashed = ex.generate_and_score(chunks_of(ex, prompts, positions), Traffic())
    assert ex.counters["chunks_reissued"] == before + 1
    assert victim not in ex.fleet.rollout_actor_ids()
    assert len(ex.fleet.rollout_actor_ids()) == 2  # healed: a replacement took the victim's place
    assert crashed.rollout.prompt_indices == positions  # each prompt once, in order
    assert torch.equal(
        fetch_rollout(crashed.rollout).final_tokens, fetch_rollout(clean.rollout).final_tokens
    )
    assert torch.equal(crashed.rewards, clean.rewards)
    keep = torch.ones(len(prompts), dtype=torch.bool)
    tb = make_train_batch(crashed, keep, 1e-4)
    assert tb.num_samples == len(prompts) * crashed.rollout.group_size
    ex.update(tb)
    ex.sync_weights()
    assert ex.policy_version == version + 1
    # an actor added between steps receives the current weights and takes work
    new_id = ex.fleet.add_rollout_actor()
    assert rollout_versions(ex)[new_id][0] == ex.policy_version
    for actor_id in [i for i in ex.fleet.rollout_actor_ids() if i != new_id]:
        ex.fleet.remove_rollout_actor(actor_id)
    assert ex.fleet.rollout_actor_ids() == [new_id]
    out = ex.generate_and_score(chunks_of(ex, prompts[:2], [200, 201]), Traffic())
    assert out.rollout.policy_version == ex.policy_version
    ex.fleet.scale_rollout(2)
    assert len(ex.fleet.rollout_actor_ids()) == 2


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_check_prompt_and_filter_state(executor):
    ex = executor
    # one batched call answers every prompt: None for a readable one, else the reason
    ok, bad = ex.check_prompts(["one red dot on the left", "a photo of a cat"])
    assert ok is None
    assert "toy model reads" in bad
    before = ex.filter_state()
    # every valid group the filter decides on is counted and enters the (4096-long) history
    assert before["filter"]["seen"] == len(before["filter"]["history"])
    # Three groups of G = 2 straight to the filter actor: stds (unbiased) sqrt(0.5) for (0, 1)
    # and 0 for (0.5, 0.5); the NaN group is invalid, neither decided nor recorded. So `seen`
    # grows by exactly 2, whatever earlier tests of this module sent.
    rewards = torch.tensor([0.0, 1.0, 0.5, 0.5, float("nan"), 1.0])
    res = ray.get(ex.filters.actor.filter.remote(rewards, 2), timeout=60)
    assert res.invalid.tolist() == [False, False, True] and not res.keep[2]
    state = ray.get(ex.filters.actor.state_dict.remote(), timeout=60)  # the actor's, not the copy's
    f0, f1 = before["filter"], state["filter"]
    assert f1["seen"] == f0["seen"] + 2
    assert f1["history"][-2:] == pytest.approx([0.5**0.5, 0.0], abs=1e-7)
    assert f1["dropped"] == f0["dropped"] + int((~res.keep[:2]).sum())
    assert (state["batches"], state["groups_kept"]) == (
        before["batches"] + 1,
        before["groups_kept"] + int(res.keep.sum()),
    )
    # the round trip restores: back to `before`, then forward to `state`
    ex.load_filter_state(before)
    assert ex.filter_state() == before
    ex.load_filter_state(state)
    assert ex.filter_state() == state
    # the driver's copy (what a restarted filter actor gets), fed the same groups, is the
    # actor's state, and its figures are the actor's
    from types import SimpleNamespace

    from maskgrpo_ray.pipeline.data_plane import Traffic

    ex.filter(SimpleNamespace(rewards=rewards, rollout=SimpleNamespace(group_size=2)), Traffic())
    assert ray.get(ex.filters.actor.state_dict.remote(), timeout=60) == ex.filter_state()
    assert ex.filter_stats() == ray.get(ex.filters.actor.stats.remote(), timeout=60)


def _listening(pids: set[int]) -> list[tuple[str, int, int]]:
    import psutil

    out = []
    for c in psutil.net_connections(kind="inet"):
        if c.status == psutil.CONN_LISTEN and c.pid in pids:
            out.append((c.laddr.ip, c.laddr.port, c.pid))
    return out


def _ray_pids() -> set[int]:
    """This test's processes and its Ray cluster's (those naming its session), not another Ray
    session's on the same machine (a concurrent run's head is no concern of this cluster's)."""
    import psutil

    session = Path(ray._private.worker.global_worker.node.get_session_dir_path()).name
    me = psutil.Process()
    pids = {me.pid} | {p.pid for p in me.children(recursive=True)}
    for p in psutil.process_iter(["name", "cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if session in cmd:
            pids.add(p.pid)
    return pids


@pytest.mark.timeout(300)
def test_nothing_listens_beyond_loopback(ray_cluster):
    psutil = pytest.importorskip("psutil")
    from maskgrpo_ray.backend.ray_executor import RayExecutor  # noqa: F401 - actors' modules import

    @ray.remote(num_cpus=0.25)
    class Probe:
        def pid(self) -> int:
            return os.getpid()

    probe = Probe.remote()
    ray.get(probe.pid.remote(), timeout=120)
    try:
        socks = _listening(_ray_pids())
    except psutil.AccessDenied:
        pytest.skip("listing sockets needs privileges here")
    assert socks, "found no Ray listening socket at all: the check would be vacuous"
    bad = [s for s in socks if s[0] not in ("127.0.0.1", "::1", "::ffff:127.0.0.1")]
    assert not bad, f"listening beyond loopback: {bad}"
    ray.kill(probe)


@pytest.mark.parametrize(
    "override, field, fix",
    [
        ("train.learning_rat=1e-4", "train.learning_rat", "unknown key"),
        ("train.learning_rate=-1e-4", "train.learning_rate", "must be positive"),
        ("rollout.samples_per_prompt=1", "rollout.samples_per_prompt", "set it to 2 or more"),
        ("filter.percentile=120", "filter.percentile", "set a value in [0, 100]"),
    ],
)
def test_bad_config_fails_before_any_actor(override, field, fix, capsys, monkeypatch, tmp_path):
    """Exit code 2, a message naming the field and the fix, and no Ray cluster started."""
    from maskgrpo_ray.cli import app as cli

    def no_cluster(*a, **k):
        raise AssertionError("a Ray cluster was started for a bad config")

    monkeypatch.setattr(ray, "init", no_cluster)
    was_up = ray.is_initialized()
    code = cli.main(["train", "--config", TOY, "--set", override, "--run-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2
    assert field in err and fix in err, err
    assert ray.is_initialized() == was_up
    assert not (tmp_path / "config.json").exists()
