"""The driver-free data plane (``maskgrpo_ray.pipeline.data_plane``) without a cluster: the driver's
view of rollouts left in the object store, and the learner shards the ranks build from their
own chunks, equal to the shards of the batch the driver used to assemble."""

from __future__ import annotations

from dataclasses import fields

import pytest
import torch

from maskgrpo_ray.pipeline.data_plane import (
    RolloutMeta,
    RolloutRefs,
    TrainRefs,
    build_shard,
    concat_rollouts,
    fetch_rollout,
    rollout_nbytes,
)
from maskgrpo_ray.pipeline.messages import RolloutBatch, ScoredBatch, TrainBatch
from maskgrpo_ray.pipeline.phases import generate, make_train_batch
from maskgrpo_ray.prompts.loading import load_prompts
from maskgrpo_ray.worlds.toy.model import ToyModelSpec, ToyPolicy

G = 3


class Store:
    """Stands in for the object store: ``put`` gives a key, the 'rank' looks it up."""

    def __init__(self) -> None:
        self.objects: dict[object, object] = {}

    def put(self, obj: object) -> object:
        key = object()
        self.objects[key] = obj
        return key

    def get(self, refs: list[object]) -> list:
        return [self.objects[r] for r in refs]


@pytest.fixture(scope="module")
def chunks() -> list[RolloutBatch]:
    """Three chunks of 3, 2 and 4 prompts (different versions), as rollout actors make them."""
    torch.manual_seed(0)
    policy = ToyPolicy(ToyModelSpec(grid=4, d_model=32, layers=1)).eval()
    prompts = load_prompts("toy")[:9]
    out, at = [], 0
    for i, size in enumerate((3, 2, 4)):
        out.append(
            generate(
                policy,
                prompts[at : at + size],
                list(range(at, at + size)),
                group_size=G,
                num_steps=3,
                temperature=1.0,
                gumbel_temperature=0.0,
                guidance_scale=0.0,
                transition="p1",
                policy_version=5 + i,
                generator=torch.Generator().manual_seed(i),
            )
        )
        at += size
    return out


def _views(chunks: list[RolloutBatch], store: Store) -> list[RolloutRefs]:
    return [
        RolloutRefs.of_chunk(
            rb.prompts,
            rb.prompt_indices,
            store.put(rb.without_images()),
            store.put(rb.images),
            RolloutMeta.of(rb),
        )
        for rb in chunks
    ]


def _equal(a: object, b: object, skip: tuple[str, ...] = ()) -> None:
    assert type(a) is type(b)
    for f in fields(a):  # type: ignore[arg-type]
        if f.name in skip:
            continue
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and torch.equal(x, y), f.name
        else:
            assert x == y, f.name


def test_views_account_like_the_rollouts(chunks):
    store = Store()
    views = _views(chunks, store)
    whole = RolloutBatch.concat(chunks)
    view = concat_rollouts(views)
    assert view.prompts == whole.prompts and view.prompt_indices == whole.prompt_indices
    assert view.num_samples == whole.num_samples and view.group_size == G
    assert view.policy_version == whole.policy_version == 5
    # per chunk, what a fetch of the view's groups moves (each chunk has its own tau schedule)
    keep = torch.tensor([1, 0, 1, 1, 0, 0, 1, 1, 0], dtype=torch.bool)
    for k in (torch.ones(9, dtype=torch.bool), keep):
        want, at = [0, 0], 0
        for c in chunks:
            b = len(c.prompts)
            part = rollout_nbytes(c.group_slice(k[at : at + b]))
            want = [want[0] + part[0], want[1] + part[1]]
            at += b
        assert list(rollout_nbytes(view.group_slice(k))) == want
    with pytest.raises(TypeError):
        concat_rollouts([views[0], chunks[1]])
    with pytest.raises(ValueError, match="came back with"):
        RolloutRefs.of_chunk(["a", "b"], [0, 1], None, None, RolloutMeta(7, 0, 1, 1))


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize(
    "keep",
    [
        [1] * 9,
        [1, 0, 1, 1, 0, 0, 1, 1, 0],
        [0, 0, 0, 0, 0, 0, 0, 1, 0],  # one group: some ranks get none
    ],
)
def test_rank_shards_equal_the_assembled_batch_shards(chunks, world, keep):
    """What each rank builds from its plan and its own fetched chunks equals, field by field
    and bit for bit, ``TrainBatch.shard`` of the batch assembled on the driver as before. The
    policy version is the oldest among the chunks holding kept groups (the assembled batch
    took it over every generated chunk, dropped ones too; the learner does not read it)."""
    torch.manual_seed(1)
    store = Store()
    rewards = torch.rand(9 * G)
    keep_t = torch.tensor(keep, dtype=torch.bool)
    before = make_train_batch(ScoredBatch(RolloutBatch.concat(chunks), rewards), keep_t, 1e-4)
    scored = ScoredBatch(concat_rollouts(_views(chunks, store)), rewards)
    after = make_train_batch(scored, keep_t, 1e-4)
    assert isinstance(before, TrainBatch) and isinstance(after, TrainRefs)
    assert after.num_samples == before.num_samples
    for rank in range(world):
        plan, refs = after.shard(rank, world)
        shard = build_shard(plan, store.get(refs))
        _equal(shard, before.shard(rank, world), skip=("policy_version",))
        at, kept_versions = 0, []
        for c in chunks:
            if keep_t[at : at + len(c.prompts)].any():
                kept_versions.append(c.policy_version)
            at += len(c.prompts)
        assert shard.policy_version == min(kept_versions)
        # a rank fetches each chunk holding one of its samples once, whole (when it has no
        # sample, the first chunk holding a kept group); its samples are a contiguous range
        chunk_of = [ci for ci, c in enumerate(chunks) for _ in c.prompts]
        kept = [chunk_of[i] for i in range(len(keep)) if keep[i]]
        n = len(kept) * G
        lo, hi = rank * n // world, (rank + 1) * n // world
        assert shard.num_samples == hi - lo
        mine = sorted({kept[s // G] for s in range(lo, hi)}) or [kept[0]]
        assert len(refs) == len(mine)
        assert plan.fetch_bytes == sum(RolloutMeta.of(chunks[c]).tensor_bytes for c in mine)


def test_fetch_rollout_puts_the_chosen_groups_back_together(chunks, monkeypatch):
    store = Store()
    import ray

    monkeypatch.setattr(ray, "get", store.get)
    keep = torch.tensor([0, 1, 1, 1, 0, 1, 0, 0, 1], dtype=torch.bool)
    view = concat_rollouts(_views(chunks, store)).group_slice(keep)
    want = RolloutBatch.concat(chunks).group_slice(keep)
    _equal(fetch_rollout(view, images=True), want)
    light = fetch_rollout(view, images=False)
    assert tuple(light.images.shape) == (want.num_samples, 0, 0, 3)
    assert torch.equal(light.final_tokens, want.final_tokens)
    assert fetch_rollout(want) is want  # an in-process rollout is already here


def test_train_refs_refuse_bad_advantages(chunks):
    view = concat_rollouts(_views(chunks[:1], Store()))
    with pytest.raises(ValueError, match="must be finite"):
        TrainRefs(view, torch.tensor([float("nan")] * view.num_samples))
    with pytest.raises(ValueError, match=r"advantages must be \[N=9\]"):
        TrainRefs(view, torch.zeros(4))
