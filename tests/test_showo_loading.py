"""Loading Show-o / MAGVIT-v2 folders: formats, HF cache, strict keys, tokenizer, export."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from showo_helpers import (
    fixture_prompts,
    read_json,
    showo_config,
    showo_io,
    tensors,
    tiny_magvit,
    tiny_policy,
    tiny_vocab,
    to_codebook,
)

from maskgrpo_ray.models.showo import load_showo_policy
from maskgrpo_ray.models.showo_loading import (
    CheckpointMismatchError,
    load_magvit,
    load_showo_transformer,
    save_magvit_folder,
)
from maskgrpo_ray.models.showo_prompting import load_phi_tokenizer, omni_attention_allow

TOL = dict(atol=1e-4, rtol=1e-4)


def write_official_folder(
    folder: Path, state: dict[str, torch.Tensor], weights: str = "pytorch_model.safetensors"
) -> Path:
    """A folder shaped like the official release: diffusers-style config.json without Phi dims
    (those come from ``llm_model_path``, here a local folder with the tiny Phi config.json)."""
    from safetensors.torch import save_file

    phi_dir = folder.parent / f"{folder.name}-phi"
    phi_dir.mkdir(parents=True)
    (phi_dir / "config.json").write_text(json.dumps(showo_config()["phi_config"]))
    folder.mkdir(parents=True)
    config = {"_class_name": "Showo", **showo_config()["showo_config"]}
    config["llm_model_path"] = str(phi_dir)
    (folder / "config.json").write_text(json.dumps(config))
    if weights.endswith(".bin"):
        torch.save(state, folder / weights)
    else:
        save_file(dict(state), str(folder / weights))
    return folder


def fixture_state() -> dict[str, torch.Tensor]:
    return dict(tensors("tiny_showo_weights.safetensors"))


def assert_reference_logits(model: torch.nn.Module) -> None:
    io = showo_io()
    with torch.no_grad():
        logits = model(io["input_ids"], omni_attention_allow(io["input_ids"], tiny_vocab()))
    torch.testing.assert_close(logits, io["logits"], **TOL)


@pytest.mark.parametrize(
    "weights", ["pytorch_model.safetensors", "model.safetensors", "pytorch_model.bin"]
)
def test_load_each_weight_format(tmp_path: Path, weights: str):
    folder = write_official_folder(tmp_path / "showo", fixture_state(), weights)
    model, cfg = load_showo_transformer(folder)
    assert cfg.num_vq_tokens == showo_config()["showo_config"]["num_vq_tokens"]
    assert_reference_logits(model)


def test_load_from_hugging_face_cache(tmp_path: Path):
    # Hub cache layout: models--{org}--{name}/refs/main -> snapshots/{revision}/
    repo = tmp_path / "hub" / "models--showlab--tiny-show-o"
    revision = "0123456789abcdef0123456789abcdef01234567"
    write_official_folder(repo / "snapshots" / revision, fixture_state())
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    model, _ = load_showo_transformer("showlab/tiny-show-o", cache_dir=tmp_path / "hub")
    assert_reference_logits(model)
    with pytest.raises(FileNotFoundError, match="nothing is downloaded"):
        load_showo_transformer("showlab/not-cached", cache_dir=tmp_path / "hub")


def _mismatch(tmp_path: Path, state: dict[str, torch.Tensor]) -> CheckpointMismatchError:
    folder = write_official_folder(tmp_path / "showo", state)
    with pytest.raises(CheckpointMismatchError) as info:
        load_showo_transformer(folder)
    return info.value


def test_missing_key_is_named(tmp_path: Path):
    state = fixture_state()
    del state["showo.model.layers.1.mlp.fc2.bias"]
    err = _mismatch(tmp_path, state)
    assert err.missing == ["showo.model.layers.1.mlp.fc2.bias"]
    assert "showo.model.layers.1.mlp.fc2.bias" in str(err) and "likely cause" in str(err)


def test_misshaped_key_is_named(tmp_path: Path):
    state = fixture_state()
    key = "showo.model.layers.0.self_attn.q_layernorm.weight"
    state[key] = torch.ones(state[key].shape[0] // 2)
    err = _mismatch(tmp_path, state)
    assert err.misshaped == [key] and not err.missing and not err.unexpected
    assert key in str(err)


def test_unexpected_key_and_stock_phi_are_explained(tmp_path: Path):
    state = {k: v for k, v in fixture_state().items() if "q_layernorm" not in k}
    state = {k: v for k, v in state.items() if "k_layernorm" not in k}
    state["showo.model.rotary_emb.inv_freq"] = torch.ones(4)
    err = _mismatch(tmp_path, state)
    assert err.unexpected == ["showo.model.rotary_emb.inv_freq"]
    assert all("layernorm" in k for k in err.missing) and len(err.missing) > 0
    assert "stock Phi" in str(err)


def test_swapped_paths_are_explained(tmp_path: Path):
    err = _mismatch(tmp_path, dict(tensors("tiny_magvit_weights.safetensors")))
    assert "swapped" in str(err)


def test_magvit_folder_with_and_without_encoder(tmp_path: Path):
    folder = save_magvit_folder(tmp_path / "magvit", tiny_magvit())
    io = tensors("tiny_magvit_io.safetensors")
    full = load_magvit(folder, with_encoder=True)
    with torch.no_grad():
        assert torch.equal(full.get_code(io["encode_input_pixels"]), io["encode_token_ids"])
    decoder_only = load_magvit(folder)
    assert not decoder_only.has_encoder
    with torch.no_grad():
        decoded = decoder_only.decode_code(io["decode_token_ids"])
    torch.testing.assert_close(decoded, io["decoded"], **TOL)


def test_magvit_wrong_lfq_bit_order_fails(tmp_path: Path):
    vq = tiny_magvit()
    vq.quantize.embedding.copy_(vq.quantize.embedding.flip(-1))  # LSB-first: wrong
    folder = save_magvit_folder(tmp_path / "magvit", vq)
    with pytest.raises(ValueError, match="LFQ codebook"):
        load_magvit(folder)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_export_round_trip(tmp_path: Path, dtype: torch.dtype):
    io, vocab, cfg = showo_io(), tiny_vocab(), showo_config()
    policy = tiny_policy()
    policy.save_pretrained(tmp_path / "export")
    assert (tmp_path / "export" / "pytorch_model.safetensors").is_file()
    save_magvit_folder(tmp_path / "magvit", tiny_magvit())
    loaded = load_showo_policy(
        tmp_path / "export",
        tmp_path / "magvit",
        "builtin:integer-ids",
        dtype=dtype,
        max_text_len=cfg["prompting"]["max_text_len"],
    )
    assert loaded.vocab == vocab
    assert {p.dtype for p in loaded.transformer.parameters()} == {dtype}
    assert all(p.requires_grad for p in loaded.transformer.parameters())
    assert not any(p.requires_grad for p in loaded.vq.parameters())
    w = cfg["cfg"]["guidance_scale"]
    with torch.no_grad():
        got = loaded.conditioned(loaded.tokenize(fixture_prompts()), w)(
            to_codebook(io["image_tokens"], vocab)
        )
    want = io[f"guided_codebook_logits_w{w}"]
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, **TOL)
    else:  # bf16 weights and activations: close, not equal
        assert got.dtype == torch.float32
        assert (got - want).abs().max() < 0.1 * want.abs().max()


def make_phi_like_tokenizer(folder: Path, llm_vocab_size: int, eot_id: int) -> None:
    """A word-level stand-in for phi-1_5's tokenizer: ``w{i}`` -> i, ``<|endoftext|>`` = eot_id."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = [f"w{i}" for i in range(llm_vocab_size)]
    words[eot_id] = "<|endoftext|>"
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    eot = "<|endoftext|>"
    hf = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token=eot, eos_token=eot, unk_token="w0"
    )
    hf.save_pretrained(str(folder))


