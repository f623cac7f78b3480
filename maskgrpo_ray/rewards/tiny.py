"""Tiny, randomly initialised reward models built from the real classes, for tests and the toy world.

No weights can be downloaded on our machines, so tests (ours and the reward actor's) build the
real ``ClipReward`` / ``ImageRewardReward`` code paths on small configurations:

- :func:`register_tiny_clip` registers a one-layer open_clip config (``"maskgrpo-tiny-clip"``);
- :func:`tiny_imagereward_kwargs` writes a small BERT vocabulary and returns the constructor
  arguments of a one-layer ImageReward (BLIP ViT and BERT from the package's own classes).
"""

from __future__ import annotations

import json
import os
from typing import Any

TINY_CLIP = "maskgrpo-tiny-clip"
_TINY_CLIP_CONFIG = {
    "embed_dim": 32,
    "vision_cfg": {"image_size": 224, "layers": 1, "width": 64, "patch_size": 32, "head_width": 32},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1},
}
_WORDS = "a an the of on in with and red green blue yellow cat dog car tree house two three photo"


def register_tiny_clip(folder: str) -> str:
    """Register the tiny open_clip config (written to ``folder``); returns its model name."""
    import open_clip

    path = os.path.join(folder, f"{TINY_CLIP}.json")
    with open(path, "w") as f:
        json.dump(_TINY_CLIP_CONFIG, f)
    open_clip.add_model_config(path)
    return TINY_CLIP


def tiny_imagereward_kwargs(folder: str) -> dict[str, Any]:
    """Constructor arguments of a tiny random ImageReward; writes its ``vocab.txt`` to ``folder``."""
    from maskgrpo_ray.rewards.imagereward import MED_CONFIG, BlipVisionSpec

    letters = "abcdefghijklmnopqrstuvwxyz"
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *_WORDS.split(), *letters]
    vocab += [f"##{c}" for c in letters]
    vocab = list(dict.fromkeys(vocab))
    with open(os.path.join(folder, "vocab.txt"), "w") as f:
        f.write("\n".join(vocab) + "\n")
    med = dict(
        MED_CONFIG,
        num_hidden_layers=1,
        intermediate_size=64,
        vocab_size=len(vocab) + 2,  # + [DEC], [ENC]
        max_position_embeddings=40,
    )
    return {
        "checkpoint": None,
        "tokenizer": folder,
        "med_config": med,
        "vision": BlipVisionSpec(embed_dim=32, depth=1, num_heads=2),
    }


def spread_imagereward_head(reward: Any) -> None:
    """Re-initialise a random ImageReward's MLP head with unit-gain weights.

    The package initialises the head with std ``1 / 769`` through five linear layers, so a random
    model scores every input the same (``-0.16717 / 1.03334``); tests need scores that vary.
    """
    import torch

    with torch.no_grad():
        for p in reward.model.mlp.parameters():
            if p.dim() == 2:
                torch.nn.init.normal_(p, std=p.shape[1] ** -0.5)
