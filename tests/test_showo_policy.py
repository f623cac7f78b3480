"""ShowoPolicy behind the policy interface: prefix reuse == full recomputation, guidance, grads."""

from __future__ import annotations

import pytest
import torch

from maskgrpo_ray.models.base import MaskedImagePolicy, cfg_mix
from maskgrpo_ray.models.showo import ShowoPolicy, build_tiny_random_policy

PROMPTS = ["a red square", "two blue circles on the left of a green triangle", ""]
TOL = dict(atol=1e-5, rtol=1e-5)


def _policy(reuse: bool = True, share: bool = False) -> ShowoPolicy:
    policy = build_tiny_random_policy(seed=3, max_text_len=12, reuse_text_prefix=reuse)
    policy.share_prefix_graph = share
    return policy


def _states(policy: ShowoPolicy, n: int, seed: int = 0) -> torch.Tensor:
    """Random partially masked states [n, L] in codebook space (masked = V)."""
    gen = torch.Generator().manual_seed(seed)
    shape = (n, policy.num_image_tokens)
    tokens = torch.randint(0, policy.codebook_size, shape, generator=gen)
    masked = torch.rand(shape, generator=gen) < torch.linspace(0.1, 1.0, n)[:, None]
    return torch.where(masked, policy.mask_index, tokens)


def test_interface_shapes_and_prompt_layout():
    policy = _policy()
    assert isinstance(policy, MaskedImagePolicy)
    ids = policy.tokenize(PROMPTS)
    v = policy.vocab
    assert ids.shape == (3, policy.max_text_len + 1) and ids.dtype == torch.long
    # '' -> [PAD]*(P-3) <|t2i|> BOS EOS, identical to the null condition
    assert ids[2].tolist() == [v.pad_id] * (ids.shape[1] - 3) + [v.t2i_id, v.bos_id, v.eos_id]
    assert torch.equal(policy.null_condition(2), ids[2:].expand(2, -1))
    # 10 words + t2i, BOS, EOS = 13 = P: no pad; 3 words: P - 6 pads on the left
    assert ids[1, 0] == v.t2i_id and ids[1, 1] == v.bos_id and ids[1, -1] == v.eos_id
    assert (ids[0, : ids.shape[1] - 6] == v.pad_id).all() and ids[0, -6] == v.t2i_id
    with torch.no_grad():
        logits = policy.conditioned(ids, 2.0)(_states(policy, 3))
    assert logits.shape == (3, policy.num_image_tokens, policy.codebook_size)
    assert logits.dtype == torch.float32
    images = policy.decode_images(_states(policy, 3).clamp(max=policy.codebook_size - 1))
    side = policy.vq.config.decoder.resolution
    assert images.shape == (3, side, side, 3) and images.dtype == torch.uint8


def test_truncation_keeps_eos_last():
    policy = _policy()
    words = " ".join(f"word{i}" for i in range(40))
    ids = policy.tokenize([words])[0]
    v = policy.vocab
    assert ids.shape[0] == policy.max_text_len + 1
    assert ids[0] == v.t2i_id and ids[1] == v.bos_id and ids[-1] == v.eos_id
    assert (ids != v.pad_id).all()


@pytest.mark.parametrize("guidance", [0.0, 1.75])
def test_prefix_reuse_equals_full_recomputation(guidance: float):
    reuse, full = _policy(reuse=True), _policy(reuse=False)
    cond = reuse.tokenize(PROMPTS).repeat_interleave(2, dim=0)  # G = 2 samples per prompt
    with torch.no_grad():
        f_reuse, f_full = reuse.conditioned(cond, guidance), full.conditioned(cond, guidance)
        for seed in range(3):  # several unmasking states against the same binding
            state = _states(reuse, len(cond), seed)
            torch.testing.assert_close(f_reuse(state), f_full(state), **TOL)


