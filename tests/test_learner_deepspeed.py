"""The DeepSpeed learner on a real local Ray cluster: a world-size-2 update equals the
single-process update on the whole batch, so gradient averaging across ranks really happens.

Why the comparison is sensitive: Adam (and clipping above the threshold) hide a constant
scale error in the gradient, so besides the weights we compare the pre-clip gradient norm,
which DeepSpeed's ranks compute after averaging: a rank that trained on its own shard without
averaging, or a wrong normalizer (M instead of M / W), changes it by a factor.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

import pytest
import torch

from maskgrpo_ray.config import Config, load_config
from maskgrpo_ray.pipeline.build import build_policy, build_reward_from_settings
from maskgrpo_ray.pipeline.learner_core import (
    TorchOptimizing,
    UpdatePlanner,
    apply_update,
    build_optimizer,
)
from maskgrpo_ray.pipeline.messages import TrainBatch
from maskgrpo_ray.pipeline.phases import generate, make_train_batch, score
from maskgrpo_ray.pipeline.settings import settings_from_config
from maskgrpo_ray.prompts.loading import load_prompts

TOY = os.path.join(os.path.dirname(__file__), "..", "configs", "toy.yaml")


def small_cfg(*extra: str) -> Config:
    return load_config(
        TOY,
        [
            "rollout.unmasking_steps=4",
            "train.prompts_per_step=3",
            "learner.num_workers=2",
            "learner.num_cpus_per_worker=0.5",
            "train.micro_batch_pairs_per_gpu=20",
            "train.grad_clip_norm=1.0",
            *extra,
        ],
    )


def toy_batch(cfg: Config, with_rollout: bool = False) -> Any:
    """3 groups of G=6 from the base model, with random (non-zero) advantages.

    72 (sample, step) pairs: rank 0 holds groups 0 and 2 (48 pairs, 3 micro-batches of 20),
    rank 1 group 1 (24 pairs, 2 micro-batches), so rank 1 pads one zero-loss backward.
    """
    policy = build_policy(cfg.model)
    r = cfg.rollout
    prompts = load_prompts("toy")[:3]
    rb = generate(
        policy,
        prompts,
        [0, 1, 2],
        group_size=r.samples_per_prompt,
        num_steps=r.unmasking_steps,
        temperature=r.temperature,
        gumbel_temperature=r.gumbel_temperature,
        guidance_scale=0.0,
        transition=r.transition,
        policy_version=0,
        generator=torch.Generator().manual_seed(3),
    )
    tb = make_train_batch(
        score(build_reward_from_settings(settings_from_config(cfg).reward), rb),
        torch.ones(3, dtype=torch.bool),
        cfg.train.advantage_eps,
    )
    adv = torch.randn(tb.num_samples, generator=torch.Generator().manual_seed(4))
    if with_rollout:
        return replace(tb, advantages=adv), rb
    return replace(tb, advantages=adv)


def local_reference(cfg: Config, batch: TrainBatch, updates: int):
    # exactly what LocalExecutor.update runs: the one update path, in this process
    s = settings_from_config(cfg).update
    policy = build_policy(cfg.model)
    opt = TorchOptimizing(policy, build_optimizer(s, policy), s.grad_clip_norm)
    planner = UpdatePlanner(s)
    metrics = [apply_update(opt, batch, planner.plan(i), s) for i in range(updates)]
    state = {n: p.detach().clone() for n, p in policy.named_parameters()}
    return state, metrics


@pytest.mark.slow
@pytest.mark.ci
@pytest.mark.timeout(600)
def test_world2_update_equals_single_process_update(ray_cluster):
    from maskgrpo_ray.learner.group import LearnerGroup

    cfg = small_cfg()
    batch = toy_batch(cfg)
    ref_state, ref_metrics = local_reference(cfg, batch, updates=2)
    group = LearnerGroup(settings_from_config(cfg), timeout_s=300)
    try:
        got = [group.update(batch) for _ in range(2)]
        states = group.all_ranks_state()
    finally:
        group.shutdown()
    assert group.version == 2
    # ranks hold bit-identical weights
    for name, t in states[0].items():
        assert torch.equal(t, states[1][name]), name
    # ... equal to the single-process update on the whole batch. Excluded: the key bias of
    # every attention block, whose gradient is exactly zero in exact arithmetic (softmax is
    # invariant to adding q.b_k to every score of a row), so both runs hold float noise
    # (~1e-10) there, which Adam's g / (sqrt(v) + eps) turns into steps of +-lr.
    d = cfg.model.toy.d_model
    for name, t in ref_state.items():
        a, b = states[0][name], t
        if name.endswith("qkv.bias"):
            a, b = torch.cat([a[:d], a[2 * d :]]), torch.cat([b[:d], b[2 * d :]])
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=name)
    for g, r in zip(got, ref_metrics, strict=True):
        # pre-clip norm of the averaged gradient: sensitive to a scale error
        assert g["grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-4)
        assert g["loss"] == pytest.approx(r["loss"], rel=1e-4, abs=1e-6)
        assert g["ratio_mean"] == pytest.approx(r["ratio_mean"], rel=1e-5)
    # the second update saw a ratio != 1 (old log-probs are the batch's), so clipping mattered
    assert got[1]["ratio_mean"] != pytest.approx(1.0, abs=1e-6)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_world2_ranks_fetching_their_chunks_equal_the_cut_shards(ray_cluster):
    """The driver-free path: the batch's groups left in the object store as two chunks, each
    rank sent its ShardPlan and the chunk references, fetching its groups itself. Two updates
    give weights and metrics bit-identical to the same updates with the shards cut on the
    driver (the path the test above checks against the single process)."""
    import ray

    from maskgrpo_ray.learner.group import LearnerGroup
    from maskgrpo_ray.pipeline.data_plane import RolloutMeta, RolloutRefs, Traffic, TrainRefs

    cfg = small_cfg()
    batch, rb = toy_batch(cfg, with_rollout=True)
    views = []
    for keep in ([True, True, False], [False, False, True]):  # chunks of 2 and 1 prompts
        part = rb.group_slice(torch.tensor(keep))
        ref, images = ray.put(part.without_images()), ray.put(part.images)
        views.append(
            RolloutRefs.of_chunk(
                part.prompts, part.prompt_indices, ref, images, RolloutMeta.of(part)
            )
        )
    refs = TrainRefs(RolloutRefs.concat(views), batch.advantages)
    runs = []
    for arg in (batch, refs):
        group = LearnerGroup(settings_from_config(cfg), timeout_s=300)
        traffic = Traffic()
        try:
            metrics = [group.update(arg, traffic) for _ in range(2)]
            runs.append((metrics, group.all_ranks_state()[0], traffic.take()))
        finally:
            group.shutdown()
    (m_cut, w_cut, _), (m_ref, w_ref, t_ref) = runs
    for name, t in w_cut.items():
        assert torch.equal(t, w_ref[name]), name
    assert m_cut == m_ref
    # rank 0 fetched both chunks (groups 0 and 2), rank 1 the first (group 1), per update
    sizes = [v.pieces[0].meta.tensor_bytes for v in views]
    assert t_ref["bytes/learner_fetch"] == 2 * (sizes[0] + sizes[1] + sizes[0])


@pytest.mark.slow
@pytest.mark.ci
@pytest.mark.timeout(300)
def test_a_rank_whose_inputs_are_lost_makes_the_learner_lost_at_once(ray_cluster):
    """A rank whose rollout chunks are gone (their node's object store lost with it) fails
    its fetch while its peer waits in a collective for it: ``gather`` raises ``LearnerLost``
    at once (the group is rebuilt and the run rolled back, which regenerates the chunks),
    neither waiting out the peer nor raising the fetch error as a crash."""
    import time

    import ray

    from maskgrpo_ray.learner.group import LearnerGroup
    from maskgrpo_ray.pipeline.learner_core import LearnerLost

    @ray.remote(num_cpus=0)
    class Owner:
        def make(self) -> list:
            import numpy as np

            return [ray.put(np.zeros(1 << 20, dtype=np.uint8))]  # owned here, in the store

    @ray.remote(num_cpus=0)
    class Rank:
        def fetch(self, refs: list) -> int:
            return int(ray.get(refs[0], timeout=30).sum())

        def wait_in_collective(self) -> int:
            time.sleep(120)
            return 0

    owner = Owner.remote()
    (chunk,) = ray.get(owner.make.remote(), timeout=60)
    ray.kill(owner)  # the object goes with its owner: a fetch raises OwnerDiedError
    time.sleep(1.0)
    a, b = Rank.remote(), Rank.remote()
    group = LearnerGroup.__new__(LearnerGroup)  # gather needs only the timeout
    group.timeout_s = 200.0
    t0 = time.monotonic()
    with pytest.raises(LearnerLost, match="rank 0 lost its inputs during update"):
        group.gather([a.fetch.remote([chunk]), b.wait_in_collective.remote()], "update")
    assert time.monotonic() - t0 < 60  # not the peer's 120 s, nor the 30 s error grace
    ray.kill(a)
    ray.kill(b)
