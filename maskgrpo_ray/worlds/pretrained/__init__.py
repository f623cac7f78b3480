"""The embedded worlds' pre-trained weights: shipped in the package, else cached, else made.

A world's base model, codebook and reward model are made from a spec (plain numbers, a seed)
whose hash is its key (``ToyModelSpec.cache_key()``, ``PolicySpec.cache_key()``,
``WorldSpec.key()``, ``RewardModelSpec.cache_key()``). :func:`find` looks for ``KIND-KEY``:

1. shipped in this folder as ``KIND-KEY.safetensors`` (the built-in configs' default specs, so
   ``make run`` and a first ``--config shapes`` run start at once and every machine starts from
   the same weights): the file's sha256 is checked against :data:`MANIFEST` and the key stored in
   its metadata against the spec's, and a mismatch raises :class:`ShippedWeightsError` (one line:
   reinstall) instead of loading anything; safetensors, so loading runs no code;
2. cached in :func:`cache_dir` as ``KIND-KEY.pt`` (``torch.load(weights_only=True)``), written by
   an earlier run that made it;
3. neither: None, and the caller pre-trains (any other spec: a changed field changes the key) and
   :func:`store` caches the result.

``python -m maskgrpo_ray.worlds.pretrained`` copies the built-in configs' weights from the cache
into this folder and rewrites the manifest (a maintainer's step after a change to a default spec
or to the pre-training; the files are committed).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import torch

from maskgrpo_ray.errors import UserError

log = logging.getLogger(__name__)

HERE = Path(__file__).resolve().parent
MANIFEST = HERE / "manifest.json"  # {file name: {"sha256": hex, "bytes": n, "spec": {...}}}


class ShippedWeightsError(UserError, RuntimeError):
    """A shipped weights file that does not match the package's manifest: nothing is loaded."""


def cache_dir() -> Path:
    """``$MASKGRPO_CACHE_DIR`` or ``~/.cache/maskgrpo-ray``."""
    return Path(os.environ.get("MASKGRPO_CACHE_DIR", Path.home() / ".cache" / "maskgrpo-ray"))


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def manifest() -> dict[str, dict]:
    return json.loads(MANIFEST.read_text()) if MANIFEST.exists() else {}


def shipped(kind: str, key: str, what: str) -> dict[str, torch.Tensor] | None:
    """The shipped ``KIND-KEY.safetensors``, checked (see the module doc); None: not shipped."""
    from safetensors import safe_open

    name = f"{kind}-{key}.safetensors"
    entry = manifest().get(name)
    if entry is None:
        return None
    path = HERE / name
    fix = "reinstall maskgrpo-ray (or restore the file from git)"
    if not path.exists():
        raise ShippedWeightsError(f"{path}: {what} listed in {MANIFEST.name} is missing; {fix}")
    digest = sha256(path)
    if digest != entry["sha256"]:
        raise ShippedWeightsError(
            f"{path}: {what} has sha256 {digest[:16]}..., the manifest says "
            f"{entry['sha256'][:16]}...: the file is damaged or was replaced; {fix}"
        )
    with safe_open(str(path), framework="pt") as f:
        stored = (f.metadata() or {}).get("key")
        if stored != key:
            raise ShippedWeightsError(
                f"{path}: {what} was made for spec key {stored}, not {key}; {fix}"
            )
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no iter)
    log.info("%s: the shipped weights %s (sha256 checked)", what, path)
    return tensors


def find(kind: str, key: str, what: str) -> dict[str, torch.Tensor] | None:
    """``KIND-KEY``'s tensors, shipped or cached; None when neither has them."""
    found = shipped(kind, key, what)
    if found is not None:
        return found
    path = cache_path(kind, key)
    if not path.exists():
        return None
    from maskgrpo_ray.weights.safe_files import load_torch_file

    return load_torch_file(path, f"the cached {what}")


def cache_path(kind: str, key: str) -> Path:
    return cache_dir() / f"{kind}-{key}.pt"


def store(kind: str, key: str, tensors: dict[str, torch.Tensor]) -> Path:
    """Cache what a run made (``KIND-KEY.pt``), atomically: concurrent builders never see a
    partial file."""
    path = cache_path(kind, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    torch.save(tensors, tmp)
    os.replace(tmp, path)
    return path


def ship(kind: str, key: str, tensors: dict[str, torch.Tensor], spec: dict) -> Path:
    """Write ``KIND-KEY.safetensors`` here and its manifest entry (a maintainer's step)."""
    from safetensors.torch import save_file

    path = HERE / f"{kind}-{key}.safetensors"
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata={"key": key})
    path.chmod(0o644)  # safetensors writes 0600; an installed package's files are world-readable
    entries = manifest()
    entries[path.name] = {"sha256": sha256(path), "bytes": path.stat().st_size, "spec": spec}
    MANIFEST.write_text(json.dumps(dict(sorted(entries.items())), indent=1) + "\n")
    return path