def test_guidance_is_show_o_cfg_of_separate_passes():
    policy = _policy()
    cond = policy.tokenize(PROMPTS)
    state = _states(policy, 3)
    w = 1.75
    with torch.no_grad():
        guided = policy.conditioned(cond, w)(state)
        c = policy.conditioned(cond)(state)
        u = policy.conditioned(policy.null_condition(3))(state)
    torch.testing.assert_close(guided, cfg_mix(c, u, w), **TOL)
    assert (guided - c).abs().max() > 1e-2  # guidance does change the logits


def test_logits_depend_on_prompt_and_state():
    policy = _policy()
    cond = policy.tokenize(PROMPTS[:2])
    state = _states(policy, 2)
    with torch.no_grad():
        fn = policy.conditioned(cond)
        a = fn(state)
        b = fn(torch.full_like(state, policy.mask_index))
        other_prompt = policy.conditioned(cond.flip(0))(state)
        permuted = policy.conditioned(cond.flip(0))(state.flip(0)).flip(0)
    assert (a - b).abs().max() > 1e-2
    assert (a - other_prompt).abs().max() > 1e-2
    torch.testing.assert_close(a, permuted, **TOL)  # rows are independent


@pytest.mark.parametrize("share", [False, True], ids=["recompute-prefix", "share-prefix-graph"])
def test_gradients_with_prefix_reuse_equal_full(share: bool):
    reuse, full = _policy(reuse=True, share=share), _policy(reuse=False)
    cond = reuse.tokenize(PROMPTS).repeat_interleave(2, dim=0)
    states = [_states(reuse, len(cond), seed) for seed in range(2)]
    grads = []
    for policy in (reuse, full):
        fn = policy.conditioned(cond, 1.5)
        # two unmasking steps of one binding, one backward over the summed objective
        loss = sum(fn(s).log_softmax(-1)[..., 0].sum() for s in states)
        loss.backward()
        grads.append({k: p.grad.clone() for k, p in policy.transformer.named_parameters()})
    assert grads[0].keys() == grads[1].keys()
    for k in grads[0]:
        torch.testing.assert_close(grads[0][k], grads[1][k], atol=1e-4, rtol=1e-4, msg=k)
    # the text-only parameters get gradient through the reused keys/values
    assert grads[0]["showo.model.layers.0.self_attn.k_proj.weight"].abs().sum() > 0


def test_gradient_checkpointing_gives_the_same_gradients():
    grads = []
    for checkpointing in (False, True):
        policy = _policy()
        policy.transformer.showo.model.gradient_checkpointing = checkpointing
        fn = policy.conditioned(policy.tokenize(PROMPTS), 1.5)
        fn(_states(policy, 3)).log_softmax(-1)[..., 1].sum().backward()
        grads.append([p.grad for p in policy.transformer.parameters()])
    for g0, g1 in zip(*grads):
        torch.testing.assert_close(g0, g1, atol=1e-6, rtol=1e-5)


def test_backward_per_call_works_without_shared_graph():
    policy = _policy()
    fn = policy.conditioned(policy.tokenize(PROMPTS))
    for seed in range(2):  # one backward per step: each call owns its prefix graph
        fn(_states(policy, 3, seed)).sum().backward()


def test_bf16_policy_runs():
    policy = _policy().to(torch.bfloat16)
    with torch.no_grad():
        logits = policy.conditioned(policy.tokenize(PROMPTS), 1.0)(_states(policy, 3))
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()


def test_same_seed_same_weights():
    a, b = build_tiny_random_policy(seed=5), build_tiny_random_policy(seed=5)
    for (k, p), (_, q) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(p, q), k
    c = build_tiny_random_policy(seed=6)
    emb = "transformer.showo.model.embed_tokens.weight"
    assert not torch.equal(a.state_dict()[emb], c.state_dict()[emb])


def test_wrong_state_shape_is_rejected():
    policy = _policy()
    fn = policy.conditioned(policy.tokenize(PROMPTS))
    with pytest.raises(ValueError, match="bound"):
        fn(_states(policy, 2))


