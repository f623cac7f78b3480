"""maskgrpo_ray/cluster/weight_transfer.py: bucket plan, pack/unpack, and a real two- and three-process gloo
broadcast; on a Ray cluster (slow) the collective sync gives the rollout actors the learner's
exact weights, as the object store does, and re-forms its group when an actor is lost."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from maskgrpo_ray.cluster.weight_transfer import (
    Channel,
    TensorMeta,
    open_store,
    pack,
    plan_buckets,
    tensor_metas,
    unpack,
)


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "a.weight": torch.randn(4, 3, generator=g),  # 48 bytes
        "a.bias": torch.randn(3, generator=g),  # 12 bytes
        "emb": torch.randn(10, 2, generator=g).to(torch.bfloat16),  # 40 bytes
        "b.weight": torch.randn(5, 5, generator=g),  # 100 bytes
        "b.bias": torch.randn(5, generator=g),  # 20 bytes
    }


def test_bucket_plan_by_hand():
    metas = tensor_metas(_state(0))
    # 64-byte buckets, in order, one dtype each: [a.weight 48] (a.bias would make 60: fits)
    # -> [a.weight, a.bias] = 60; emb is bf16: new bucket [emb] = 40; b.weight (100 > 64) alone;
    # b.bias 20 would make 120 > 64: its own bucket
    assert plan_buckets(metas, 64) == [[0, 1], [2], [3], [4]]
    assert plan_buckets(metas, 1 << 20) == [[0, 1], [2], [3, 4]]  # dtype changes still split
    assert plan_buckets([], 64) == []


def test_pack_unpack_roundtrip():
    state = _state(1)
    metas = [m for m in tensor_metas(state) if m.dtype == "torch.float32"]
    flat = pack([state[m.name] for m in metas])
    assert flat.numel() == 12 + 3 + 25 + 5
    for m, view in zip(metas, unpack(flat, metas), strict=True):
        assert torch.equal(view, state[m.name])
    with pytest.raises(ValueError, match="bucket has"):
        unpack(flat[:-1], metas)
    assert TensorMeta("x", (2, 3), "torch.bfloat16").torch_dtype == torch.bfloat16


def _member(rank: int, world: int, port: int, q) -> None:  # noqa: ANN001
    torch.set_num_threads(1)
    metas = tensor_metas(_state(0))
    try:
        if rank == 0:
            store = open_store("127.0.0.1", 30)
            q.put(("port", store.port))
            ch = Channel("127.0.0.1", 0, 0, world, torch.device("cpu"), metas, 64, 30, store=store)
            q.put(("sent", ch.send(_state(7))))
        else:
            ch = Channel("127.0.0.1", port, rank, world, torch.device("cpu"), metas, 64, 30)
            into = _state(rank + 100)  # different values, same names and shapes
            got = ch.receive(into)
            q.put(("got", rank, got, {k: v.tolist() for k, v in into.items()}))
    except Exception as err:  # noqa: BLE001 - reported to the test
        q.put(("error", rank, repr(err)))


@pytest.mark.parametrize("world", [2, 3])
def test_gloo_broadcast_between_processes(world):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p0 = ctx.Process(target=_member, args=(0, world, 0, q))
    p0.start()
    kind, port = q.get(timeout=60)
    assert kind == "port", port
    others = [ctx.Process(target=_member, args=(r, world, port, q)) for r in range(1, world)]
    for p in others:
        p.start()
    msgs = [q.get(timeout=60) for _ in range(world)]
    for p in [p0, *others]:
        p.join(timeout=60)
    errors = [m for m in msgs if m[0] == "error"]
    assert not errors, errors
    want = {k: v.tolist() for k, v in _state(7).items()}
    total = sum(v.numel() * v.element_size() for v in _state(7).values())  # 220 bytes
    assert total == 220
    assert ("sent", total) in msgs
    received = [m for m in msgs if m[0] == "got"]
    assert len(received) == world - 1
    for _, _, got, state in received:
        assert got == total and state == want  # every member holds the sender's values


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ray_collective_sync_equals_learner_and_heals(ray_cluster):
    import os
    import signal

    import ray
    from test_ray_system import learner_digest, rollout_versions, small_cfg

    from maskgrpo_ray.backend.ray_executor import RayExecutor
    from maskgrpo_ray.learner.weight_sync import CollectiveSync
    from maskgrpo_ray.pipeline.phases import make_train_batch
    from maskgrpo_ray.prompts.loading import load_prompts

    ex = RayExecutor(small_cfg("learner.weight_sync=collective"), timeout_s=120)
    try:
        assert isinstance(ex.fleet.sync, CollectiveSync)
        prompts = load_prompts("toy", "train")[:4]
        from test_ray_system import chunks_of

        from maskgrpo_ray.pipeline.data_plane import Traffic

        batch = ex.generate_and_score(chunks_of(ex, prompts, [0, 1, 2, 3]), Traffic())
        ex.update(make_train_batch(batch, torch.ones(4, dtype=torch.bool), 1e-4))
        ex.sync_weights()
        versions = rollout_versions(ex)
        assert {v for v, _ in versions.values()} == {ex.policy_version} == {1}
        # the checksum of the rollout actors' weights equals the learner's (same tensors)
        learner_sum = learner_digest(ex)[0]
        for _, checksum in versions.values():
            assert checksum == pytest.approx(learner_sum, rel=1e-9)
        formed = ex.fleet.sync.groups_formed
        victim = ex.fleet.rollout_actor_ids()[0]
        os.kill(
            int(ray.get(ex.fleet.rollout_handle(victim).pid.remote(), timeout=60)), signal.SIGKILL
        )
        ex.update(make_train_batch(batch, torch.ones(4, dtype=torch.bool), 1e-4))
        ex.sync_weights()  # the dead member is found, healed, the group re-formed
        assert victim not in ex.fleet.rollout_actor_ids() and len(ex.fleet.rollout_actor_ids()) == 2
        assert ex.fleet.sync.groups_formed > formed
        versions = rollout_versions(ex)
        assert {v for v, _ in versions.values()} == {2}
        learner_sum = learner_digest(ex)[0]
        for _, checksum in versions.values():
            assert checksum == pytest.approx(learner_sum, rel=1e-9)
    finally:
        ex.shutdown()


def test_config_resolves_and_refuses_weight_sync_and_async():
    from maskgrpo_ray.config import ConfigError, load_config
    from maskgrpo_ray.pipeline.settings import settings_from_config

    def sync_of(*sets: str) -> str:
        return settings_from_config(load_config("configs/toy.yaml", list(sets))).learner.weight_sync

    assert sync_of() == "object_store"  # CPUs: auto keeps the object store
    gpus = ["learner.num_gpus_per_worker=1", "rollout.num_gpus_per_actor=1"]
    assert sync_of(*gpus) == "collective"
    assert sync_of(*gpus, "learner.zero_stage=3") == "object_store"
    # fractional shares share a GPU, where NCCL refuses two ranks (measured on an H100)
    shared = ["learner.num_gpus_per_worker=0.4", "rollout.num_gpus_per_actor=0.4"]
    assert sync_of(*shared) == "object_store"
    assert sync_of(gpus[0], shared[1]) == "object_store"
    with pytest.raises(ConfigError, match="Duplicate GPU detected"):
        load_config("configs/toy.yaml", ["learner.weight_sync=collective", *shared])
    with pytest.raises(ConfigError, match="rollout.num_gpus_per_actor=0.4"):
        load_config("configs/toy.yaml", ["learner.weight_sync=collective", gpus[0], shared[1]])
    assert sync_of("learner.weight_sync=collective") == "collective"  # gloo on CPUs
    with pytest.raises(ConfigError, match="zero_stage=3"):
        load_config("configs/toy.yaml", ["learner.weight_sync=collective", "learner.zero_stage=3"])
    with pytest.raises(ConfigError, match="all GPU \\(NCCL\\) or all CPU"):
        load_config(
            "configs/toy.yaml", ["learner.weight_sync=collective", "learner.num_gpus_per_worker=1"]
        )
    # the local backend runs lag 1 too (the reference of the Ray run)
    load_config("configs/toy.yaml", ["rollout.max_policy_lag=1", "run.backend=local"])
    with pytest.raises(ConfigError, match="max_policy_lag"):
        load_config("configs/toy.yaml", ["rollout.max_policy_lag=3"])
