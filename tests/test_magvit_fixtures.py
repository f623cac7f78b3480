"""MAGVIT-v2 against the official implementation's outputs (decode, pixels, encode, LFQ)."""

from __future__ import annotations

import pytest
import torch
from showo_helpers import magvit_io, read_json, tensors, tiny_magvit

from maskgrpo_ray.models.magvit import lfq_codebook, pixels_to_uint8

TOL = dict(atol=1e-4, rtol=1e-4)


# the reference ran with one thread: bit-level agreement needs the same reduction order
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_lfq_buffers_are_msb_first_codebook():
    # embedding[i, c] = 2 * bit_(D-1-c)(i) - 1; e.g. D = 3: i = 6 = 0b110 -> (+1, +1, -1).
    assert lfq_codebook(3)[6].tolist() == [1.0, 1.0, -1.0]
    stored = tensors("tiny_magvit_weights.safetensors")
    d = read_json("tiny_magvit_config.json")["quantizer"]["codebook_dim"]
    assert torch.equal(stored["quantize.embedding"], lfq_codebook(d))
    assert torch.equal(stored["quantize.power_vals"], tiny_magvit().quantize.power_vals)


def test_code_lookup_and_decode():
    io, vq = magvit_io(), tiny_magvit()
    ids = io["decode_token_ids"]
    side = int(ids.shape[1] ** 0.5)
    assert torch.equal(
        vq.quantize.codes_to_latent(ids, (side, side)), io["decode_codebook_vectors"]
    )
    with torch.no_grad():
        decoded = vq.decode_code(ids)
    torch.testing.assert_close(decoded, io["decoded"], **TOL)
    pixels = ((decoded + 1) / 2).clamp(0, 1) * 255
    torch.testing.assert_close(pixels, io["decoded_pixels_float"], atol=1e-3, rtol=1e-4)


def test_decode_to_uint8():
    io, vq = magvit_io(), tiny_magvit()
    with torch.no_grad():
        images = pixels_to_uint8(vq.decode_code(io["decode_token_ids"]))
    want = io["decoded_images_uint8"]
    assert images.dtype == torch.uint8 and images.shape == want.shape
    diff = (images.int() - want.int()).abs()
    # exact, except +-1 where the reference float sits on a truncation boundary
    ref = io["decoded_pixels_float"].permute(0, 2, 3, 1)
    on_boundary = (ref - ref.round()).abs() < 1e-3
    assert diff.max() <= 1 and bool(on_boundary[diff > 0].all())


def test_encode_quantize_and_roundtrip():
    io, vq = magvit_io(), tiny_magvit()
    with torch.no_grad():
        latents = vq.encode(io["encode_input_pixels"])
        z_q, ids = vq.quantize.quantize(latents)
        roundtrip = vq.decode_code(ids)
    torch.testing.assert_close(latents, io["encode_latents"], **TOL)
    assert torch.equal(z_q, io["encode_quantized"])
    assert torch.equal(ids, io["encode_token_ids"])
    assert torch.equal(vq.get_code(io["encode_input_pixels"]), ids)
    torch.testing.assert_close(roundtrip, io["encode_roundtrip_decoded"], **TOL)