def test_tiny_random_policy_round_trips_through_folders(tmp_path):
    # The tiny model can be run through the same loader as real weights (configs with paths).
    from maskgrpo_ray.models.showo import load_showo_policy
    from maskgrpo_ray.models.showo_loading import save_magvit_folder

    policy = _policy()
    policy.save_pretrained(tmp_path / "showo")
    save_magvit_folder(tmp_path / "magvit", policy.vq)
    loaded = load_showo_policy(
        tmp_path / "showo",
        tmp_path / "magvit",
        "builtin:hashing",
        dtype=torch.float32,
        max_text_len=policy.max_text_len,
    )
    cond = policy.tokenize(PROMPTS)
    assert torch.equal(loaded.tokenize(PROMPTS), cond)
    state = _states(policy, 3)
    with torch.no_grad():
        torch.testing.assert_close(
            loaded.conditioned(cond, 1.0)(state), policy.conditioned(cond, 1.0)(state), **TOL
        )
    tokens = state.clamp(max=policy.codebook_size - 1)
    assert torch.equal(loaded.decode_images(tokens), policy.decode_images(tokens))


def test_policy_from_config_section(tmp_path):
    from types import SimpleNamespace

    from maskgrpo_ray.models.showo import policy_from_config
    from maskgrpo_ray.models.showo_loading import save_magvit_folder

    section = dict(
        showo_path=None,
        magvit_path=None,
        tokenizer_path=None,
        tiny_random=True,
        resolution_px=256,
        max_text_tokens=16,
        dtype="float32",
    )
    tiny = policy_from_config(SimpleNamespace(**section))
    assert tiny.tokenize(["x"]).shape == (1, 17)
    tiny.save_pretrained(tmp_path / "showo")
    save_magvit_folder(tmp_path / "magvit", tiny.vq)
    # 64 px would be 4x4 tokens: the tiny model's grid
    section.update(
        tiny_random=False,
        showo_path=str(tmp_path / "showo"),
        magvit_path=str(tmp_path / "magvit"),
        tokenizer_path="builtin:hashing",
        resolution_px=64,
        dtype="bfloat16",
    )
    loaded = policy_from_config(SimpleNamespace(**section))
    assert loaded.num_image_tokens == 16
    assert next(loaded.transformer.parameters()).dtype == torch.bfloat16
    assert torch.equal(loaded.tokenize(PROMPTS), tiny.tokenize(PROMPTS))


def _train_batch():
    """A tiny Show-o and a train batch of its real rollout: 2 prompts x 2 samples, CFG, 4
    unmasking steps, advantages summing to 0."""
    from maskgrpo_ray.pipeline.messages import TrainBatch
    from maskgrpo_ray.pipeline.phases import generate

    base = _policy()
    rb = generate(
        base,
        PROMPTS[:2],
        [0, 1],
        group_size=2,
        num_steps=4,
        temperature=1.0,
        gumbel_temperature=0.0,
        guidance_scale=1.5,
        transition="p1",
        policy_version=0,
        generator=torch.Generator().manual_seed(0),
    )
    return base, TrainBatch.from_rollout(rb, torch.tensor([1.0, -1.0, 0.5, -0.5]))


def test_activation_checkpointing_knob_gives_the_same_update():
    """``learner.activation_checkpointing``: the learner's whole gradient accumulation over a
    real rollout (tiny Show-o, CFG, 4 steps, micro-batches of 3 pairs that mix samples and
    steps) gives the same loss and gradients with and without (tolerance 1e-6 abs / 1e-5 rel:
    the recomputed forward runs the same kernels). The toy model has no such mode and says so."""
    import copy

    from maskgrpo_ray.pipeline.learner_core import apply_activation_checkpointing
    from maskgrpo_ray.pipeline.learner_loss import accumulate_gradients
    from maskgrpo_ray.worlds.toy.model import ToyModelSpec, ToyPolicy

    base, batch = _train_batch()
    out = []
    for on in (False, True):
        policy = copy.deepcopy(base).train()
        apply_activation_checkpointing(policy, on, "showo")
        assert policy.transformer.showo.model.gradient_checkpointing is on
        m = accumulate_gradients(
            policy, batch, train_steps=torch.arange(4), micro_batch=3, clip_low=0.2, clip_high=0.2
        )
        out.append((m["loss"], [p.grad.clone() for p in policy.transformer.parameters()]))
    assert out[0][0] == pytest.approx(out[1][0], rel=1e-6)
    assert any(g.abs().sum() > 0 for g in out[0][1])  # a real gradient, not all zeros
    for g0, g1 in zip(out[0][1], out[1][1], strict=True):
        torch.testing.assert_close(g0, g1, atol=1e-6, rtol=1e-5)
    toy = ToyPolicy(ToyModelSpec())
    assert toy.set_activation_checkpointing(True) is False
    assert toy.set_activation_checkpointing(False) is True


