"""``python -m maskgrpo_ray.worlds.pretrained``: ship the built-in configs' world weights.

For the default specs of ``configs/toy.yaml`` and ``configs/shapes.yaml``, each piece (the toy
base; the shapes codebook, base and reward model) is copied from the user cache
(``KIND-KEY.pt``, what a run that pre-trained it wrote) into this package folder as
``KIND-KEY.safetensors``, with its sha256 and spec in ``manifest.json``. A piece missing from the
cache is named and skipped (run the config once first: it pre-trains and caches it). Nothing is
pre-trained here.
"""

from __future__ import annotations

import sys
from dataclasses import asdict
from typing import Any

from maskgrpo_ray.weights.safe_files import load_torch_file
from maskgrpo_ray.worlds import pretrained


def default_pieces() -> list[tuple[str, str, dict[str, Any]]]:
    """``(kind, key, spec)`` of every piece the built-in configs' worlds start from."""
    from maskgrpo_ray.config import load_config
    from maskgrpo_ray.worlds.shapes.model import policy_spec, reward_spec, world_spec
    from maskgrpo_ray.worlds.toy.model import spec_from_config

    toy = spec_from_config(load_config("toy").model.toy)
    s = load_config("shapes").model.shapes
    world, base, reward = world_spec(s), policy_spec(s), reward_spec(s)
    return [
        ("toy-base", toy.cache_key(), asdict(toy)),
        ("shapes-codebook", world.key(), asdict(world)),
        ("shapes-base", base.cache_key(), asdict(base)),
        ("shapes-reward", reward.cache_key(), asdict(reward)),
    ]


def main() -> int:
    missing = 0
    for kind, key, spec in default_pieces():
        path = pretrained.cache_path(kind, key)
        if not path.exists():
            print(f"{kind}-{key}: not in the cache ({path}); run its config once first")
            missing += 1
            continue
        out = pretrained.ship(kind, key, load_torch_file(path, f"the cached {kind}"), spec)
        print(f"{out}: {out.stat().st_size} bytes")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