def test_phi_tokenizer_folder_gets_show_o_ids(tmp_path: Path):
    vocab = tiny_vocab()
    make_phi_like_tokenizer(tmp_path / "tok", vocab.llm_vocab_size, vocab.bos_id)
    tok, llm_vocab_size, bos, eos = load_phi_tokenizer(tmp_path / "tok")
    assert (llm_vocab_size, bos, eos) == (vocab.llm_vocab_size, vocab.bos_id, vocab.eos_id)
    hf = tok.hf
    assert hf.convert_tokens_to_ids("[PAD]") == vocab.pad_id
    assert hf.convert_tokens_to_ids("<|t2i|>") == vocab.t2i_id
    assert hf.convert_tokens_to_ids("<|lvg|>") == vocab.image_offset - 1
    assert hf.padding_side == "left"
    assert tok.encode("w3 w17") == [3, 17]  # no BOS added by the tokenizer itself

    # the whole loader with this tokenizer: the prompt "w3 w17" is the integer prompt "3 17"
    policy = tiny_policy()
    policy.save_pretrained(tmp_path / "export")
    save_magvit_folder(tmp_path / "magvit", tiny_magvit())
    max_text_len = showo_config()["prompting"]["max_text_len"]
    loaded = load_showo_policy(
        tmp_path / "export",
        tmp_path / "magvit",
        tmp_path / "tok",
        dtype=torch.float32,
        max_text_len=max_text_len,
    )
    assert torch.equal(loaded.tokenize(["w3 w17"]), policy.tokenize(["3 17"]))


def test_tokenizer_with_wrong_vocabulary_is_rejected(tmp_path: Path):
    vocab = tiny_vocab()
    make_phi_like_tokenizer(tmp_path / "tok", vocab.llm_vocab_size + 5, vocab.bos_id)
    tiny_policy().save_pretrained(tmp_path / "export")
    save_magvit_folder(tmp_path / "magvit", tiny_magvit())
    with pytest.raises(ValueError, match="wrong tokenizer folder"):
        load_showo_policy(tmp_path / "export", tmp_path / "magvit", tmp_path / "tok")


def test_full_size_config_json_needs_no_phi_dims():
    # The official config.json carries no transformer dimensions; Phi-1.5's are the default.
    from maskgrpo_ray.models.showo_loading import ShowoFolderConfig

    full = read_json("full_size_configs.json")
    cfg = ShowoFolderConfig.from_dict(full["showo_config_256"])
    assert cfg.phi.vocab_size == full["vocab"]["vocab_size"]
    assert cfg.vocab().mask_id == full["vocab"]["mask_token_id"]
    assert cfg.vocab().image_offset == full["vocab"]["image_token_offset"]
    assert cfg.vocab().bos_id == full["vocab"]["bos_id"]
