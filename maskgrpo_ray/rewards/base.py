"""The reward contract, the weighted composition of rewards, and the factory the reward actor calls.

A reward scores each image against its prompt:
``reward(images uint8 [N, H, W, 3], prompts: list of N str) -> float32 [N]`` on the CPU. Mask-GRPO
normalises rewards per group afterwards (paper Eq. 10), so a reward's scale only matters when
several are summed: :class:`CompositeReward` is the weighted sum ``r = sum_k w_k r_k`` and keeps each
``r_k`` for logging.

New kinds join the factory with :func:`register_reward`; the built-in kinds are imported on first
use (see ``_BUILTIN_KIND_MODULES``), so ``import maskgrpo_ray.rewards`` stays light.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

__all__ = [
    "CompositeReward",
    "REWARD_REGISTRY",
    "Reward",
    "RewardSpec",
    "RewardWeightsMissingError",
    "build_reward",
    "check_reward_inputs",
    "default_device",
    "hf_hub_offline",
    "register_reward",
    "reward_stats",
]


@runtime_checkable
class Reward(Protocol):
    """A reward model: ``__call__(images uint8 [N, H, W, 3], prompts) -> float32 [N]`` on the CPU.

    A reward may also define ``stats() -> dict[str, float]`` with cumulative counters (prompts
    scored, prompts truncated, ...); :func:`reward_stats` reads it when present.
    """

    name: str

    def __call__(self, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor: ...


class RewardWeightsMissingError(FileNotFoundError):
    """A reward model's weights (or tokenizer files) are not on this machine.

    Raised when the reward is constructed, so that a reward actor fails at start, not after the
    first rollout. The message names the missing file, where it was looked for, and how to
    provide it.
    """


def hf_hub_offline() -> bool:
    """True when the Hugging Face hub must not be contacted (``HF_HUB_OFFLINE`` set).

    Reads the environment as well as ``huggingface_hub.constants``, which freezes the variable
    when ``huggingface_hub`` is first imported.
    """
    env = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in {"1", "true", "yes", "on"}
    try:
        from huggingface_hub import constants
    except ImportError:  # pragma: no cover - huggingface_hub comes with transformers
        return env
    return env or bool(constants.HF_HUB_OFFLINE)


def find_in_hf_cache(repo_id: str, filename: str, cache_dir: str | None = None) -> str | None:
    """Path of ``filename`` of ``repo_id`` in the Hugging Face cache, or None if not cached."""
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(repo_id, filename, cache_dir=cache_dir)
    return found if isinstance(found, str) and os.path.isfile(found) else None


def hf_cache_dir(cache_dir: str | None = None) -> str:
    """The Hugging Face hub cache folder that a look-up with ``cache_dir`` uses."""
    if cache_dir is not None:
        return str(cache_dir)
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def missing_weights_message(what: str, file: str, looked_in: Sequence[str], how: str) -> str:
    """The text of a :class:`RewardWeightsMissingError`: what, which file, where, and how to fix."""
    places = "\n".join(f"  - {p}" for p in looked_in)
    return (
        f"{what}: file {file!r} not found.\nLooked in:\n{places}\nHow to provide it:\n"
        f"{how}\n  - On a machine without internet set HF_HUB_OFFLINE=1 so that a missing file "
        "fails at once instead of after network time-outs."
    )


def default_device(device: str | torch.device | None) -> torch.device:
    """The device a reward model runs on: the one given, else the current CUDA device, else CPU."""
    if device is not None:
        return torch.device(device)
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def check_reward_inputs(images: torch.Tensor, prompts: Sequence[str]) -> None:
    """Raise ``ValueError`` unless ``images`` is uint8 ``[N, H, W, 3]`` and ``len(prompts) == N``."""
    if not isinstance(images, torch.Tensor) or images.dtype != torch.uint8:
        raise ValueError(
            f"images must be a uint8 tensor [N, H, W, 3], got {type(images).__name__} "
            f"{getattr(images, 'dtype', '')}"
        )
    if images.dim() != 4 or images.shape[-1] != 3:
        raise ValueError(f"images must be [N, H, W, 3] (channels last), got {tuple(images.shape)}")
    if isinstance(prompts, str) or len(prompts) != images.shape[0]:
        raise ValueError(
            f"need one prompt per image: {images.shape[0]} images, "
            f"{'a single str' if isinstance(prompts, str) else len(prompts)} prompts"
        )


def reward_stats(reward: object) -> dict[str, float]:
    """The reward's cumulative counters (``reward.stats()``), or ``{}`` if it keeps none."""
    stats = getattr(reward, "stats", None)
    return dict(stats()) if callable(stats) else {}


