"""Show-o against the official implementation's outputs (``tests/fixtures/showo_reference``).

Every expectation is a tensor the reference code produced for the stored tiny weights; every
size comes from the fixture's config. Float32, one thread: the README measured bit-exact
reproduction of the reference itself, and suggests atol = rtol = 1e-4 for a clean room.
"""

from __future__ import annotations

import pytest
import torch
from showo_helpers import (
    fixture_prompts,
    reference_t2i_generate,
    showo_config,
    showo_io,
    tiny_policy,
    tiny_transformer,
    tiny_vocab,
    to_codebook,
)

from maskgrpo_ray.models.showo_prompting import (
    additive_mask,
    image_segment,
    omni_attention_allow,
)

TOL = dict(atol=1e-4, rtol=1e-4)


# the reference ran with one thread: bit-level agreement needs the same reduction order
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_prompt_builder_reproduces_reference_sequences():
    io, vocab, policy = showo_io(), tiny_vocab(), tiny_policy()
    p = showo_config()["prompting"]["text_part_len"]
    cond = policy.tokenize(fixture_prompts())  # includes a prompt that must be truncated
    assert torch.equal(cond, io["cond_input_ids"][:, :p])
    assert torch.equal(policy.null_condition(len(cond)), io["uncond_input_ids"][:, :p])
    image = image_segment(to_codebook(io["image_tokens"], vocab), vocab)
    assert torch.equal(torch.cat((cond, image), dim=1), io["cond_input_ids"])


def test_attention_mask_rebuilt_from_input_ids():
    io = showo_io()
    allow = omni_attention_allow(io["input_ids"], tiny_vocab())
    assert torch.equal(allow, io["attention_allow"])
    assert torch.equal(additive_mask(allow), io["attention_mask"])  # the reference's float form


def test_logits_match_reference_at_every_position():
    io = showo_io()
    allow = omni_attention_allow(io["input_ids"], tiny_vocab())
    with torch.no_grad():
        logits = tiny_transformer()(io["input_ids"], allow)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, io["logits"], **TOL)


def test_wrong_mask_is_detected_by_the_tolerance():
    # Sensitivity: dropping the pad rules (the README measured a change of 3.0) must fail TOL,
    # so the logits test above can fail.
    io, vocab = showo_io(), tiny_vocab()
    ids = io["input_ids"]
    in_image = (ids == vocab.soi_id).cumsum(1) > 0
    causal = torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool).tril()
    no_pad_rules = (causal[None] | in_image[:, :, None])[:, None]
    with torch.no_grad():
        logits = tiny_transformer()(ids, no_pad_rules)
    image = slice(showo_config()["prompting"]["soi_index"], None)
    assert (logits[:, image] - io["logits"][:, image]).abs().max() > 1e-2


@pytest.mark.parametrize("reuse", [True, False], ids=["prefix-reuse", "full"])
def test_guided_codebook_logits(reuse: bool):
    io, vocab, cfg = showo_io(), tiny_vocab(), showo_config()
    w = cfg["cfg"]["guidance_scale"]
    policy = tiny_policy(reuse_text_prefix=reuse)
    with torch.no_grad():
        fn = policy.conditioned(policy.tokenize(fixture_prompts()), w)
        got = fn(to_codebook(io["image_tokens"], vocab))
    assert got.shape == (len(got), policy.num_image_tokens, policy.codebook_size)
    torch.testing.assert_close(got, io[f"guided_codebook_logits_w{w}"], **TOL)


def test_generation_step_logits():
    # Each recorded step's model input holds the state; the guided logits must match per step.
    io, vocab, cfg = showo_io(), tiny_vocab(), showo_config()
    image = slice(*cfg["prompting"]["image_slice"])
    policy = tiny_policy()
    inputs = io["gen_step_model_input_ids"]  # [S, 2B, seq]
    b = inputs.shape[1] // 2
    with torch.no_grad():
        fn = policy.conditioned(policy.tokenize(fixture_prompts()), cfg["cfg"]["guidance_scale"])
        for step in range(inputs.shape[0]):
            uncond_state = inputs[step, b:, image]
            assert torch.equal(uncond_state, inputs[step, :b, image])  # shared image state
            got = fn(to_codebook(inputs[step, :b, image], vocab))
            torch.testing.assert_close(got, io["gen_step_guided_codebook_logits"][step], **TOL)


def test_generation_loop_reproduces_reference_samples():
    # With the reference's generator, RNG call order and cumulative temperature, our logits give
    # the same samples, states and final tokens as the official t2i_generate.
    io, vocab, cfg = showo_io(), tiny_vocab(), showo_config()
    gen_cfg, image = cfg["generation"], slice(*cfg["prompting"]["image_slice"])
    policy = tiny_policy()
    with torch.no_grad():
        fn = policy.conditioned(policy.tokenize(fixture_prompts()), cfg["cfg"]["guidance_scale"])
        sampled, final, states = reference_t2i_generate(
            fn,
            to_codebook(io["image_tokens"], vocab),
            steps=gen_cfg["timesteps"],
            generator=torch.Generator().manual_seed(gen_cfg["gen_seed"]),
            gumbel_temperature=gen_cfg["temperature"],  # t2i_generate's Gumbel temperature
        )
    b = len(sampled)
    for step, state in enumerate(states):
        assert torch.equal(
            state, to_codebook(io["gen_step_model_input_ids"][step, :b, image], vocab)
        )
    assert torch.equal(sampled, io["gen_sampled_ids"])
    assert torch.equal(final, to_codebook(io["gen_final_input_ids"][:, image], vocab))