def test_bf16_autocast_update_is_close_to_float32():
    """``learner.autocast: bf16``: the learner's gradient accumulation on a real tiny Show-o
    rollout runs its forward in bfloat16 and matches float32 to bf16's precision (8 mantissa
    bits, about 3 significant digits per logit: the log-probability of a step sums hundreds of
    token terms, so the ratio to the float32 behaviour log-probs is 1 within 0.1, not exactly;
    the loss, 0 in float32 (ratio 1, advantages summing to 0), within 0.1), while not being
    bit-equal (the autocast took effect). Weights and gradients stay float32.

    What "bf16's precision" means for the gradient is measured here, not assumed: the same
    accumulation in float32 at the weights rounded to bfloat16 moves the gradient by a cosine
    distance of about 0.02 (the advantages sum to 0, so per-sample gradients cancel and small
    relative errors grow). The autocast gradient must be no further from float32 than twice
    that, for the whole gradient and for its worst tensor. A fixed threshold does not travel:
    the autocast's own distance is 0.008 on a CPU with native bf16 (AVX512-BF16) and 0.024 on
    an AVX2-only one (the same machine's rounded-weights distance: 0.023)."""
    import copy

    from maskgrpo_ray.pipeline.learner_loss import accumulate_gradients

    base, batch = _train_batch()
    rounded = copy.deepcopy(base)
    with torch.no_grad():
        for p in rounded.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    out = []
    for start, mode in ((base, "off"), (base, "bf16"), (rounded, "off")):
        policy = copy.deepcopy(start).train()
        m = accumulate_gradients(
            policy,
            batch,
            train_steps=torch.arange(4),
            micro_batch=3,
            clip_low=0.2,
            clip_high=0.2,
            autocast=mode,
        )
        assert all(p.dtype == torch.float32 for p in policy.parameters())
        grads = [p.grad.clone() for p in policy.transformer.parameters() if p.grad is not None]
        out.append((m["loss"], grads))
        assert m["ratio_mean"] == pytest.approx(1.0, abs=0.1)
    assert out[0][0] == pytest.approx(0.0, abs=1e-6)
    assert out[1][0] == pytest.approx(out[0][0], abs=0.1)

    def cos(a: torch.Tensor, b: torch.Tensor) -> float:
        return float(torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0))

    def distances(grads: list[torch.Tensor]) -> tuple[float, float]:
        """(whole gradient, worst tensor) cosine distance to the float32 gradient."""
        ref = out[0][1]
        every = cos(torch.cat([g.flatten() for g in ref]), torch.cat([g.flatten() for g in grads]))
        worst = min(cos(a, b) for a, b in zip(ref, grads, strict=True) if a.norm() > 1e-8)
        return 1.0 - every, 1.0 - worst

    auto, floor = distances(out[1][1]), distances(out[2][1])
    print(
        f"bf16 autocast vs float32 gradient cosine distance: all {auto[0]:.4f}, worst tensor "
        f"{auto[1]:.4f}; float32 at bf16-rounded weights: all {floor[0]:.4f}, worst {floor[1]:.4f}"
    )
    assert 0.0 < floor[0] < 0.05  # the reference itself: bf16 rounding matters, but not much
    assert auto[0] <= 2 * floor[0] and auto[1] <= 2 * floor[1]
    assert all(g.dtype == torch.float32 for g in out[1][1])
    assert any(not torch.equal(a, b) for a, b in zip(out[0][1], out[1][1], strict=True))
