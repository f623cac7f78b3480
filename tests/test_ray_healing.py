"""Self-healing actor pools on a real local Ray cluster: a rollout, reward or filter actor whose
process is SIGKILLed, or a rollout actor that hangs (SIGSTOP), is replaced within the restart
budget; the chunk in flight is re-issued exactly once, so the step's samples and rewards equal
those of a run without the fault, and the replacement holds the current weights."""

from __future__ import annotations

import os
import signal
import time

import pytest
import ray
import torch
from test_ray_system import chunks_of, rollout_versions, small_cfg

from maskgrpo_ray.actors.filter import FilterActor
from maskgrpo_ray.pipeline.data_plane import Traffic, fetch_rollout, rollout_nbytes
from maskgrpo_ray.pipeline.phases import make_train_batch
from maskgrpo_ray.prompts.loading import load_prompts

CALL_TIMEOUT_S = 8.0


@pytest.fixture(scope="module")
def executor(ray_cluster):
    from maskgrpo_ray.backend.ray_executor import RayExecutor

    cfg = small_cfg(
        f"rollout.call_timeout_seconds={CALL_TIMEOUT_S}",
        f"reward.call_timeout_seconds={CALL_TIMEOUT_S}",
        "rollout.max_restarts=3",
    )
    ex = RayExecutor(cfg, timeout_s=120)
    yield ex
    ex.shutdown()


PROMPTS = load_prompts("toy", "train")[:8]
POSITIONS = list(range(300, 308))


def _generate(ex):
    t0 = time.perf_counter()  # the same chunk seeds on every pass
    out = ex.generate_and_score(chunks_of(ex, PROMPTS, POSITIONS), Traffic())
    return out, time.perf_counter() - t0


def _same(a, b):
    assert a.rollout.prompt_indices == POSITIONS == b.rollout.prompt_indices  # each group once
    tokens_a = fetch_rollout(a.rollout, images=False).final_tokens
    assert torch.equal(tokens_a, fetch_rollout(b.rollout, images=False).final_tokens)
    assert torch.equal(a.rewards, b.rewards)


def _pid(handle) -> int:
    return int(ray.get(handle.pid.remote(), timeout=60))


@pytest.mark.slow
@pytest.mark.ci
@pytest.mark.timeout(600)
def test_rollout_actor_killed_or_hung_is_replaced_with_current_weights(executor):
    ex = executor
    batch, _ = _generate(ex)
    ex.update(make_train_batch(batch, torch.ones(len(PROMPTS), dtype=torch.bool), 1e-4))
    ex.sync_weights()  # version 1: a replacement must get these weights, not the base model's
    clean, clean_s = _generate(ex)
    for fault in ("SIGKILL", "SIGSTOP"):
        victim = ex.fleet.rollout_actor_ids()[0]
        restarts, reissued = ex.fleet.restarts["rollout"], ex.counters["chunks_reissued"]
        timed_out = ex.counters["calls_timed_out"]
        os.kill(_pid(ex.fleet.rollout_handle(victim)), getattr(signal, fault))
        faulty, faulty_s = _generate(ex)
        _same(faulty, clean)
        print(
            f"rollout {fault}: step {faulty_s:.1f} s vs {clean_s:.1f} s clean; recovery "
            f"{ex.last_recovery_s:.1f} s"
        )
        assert victim not in ex.fleet.rollout_actor_ids() and len(ex.fleet.rollout_actor_ids()) == 2
        assert ex.fleet.restarts["rollout"] == restarts + 1
        assert ex.counters["chunks_reissued"] == reissued + 1
        assert ex.counters["calls_timed_out"] == timed_out + (fault == "SIGSTOP")
        versions = rollout_versions(ex)
        assert {v for v, _ in versions.values()} == {ex.policy_version}
        assert len({round(c, 6) for _, c in versions.values()}) == 1  # the same weights
    after, after_s = _generate(ex)
    _same(after, clean)
    print(f"throughput: {clean_s:.2f} s per call before, {after_s:.2f} s after recovery")
    m = ex.extra_metrics()
    assert m["rollout_actor_restarts"] == 2 and m["rollout_actors"] == 2


@pytest.mark.slow
@pytest.mark.ci
@pytest.mark.timeout(600)
def test_a_replacement_while_the_learner_is_ahead_takes_the_rollout_actors_weights(executor):
    """As during a lag-1 update: the learner holds version v + 1, the rollout actors v and a
    chunk of theirs is in flight. A rollout actor lost then is replaced with its siblings'
    weights (version v), so the reissued chunk equals the one it replaces; with the learner's
    weights it would not (the chaos soak found this: a reissue made with the next version)."""
    ex = executor
    clean, _ = _generate(ex)
    v = ex.policy_version
    ex.update(make_train_batch(clean, torch.ones(len(PROMPTS), dtype=torch.bool), 1e-4))
    assert ex.learner.version == v + 1  # not synced: the rollout actors still hold v
    victim = ex.fleet.rollout_actor_ids()[0]
    reissued = ex.counters["chunks_reissued"]
    os.kill(_pid(ex.fleet.rollout_handle(victim)), signal.SIGKILL)
    faulty, _ = _generate(ex)
    assert ex.counters["chunks_reissued"] == reissued + 1
    _same(faulty, clean)
    versions = rollout_versions(ex)
    assert {ver for ver, _ in versions.values()} == {v}, versions
    assert len({round(c, 6) for _, c in versions.values()}) == 1
    ex.sync_weights()  # the step's sync: every actor at v + 1
    assert {ver for ver, _ in rollout_versions(ex).values()} == {v + 1}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_reward_actor_killed_is_replaced_and_the_chunk_rescored(executor):
    ex = executor
    clean, _ = _generate(ex)
    (victim,) = ex.fleet.rewards.members  # the only reward actor: before healing, the run died
    os.kill(_pid(victim.handle), signal.SIGKILL)
    faulty, _ = _generate(ex)
    _same(faulty, clean)
    assert len(ex.fleet.rewards) == 1 and ex.fleet.rewards.members[0].actor_id != victim.actor_id
    assert ex.fleet.restarts["reward"] == 1 and ex.counters["reward_actors_lost"] >= 1


