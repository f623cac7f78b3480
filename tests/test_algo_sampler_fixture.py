"""Our recordable sampler reproduces the official Show-o ``t2i_generate`` run bit for bit."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from showo_helpers import reference_t2i_generate

from maskgrpo_ray.algo.sampling import rollout


def test_rollout_reproduces_reference_generation(showo_fixtures):
    cfg = json.loads((showo_fixtures / "tiny_showo_config.json").read_text())
    io = load_file(str(showo_fixtures / "tiny_showo_io.safetensors"))
    gen = cfg["generation"]
    steps = int(gen["timesteps"])
    logits_per_step = io["gen_step_guided_codebook_logits"]  # [S, B, L, V]
    b, length, vocab = logits_per_step.shape[1:]
    offset = (
        int(cfg["vocab"]["image_token_offset"])
        if "image_token_offset" in cfg["vocab"]
        else (int(cfg["vocab"]["llm_vocab_size"]) + int(cfg["vocab"]["num_new_special_tokens"]))
    )
    mask_id = offset + vocab
    image = io["image_tokens"]  # [B, L] vocabulary ids (mask = mask_id)
    init = torch.where(image == mask_id, vocab, image - offset)
    calls = []

    def replay(tokens: torch.Tensor) -> torch.Tensor:
        # the logits the reference computed at this step; check our state matches its input
        t = len(calls)
        ref_state = io["gen_step_model_input_ids"][t, :b, -(length + 1) : -1]
        torch.testing.assert_close(
            torch.where(tokens == vocab, mask_id, tokens + offset), ref_state
        )
        calls.append(t)
        return logits_per_step[t]

    g = torch.Generator().manual_seed(int(gen["gen_seed"]))
    traj = rollout(
        replay,
        init,
        vocab,
        num_steps=steps,
        # t2i_generate samples from softmax(logits): it has no sampling temperature. Its
        # `temperature` (the fixture's generation.temperature) only scales the Gumbel noise of
        # the re-masking (mask_by_random_topk), i.e. it is our tau_0.
        temperature=1.0,
        gumbel_temperature=float(gen["temperature"]),
        kind="p1",
        generator=g,
    )
    assert len(calls) == steps
    torch.testing.assert_close(traj.final_tokens, io["gen_sampled_ids"], rtol=0, atol=0)
    assert torch.isfinite(traj.old_logp).all()


@pytest.mark.parametrize("tau0", [0.5, 2.0])
def test_rollout_takes_the_gumbel_temperature_where_show_o_does(showo_fixtures, tau0):
    # The recorded run has tau_0 = 1 = sampling temperature, so swapping the two arguments
    # above would pass it. Here they differ: on fixed logits (the fixture's step-0 guided
    # logits for every state) our sampler must equal the reference loop of showo_helpers
    # (checked bit for bit against t2i_generate in test_showo_fixtures) run with Show-o's
    # `temperature` = tau_0, and must differ from it when the two arguments are swapped.
    cfg = json.loads((showo_fixtures / "tiny_showo_config.json").read_text())
    io = load_file(str(showo_fixtures / "tiny_showo_io.safetensors"))
    steps, seed = int(cfg["generation"]["timesteps"]), int(cfg["generation"]["gen_seed"])
    logits = io["gen_step_guided_codebook_logits"][0]  # [B, L, V]
    vocab, offset = logits.shape[-1], int(cfg["vocab"]["image_token_offset"])
    image = io["image_tokens"]
    init = torch.where(image == offset + vocab, vocab, image - offset)  # [B, L], masked = V

    def fixed(tokens: torch.Tensor) -> torch.Tensor:
        return logits

    ref, _, _ = reference_t2i_generate(
        fixed,
        init,
        steps=steps,
        generator=torch.Generator().manual_seed(seed),
        gumbel_temperature=tau0,
    )

    def ours(temperature: float, gumbel_temperature: float) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        return rollout(
            fixed,
            init,
            vocab,
            num_steps=steps,
            temperature=temperature,
            gumbel_temperature=gumbel_temperature,
            kind="p1",
            generator=g,
        ).final_tokens

    torch.testing.assert_close(ours(1.0, tau0), ref, rtol=0, atol=0)
    assert not torch.equal(ours(tau0, 1.0), ref)  # the swap is caught
    assert not torch.equal(ours(1.0, 1.0), ref)  # tau_0 matters on this case
