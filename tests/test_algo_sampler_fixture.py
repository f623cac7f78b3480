"""Our recordable sampler reproduces the official Show-o ``t2i_generate`` run bit for bit."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

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
        temperature=float(gen["temperature"]),
        gumbel_temperature=1.0,
        kind="p1",
        generator=g,
    )
    assert len(calls) == steps
    torch.testing.assert_close(traj.final_tokens, io["gen_sampled_ids"], rtol=0, atol=0)
    assert torch.isfinite(traj.old_logp).all()