@pytest.mark.slow
@pytest.mark.ci
@pytest.mark.timeout(600)
def test_filter_actor_killed_is_restarted_with_its_history(executor):
    ex = executor
    clean, _ = _generate(ex)
    ex.filter(clean, Traffic())  # some history
    before = ex.filter_state()
    # what a filter that never died decides next, from that same history
    local = FilterActor(ex.settings.filter)
    local.load_state_dict(before)
    want = local.filter(clean.rewards, clean.rollout.group_size)
    os.kill(int(ray.get(ex.filters.actor.pid.remote(), timeout=60)), signal.SIGKILL)
    got = ex.filter(clean, Traffic())
    assert torch.equal(got.keep, want.keep) and torch.equal(got.stds, want.stds)
    assert ex.filter_state() == local.state_dict()  # the driver's copy
    assert ray.get(ex.filters.actor.state_dict.remote(), timeout=60) == local.state_dict()
    assert ex.counters["filter_actors_lost"] == 1


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_control_actor_lost_is_started_again_and_scaling_works(executor, caplog):
    """The control actor (``maskgrpo scale``) runs on the driver's node; if it is lost anyway,
    the next step's end starts it again (one warning) and a scale request sent to the new one
    applies."""
    ex = executor
    assert ray.get(ex.control.node_id.remote(), timeout=60) == (
        ray.get_runtime_context().get_node_id()
    )
    os.kill(int(ray.get(ex.control.pid.remote(), timeout=60)), signal.SIGKILL)
    row = {"samples_per_second": 1.0, "reward_mean": 0.0}
    with caplog.at_level("WARNING"):
        ex.on_step_end(0, row)
    assert [r for r in caplog.records if "control actor lost" in r.getMessage()]
    n = len(ex.fleet.rollout_actor_ids())
    ray.get(ex.control.request_rollout_actors.remote(n + 1), timeout=60)
    ex.on_step_end(1, row)
    assert len(ex.fleet.rollout_actor_ids()) == n + 1


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_past_the_restart_budget_a_lost_actor_is_only_dropped(executor):
    ex = executor
    clean, _ = _generate(ex)
    ex.fleet.restarts["rollout"] = 3  # rollout.max_restarts=3: the budget is spent
    victim, n = ex.fleet.rollout_actor_ids()[0], len(ex.fleet.rollout_actor_ids())
    os.kill(_pid(ex.fleet.rollout_handle(victim)), signal.SIGKILL)
    faulty, _ = _generate(ex)
    _same(faulty, clean)  # the survivor generated the lost chunk, with the same seed
    assert ex.fleet.rollout_actor_ids() != [] and victim not in ex.fleet.rollout_actor_ids()
    assert len(ex.fleet.rollout_actor_ids()) == n - 1  # dropped, not replaced


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_rollouts_reach_the_reward_actor_and_the_learner_without_the_driver(executor):
    """The driver's batch holds object references and no rollout tensor; the driver received
    only the chunks' metas and rewards (under 5 % of the rollout bytes here, where a toy image
    is tiny); the rewards, computed by the reward actor from images it fetched itself, equal
    the same reward on the fetched images; and the learner ranks fetch their groups from the
    object store (``bytes/learner_fetch``) while the driver sends plans only."""
    from maskgrpo_ray.pipeline.data_plane import RolloutRefs
    from maskgrpo_ray.worlds.toy.rewards import ToyRuleReward

    ex = executor
    ex.fleet.scale_rollout(1)  # one chunk a call, whatever the tests before left (the bound's case)
    ex.traffic.take()
    collection = Traffic()  # the driver's bytes of the collection (the group source's count)
    out = ex.generate_and_score(chunks_of(ex, PROMPTS, POSITIONS), collection)
    assert isinstance(out.rollout, RolloutRefs)
    assert not any(isinstance(v, torch.Tensor) for v in vars(out.rollout).values())
    got = collection.take()
    tensors, images = rollout_nbytes(out.rollout)
    assert 0 < got["bytes/driver_received"] < 0.05 * (tensors + images)
    rb = fetch_rollout(out.rollout, images=True)  # what a sample grid fetches
    assert rb.images.shape[0] == len(PROMPTS) * rb.group_size and rb.images.shape[1] > 0
    texts = [p for p in rb.prompts for _ in range(rb.group_size)]
    assert torch.equal(out.rewards, ToyRuleReward(grid=4)(rb.images, texts).float())
    tb = make_train_batch(out, torch.ones(len(PROMPTS), dtype=torch.bool), 1e-4)
    ex.update(tb)
    ex.sync_weights()
    sent = ex.traffic.take()
    assert sent["bytes/learner_fetch"] >= tensors  # every kept group fetched by a rank
    # the plans: advantages (4 bytes a sample) and group lists, not the record (the rollout
    # without images, 320 bytes a toy sample; far more at Show-o scale)
    assert sent["bytes/driver_sent"] < 0.25 * tensors
