"""The full-size models, built on the meta device, have exactly the reference state-dict layout."""

from __future__ import annotations

import torch
from showo_helpers import read_json

from maskgrpo_ray.models.magvit import MagvitConfig, MAGVITv2
from maskgrpo_ray.models.showo_loading import ShowoFolderConfig
from maskgrpo_ray.models.showo_phi import PhiConfig, ShowoTransformer


def _layout(module: torch.nn.Module) -> dict[str, tuple[list[int], str]]:
    return {
        k: (list(v.shape), str(v.dtype).removeprefix("torch."))
        for k, v in module.state_dict().items()
    }


def _expected(name: str) -> dict[str, tuple[list[int], str]]:
    return {k: (v["shape"], v["dtype"]) for k, v in read_json(name).items()}


def test_full_size_showo_keys_and_shapes():
    full = read_json("full_size_configs.json")
    cfg = ShowoFolderConfig.from_dict(full["showo_config_512"])  # official config: no Phi dims
    phi_json = PhiConfig.from_dict(
        {**full["phi_config_json_used"], "vocab_size": full["vocab"]["vocab_size"]}
    )
    assert cfg.phi == phi_json  # Phi-1.5 defaults == the phi-1_5 config.json dimensions
    with torch.device("meta"):
        model = ShowoTransformer(cfg.phi)
    got, want = _layout(model), _expected("showo_512_state_keys.json")
    assert sorted(got) == sorted(want)
    assert got == want
    assert len(got) == full["counts"]["showo_state_keys"]
    assert sum(p.numel() for p in model.parameters()) == full["counts"]["showo_numel"]


def test_full_size_magvit_keys_and_shapes():
    full = read_json("full_size_configs.json")
    cfg = MagvitConfig.from_dict(full["magvitv2"])
    assert cfg == MagvitConfig()  # our defaults are the full-size tokenizer
    with torch.device("meta"):
        model = MAGVITv2(cfg)
    got, want = _layout(model), _expected("magvitv2_state_keys.json")
    assert sorted(got) == sorted(want)
    assert got == want
    counts = full["counts"]
    assert sum(p.numel() for p in model.parameters()) == counts["magvit_param_numel"]
    assert sum(p.numel() for p in model.encoder.parameters()) == counts["magvit_encoder_numel"]
    assert sum(p.numel() for p in model.decoder.parameters()) == counts["magvit_decoder_numel"]
