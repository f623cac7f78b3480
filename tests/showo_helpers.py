"""Shared helpers for the Show-o / MAGVIT-v2 tests: the fixture folder and models built from it.

The fixture folder is ``tests/fixtures/showo_reference`` in the repository (its README says where
each file came from); ``SHOWO_REFERENCE_FIXTURES`` overrides it (absolute, or relative to the
working directory or the repository root). Every size is read from the config files there.
"""

from __future__ import annotations

import functools
import json
import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from maskgrpo_ray.models.base import LogitsFn
from maskgrpo_ray.models.magvit import MagvitConfig, MAGVITv2
from maskgrpo_ray.models.showo import ShowoPolicy
from maskgrpo_ray.models.showo_phi import PhiConfig, ShowoTransformer
from maskgrpo_ray.models.showo_prompting import IntegerIdTokenizer, ShowoVocab

REPO_ROOT = Path(__file__).resolve().parents[1]
ENV_VAR = "SHOWO_REFERENCE_FIXTURES"
DEFAULT = Path("tests") / "fixtures" / "showo_reference"


@functools.cache
def fixture_dir() -> Path:
    """The fixture folder; a test that needs it fails (never skips) when it is not found.

    The default lives in the repository, so a missing folder is a broken checkout or a wrong
    variable, not a reason to pass silently.
    """
    given = os.environ.get(ENV_VAR)
    if not given:
        candidates = [REPO_ROOT / DEFAULT]
    else:
        raw = Path(given).expanduser()
        candidates = (
            [raw] if raw.is_absolute() else list(dict.fromkeys([Path.cwd() / raw, REPO_ROOT / raw]))
        )
    for c in candidates:
        if (c / "tiny_showo_config.json").is_file():
            return c.resolve()
    source = f"{ENV_VAR}={given!r}" if given else f"the default {DEFAULT} ({ENV_VAR} is unset)"
    looked = ", ".join(str(c) for c in candidates)
    pytest.fail(
        f"Show-o reference fixtures not found: no tiny_showo_config.json from {source}; "
        f"looked in {looked}. Restore the repository's {DEFAULT} (git checkout -- {DEFAULT}) "
        f"or set {ENV_VAR}=/path/to/showo_reference "
        "(absolute, or relative to the working directory or the repository root).",
        pytrace=False,
    )


def read_json(name: str) -> dict[str, Any]:
    return json.loads((fixture_dir() / name).read_text())


@functools.cache
def tensors(name: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(fixture_dir() / name))


def showo_config() -> dict[str, Any]:
    return read_json("tiny_showo_config.json")


def showo_io() -> dict[str, torch.Tensor]:
    return tensors("tiny_showo_io.safetensors")


def magvit_io() -> dict[str, torch.Tensor]:
    return tensors("tiny_magvit_io.safetensors")


def tiny_vocab() -> ShowoVocab:
    v = showo_config()["vocab"]
    vocab = ShowoVocab(
        llm_vocab_size=v["llm_vocab_size"],
        codebook_size=v["codebook_size"],
        bos_id=v["bos_id"],
        eos_id=v["eos_id"],
        num_new_special_tokens=v["num_new_special_tokens"],
    )
    # the fixture's own record of the layout must agree with the derived one
    assert (vocab.pad_id, vocab.soi_id, vocab.eoi_id, vocab.t2i_id) == (
        v["pad_id"],
        v["soi_id"],
        v["eoi_id"],
        v["t2i_id"],
    )
    assert (vocab.image_offset, vocab.mask_id, vocab.vocab_size) == (
        v["image_token_offset"],
        v["mask_token_id"],
        v["vocab_size"],
    )
    return vocab


def tiny_transformer() -> ShowoTransformer:
    model = ShowoTransformer(PhiConfig.from_dict(showo_config()["phi_config"]))
    model.load_state_dict(tensors("tiny_showo_weights.safetensors"), strict=True)
    return model.eval()


def tiny_magvit() -> MAGVITv2:
    model = MAGVITv2(MagvitConfig.from_dict(read_json("tiny_magvit_config.json")))
    model.load_state_dict(tensors("tiny_magvit_weights.safetensors"), strict=True)
    return model.eval()


def tiny_policy(reuse_text_prefix: bool = True) -> ShowoPolicy:
    cfg = showo_config()
    vocab = tiny_vocab()
    return ShowoPolicy(
        tiny_transformer(),
        tiny_magvit(),
        IntegerIdTokenizer(vocab.llm_vocab_size),
        vocab,
        num_image_tokens=cfg["prompting"]["num_vq_tokens"],
        max_text_len=cfg["prompting"]["max_text_len"],
        reuse_text_prefix=reuse_text_prefix,
    )


def fixture_prompts() -> list[str]:
    """The fixture's conditional prompts as space-separated integer ids."""
    io = showo_io()
    return [
        " ".join(str(int(t)) for t in row[: int(n)])
        for row, n in zip(io["text_token_ids"], io["text_lengths"])
    ]


def to_codebook(ids: torch.Tensor, vocab: ShowoVocab) -> torch.Tensor:
    """Vocabulary ids of image tokens -> codebook space (mask id -> V)."""
    return torch.where(ids == vocab.mask_id, vocab.codebook_size, ids - vocab.image_offset)


def reference_t2i_generate(
    logits_fn: LogitsFn,
    image_tokens: torch.Tensor,  # [B, L] codebook space, masked = V
    *,
    steps: int,
    generator: torch.Generator,
    gumbel_temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Show-o's sampling loop (showlab/Show-o ``t2i_generate``), same RNG order.

    ``gumbel_temperature`` is ``t2i_generate``'s ``temperature`` argument: it scales only the
    Gumbel noise of the re-masking (``mask_by_random_topk``) and anneals as
    ``temp <- temp * (1 - r)``. Show-o samples from ``softmax(logits)``: no sampling temperature.

    Returns (last sampled tokens [B, L], final state [B, L], the state fed at each step).
    """
    v = logits_fn(image_tokens).shape[-1]
    cur = image_tokens.clone()
    b, big_l = cur.shape
    temp = gumbel_temperature
    states, sampled = [], cur
    for step in range(steps):
        states.append(cur.clone())
        probs = logits_fn(cur).softmax(-1)  # [B, L, V]
        sampled = torch.multinomial(probs.reshape(-1, v), 1, generator=generator).view(b, big_l)
        unknown = cur == v
        sampled = torch.where(unknown, sampled, cur)
        ratio = (step + 1) / steps
        mask_ratio = torch.cos(torch.tensor(ratio) * math.pi * 0.5)  # float32 0-d
        mask_len = (big_l * mask_ratio).floor().reshape(1, 1)
        mask_len = torch.clamp(torch.minimum(unknown.sum(-1, keepdim=True) - 1, mask_len), min=1)
        conf = probs.gather(-1, sampled.clamp(max=v - 1)[..., None]).squeeze(-1)
        conf = torch.where(unknown, conf, torch.finfo(torch.float32).max)
        temp = temp * (1.0 - ratio)
        u = torch.zeros(b, big_l).uniform_(0, 1, generator=generator)
        gumbel = -torch.log((-torch.log(u.clamp(min=1e-20))).clamp(min=1e-20))
        score = torch.log(conf.clamp(min=1e-20)) + temp * gumbel
        cut = score.sort(dim=-1).values.gather(1, mask_len.long())
        cur = torch.where(score < cut, v, sampled)
    return sampled, cur, states