class CompositeReward:
    """Weighted sum of rewards: ``total = sum_k w_k * r_k`` with each ``r_k`` reported apart.

    Args:
        parts: ``(reward, weight)`` pairs; the rewards' ``name`` must be distinct (they key the
            per-reward report).
    """

    name = "total"

    def __init__(self, parts: Sequence[tuple[Reward, float]]) -> None:
        if not parts:
            raise ValueError("CompositeReward needs at least one reward")
        names = [r.name for r, _ in parts]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(
                f"reward names must be distinct, {dupes} repeat: the names key the per-reward "
                "report; give each reward its own `name`"
            )
        self.rewards: dict[str, Reward] = {r.name: r for r, _ in parts}
        self.weights: dict[str, float] = {r.name: float(w) for r, w in parts}

    def score(
        self, images: torch.Tensor, prompts: Sequence[str]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Score every reward once.

        Returns:
            ``total`` float32 [N] (the weighted sum) and ``parts`` name -> unweighted float32 [N].
        """
        check_reward_inputs(images, prompts)
        parts = {name: r(images, prompts).float().cpu() for name, r in self.rewards.items()}
        total = torch.zeros(images.shape[0], dtype=torch.float32)  # [N]
        for name, values in parts.items():
            if values.shape != total.shape:
                raise ValueError(f"reward {name!r} returned {tuple(values.shape)}, expected [N]")
            total += self.weights[name] * values
        return total, parts

    def __call__(self, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        return self.score(images, prompts)[0]

    def stats(self) -> dict[str, float]:
        """Every part's counters, keyed ``"<name>/<counter>"``."""
        return {f"{n}/{k}": v for n, r in self.rewards.items() for k, v in reward_stats(r).items()}


# --------------------------------------------------------------------------- factory

RewardFactory = Callable[..., Reward]
REWARD_REGISTRY: dict[str, RewardFactory] = {}
"""kind -> factory called with the spec's keyword arguments (and ``device`` where it takes one)."""
_TAKES_DEVICE: set[str] = set()

# Kinds whose module registers them on import; imported by build_reward on first use.
_BUILTIN_KIND_MODULES = {
    "clip": "maskgrpo_ray.rewards.clip",
    "imagereward": "maskgrpo_ray.rewards.imagereward",
    "toy_rules": "maskgrpo_ray.rewards.rules",
    "toy_geneval": "maskgrpo_ray.rewards.rules",
}


def register_reward(
    kind: str, *, takes_device: bool = False
) -> Callable[[RewardFactory], RewardFactory]:
    """Decorator: make ``factory`` the builder of reward ``kind`` for :func:`build_reward`.

    Args:
        kind: the name used in the config (``"clip"``).
        takes_device: pass ``build_reward``'s ``device`` to the factory as ``device=``.
    """

    def decorate(factory: RewardFactory) -> RewardFactory:
        if kind in REWARD_REGISTRY and REWARD_REGISTRY[kind] is not factory:
            raise ValueError(f"reward kind {kind!r} is registered twice")
        REWARD_REGISTRY[kind] = factory
        if takes_device:
            _TAKES_DEVICE.add(kind)
        return factory

    return decorate


@dataclass(frozen=True)
class RewardSpec:
    """One reward of a composition: its kind, weight, constructor arguments and report name."""

    kind: str
    weight: float = 1.0
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    name: str | None = None  # the key in the per-reward report; default: the kind


def _factory(kind: str) -> RewardFactory:
    if kind not in REWARD_REGISTRY and kind in _BUILTIN_KIND_MODULES:
        importlib.import_module(_BUILTIN_KIND_MODULES[kind])
    if kind not in REWARD_REGISTRY:
        known = sorted(set(REWARD_REGISTRY) | set(_BUILTIN_KIND_MODULES))
        raise ValueError(
            f"unknown reward kind {kind!r}; known kinds: {known}. A new kind registers itself "
            "with @register_reward(kind) in a module imported before build_reward is called"
        )
    return REWARD_REGISTRY[kind]


def build_reward(
    specs: Sequence[RewardSpec | tuple[str, float, Mapping[str, Any]]],
    *,
    device: str | torch.device | None = None,
) -> CompositeReward:
    """Build every reward of ``specs`` now (so missing weights fail at start) and compose them.

    Args:
        specs: :class:`RewardSpec` or ``(kind, weight, kwargs)`` tuples.
        device: where model rewards run (``None``: CUDA if present, else CPU).

    Returns:
        The :class:`CompositeReward` ``sum_k weight_k * reward_k``.
    """
    parts: list[tuple[Reward, float]] = []
    for spec in specs:
        if not isinstance(spec, RewardSpec):
            kind, weight, kwargs = spec
            spec = RewardSpec(kind=kind, weight=weight, kwargs=kwargs)
        factory = _factory(spec.kind)
        kwargs = dict(spec.kwargs)
        if spec.kind in _TAKES_DEVICE:
            kwargs.setdefault("device", device)
        if spec.name is not None:
            kwargs["name"] = spec.name  # factories take `name` to support this
        reward = factory(**kwargs)
        parts.append((reward, spec.weight))
    return CompositeReward(parts)
