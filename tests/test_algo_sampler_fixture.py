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
def test_rollout_equals_the_show_o_loop_at_other_gumbel_temperatures(showo_fixtures, tau0):
    # The recorded run has tau_0 = 1 = sampling temperature. On fixed logits (the fixture's
    # step-0 guided logits for every state) and tau_0 != 1, our sampler must equal the reference
    # loop of showo_helpers (checked bit for bit against t2i_generate in test_showo_fixtures) run
    # with Show-o's `temperature` = tau_0. Whether tau_0 changes these fixtures' result is up to
    # the fixtures; that tau is applied where Show-o applies it is the next test's, on a case
    # built so that it must.
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
    ours = rollout(
        fixed,
        init,
        vocab,
        num_steps=steps,
        temperature=1.0,
        gumbel_temperature=tau0,
        kind="p1",
        generator=torch.Generator().manual_seed(seed),
    ).final_tokens
    torch.testing.assert_close(ours, ref, rtol=0, atol=0)


def test_rollout_takes_the_gumbel_temperature_where_show_o_does():
    # A case where tau must matter. N = 64 rows, L = 2 positions, V = 101, S = 2 steps, both
    # positions masked. Position 0 puts logit 0 on tokens 0..99 and -inf on token 100, position 1
    # logit 0 on all 101: whatever token is drawn, its confidence is c_0 = 1/100, c_1 = 1/101,
    # and softmax(logits / T) is the same for every sampling temperature T (so the draws are
    # too). Step 0 keeps m_0 = max(1, min(2 - 1, floor(2 cos(pi/4)))) = 1 position masked: the
    # lower score log c_i + tau g_i, with tau = tau_0 (1 - 1/2) and g_i iid Gumbel.
    # - tau_0 = 0: scores log c, so position 1 is remasked and position 0 committed at step 0
    #   in every row, for every generator and every T.
    # - tau_0 = 0.5 (tau = 0.25): position 1 is committed first iff g_1 - g_0 > log(101/100) / tau
    #   = 0.0398; g_1 - g_0 is standard logistic, so each row flips with probability
    #   1 / (1 + e^0.0398) = 0.490, independently. No row flips with probability 0.51^64 = 2e-19
    #   and all do with 0.49^64 = 1e-20: over generators this case shows the noise with
    #   certainty up to 1e-18; with the fixed one below it is a fixed outcome.
    # A sampler that scaled the noise by the sampling temperature (the swap) would flip rows at
    # T = 0.5, tau_0 = 0; one that ignored tau_0 would flip none at tau_0 = 0.5.
    n, vocab, steps = 64, 101, 2
    logits = torch.zeros(n, 2, vocab)
    logits[:, 0, 100] = float("-inf")
    init = torch.full((n, 2), vocab)

    def fixed(tokens: torch.Tensor) -> torch.Tensor:
        return logits

    def ours(temperature: float, tau0: float) -> tuple[torch.Tensor, torch.Tensor]:
        traj = rollout(
            fixed,
            init,
            vocab,
            num_steps=steps,
            temperature=temperature,
            gumbel_temperature=tau0,
            kind="p2",
            generator=torch.Generator().manual_seed(0),
        )
        return traj.final_tokens, traj.unmask_step

    first_in_order = torch.tensor([0, 1]).expand(n, 2)  # position 0 at step 0, 1 at step 1
    tokens, order = ours(1.0, 0.0)
    torch.testing.assert_close(order, first_in_order, rtol=0, atol=0)
    tokens_t, order_t = ours(0.5, 0.0)  # the sampling temperature brings no noise in
    torch.testing.assert_close(order_t, first_in_order, rtol=0, atol=0)
    torch.testing.assert_close(tokens_t, tokens, rtol=0, atol=0)  # nor changes these draws
    tokens_g, order_g = ours(1.0, 0.5)
    flipped = int((order_g[:, 1] == 0).sum())
    assert 0 < flipped < n, flipped  # the noise reorders some rows, the confidence the rest
    assert bool((order_g.sort(dim=1).values == torch.tensor([0, 1])).all())  # one per step
    for tau0, got in ((0.0, tokens), (0.5, tokens_g)):  # and exactly as Show-o's loop does
        ref, _, _ = reference_t2i_generate(
            fixed,
            init,
            steps=steps,
            generator=torch.Generator().manual_seed(0),
            gumbel_temperature=tau0,
        )
        torch.testing.assert_close(got, ref, rtol=0, atol=0)
