"""The embedded worlds' shipped weights (maskgrpo_ray/worlds/pretrained): what the built-in configs
start from, hash-checked, loaded before the cache, and never for another spec."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from maskgrpo_ray.config import load_config
from maskgrpo_ray.worlds import pretrained
from maskgrpo_ray.worlds.pretrained.__main__ import default_pieces
from maskgrpo_ray.worlds.toy import model as toy_model


def _no_pretraining(*a, **k):
    raise AssertionError("pre-trained although the weights are shipped")


def test_every_shipped_file_is_a_default_piece_and_matches_its_manifest():
    entries = pretrained.manifest()
    pieces = {f"{kind}-{key}.safetensors": spec for kind, key, spec in default_pieces()}
    assert set(pieces) == set(entries)  # every built-in world's piece ships: none pre-trains
    on_disk = {p.name for p in pretrained.HERE.glob("*.safetensors")}
    assert on_disk == set(entries)  # no file outside the manifest, no entry without its file
    for name, entry in entries.items():
        # a shipped file no default spec names is dead weight: a default changed, re-ship
        assert pieces.get(name) == entry["spec"], name
        path = pretrained.HERE / name
        assert pretrained.sha256(path) == entry["sha256"] and path.stat().st_size == entry["bytes"]


def test_the_default_toy_base_loads_shipped_with_an_empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MASKGRPO_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(toy_model, "pretrain", _no_pretraining)
    spec = toy_model.spec_from_config(load_config("toy").model.toy)
    model = toy_model.load_or_pretrain(spec)
    shipped = pretrained.shipped("toy-base", spec.cache_key(), "the toy base model")
    assert shipped is not None and list(tmp_path.iterdir()) == []  # nothing cached: none made
    state = model.state_dict()
    assert state.keys() == shipped.keys()
    for name, tensor in shipped.items():
        assert torch.equal(state[name], tensor), name


def test_the_shipped_file_wins_over_the_cache_and_the_cache_over_pretraining(tmp_path, monkeypatch):
    monkeypatch.setenv("MASKGRPO_CACHE_DIR", str(tmp_path))
    key = toy_model.spec_from_config(load_config("toy").model.toy).cache_key()
    other = {"w": torch.zeros(2)}
    pretrained.store("toy-base", key, other)  # a cache entry of the same key: the shipped file wins
    found = pretrained.find("toy-base", key, "the toy base model")
    assert found is not None and "w" not in found
    pretrained.store("toy-base", "0123456789abcdef", other)  # not shipped: the cache answers
    cached = pretrained.find("toy-base", "0123456789abcdef", "x")
    assert cached is not None and torch.equal(cached["w"], other["w"])
    assert pretrained.find("toy-base", "fedcba9876543210", "x") is None  # neither: pre-train


def test_the_default_shapes_base_starts_without_pretraining(tmp_path, monkeypatch):
    from maskgrpo_ray.worlds.shapes import pretrain
    from maskgrpo_ray.worlds.shapes.model import policy_spec

    monkeypatch.setenv("MASKGRPO_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(pretrain, "pretrain", _no_pretraining)
    monkeypatch.setattr(pretrain, "fit_world_codebook", _no_pretraining)
    spec = policy_spec(load_config("shapes").model.shapes)
    policy = pretrain.load_or_pretrain(spec)
    assert list(tmp_path.iterdir()) == []  # nothing made, nothing cached
    shipped = pretrained.shipped("shapes-base", spec.cache_key(), "the shapes base model")
    assert shipped is not None and policy.state_dict().keys() == shipped.keys()
    assert all(torch.equal(policy.state_dict()[k], v) for k, v in shipped.items())


def test_the_default_shapes_reward_model_starts_without_training(tmp_path, monkeypatch):
    from maskgrpo_ray.worlds.shapes import reward_model
    from maskgrpo_ray.worlds.shapes.model import reward_spec

    monkeypatch.setenv("MASKGRPO_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(reward_model, "train_reward_model", _no_pretraining)
    spec = reward_spec(load_config("shapes").model.shapes)
    model = reward_model.load_or_train(spec)
    assert list(tmp_path.iterdir()) == []  # nothing made, nothing cached
    shipped = pretrained.shipped("shapes-reward", spec.cache_key(), "the shapes reward model")
    assert shipped is not None and model.state_dict().keys() == shipped.keys()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in shipped.items())
    assert not model.training and not any(p.requires_grad for p in model.parameters())


@pytest.fixture
def shipped_copy(tmp_path, monkeypatch):
    """A copy of the shipped folder the loader reads instead (to damage it)."""
    here = tmp_path / "weights"
    shutil.copytree(pretrained.HERE, here, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    monkeypatch.setattr(pretrained, "HERE", here)
    monkeypatch.setattr(pretrained, "MANIFEST", here / "manifest.json")
    key = toy_model.spec_from_config(load_config("toy").model.toy).cache_key()
    return here / f"toy-base-{key}.safetensors", key


def test_a_damaged_shipped_file_is_refused_not_loaded(shipped_copy):
    path, key = shipped_copy
    data = bytearray(path.read_bytes())
    data[-1] ^= 1  # one bit of the last tensor's data
    path.write_bytes(bytes(data))
    with pytest.raises(
        pretrained.ShippedWeightsError, match=r"sha256 .* the manifest says .*reinst"
    ):
        pretrained.find("toy-base", key, "the toy base model")
    path.unlink()
    with pytest.raises(pretrained.ShippedWeightsError, match="is missing; reinstall"):
        pretrained.find("toy-base", key, "the toy base model")


def test_a_shipped_file_made_for_another_spec_is_refused(shipped_copy):
    path, key = shipped_copy
    from safetensors.torch import load_file, save_file

    save_file(load_file(str(path)), str(path), metadata={"key": "0" * 16})
    manifest = json.loads(pretrained.MANIFEST.read_text())
    manifest[path.name]["sha256"] = pretrained.sha256(path)  # the hash matches, the key does not
    pretrained.MANIFEST.write_text(json.dumps(manifest))
    with pytest.raises(pretrained.ShippedWeightsError, match=f"spec key 0{{16}}, not {key}"):
        pretrained.find("toy-base", key, "the toy base model")
