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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from maskgrpo_ray.errors import UserError, one_line

if TYPE_CHECKING:
    from maskgrpo_ray.weights.hub_field import HubField

__all__ = [
    "CompositeReward",
    "EnsembleSpec",
    "REWARD_REGISTRY",
    "Reward",
    "ModelReward",
    "RefreshableReward",
    "RewardSpec",
    "build_reward",
    "check_reward_inputs",
    "default_device",
    "register_reward",
    "reward_refreshes",
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


@runtime_checkable
class RefreshableReward(Protocol):
    """A learned reward that keeps training during RL (``reward.refresh``, Adv-GRPO's online
    reward): reference images of the step's prompts against the policy's samples, with its own
    optimiser (:mod:`maskgrpo_ray.pipeline.reward_refresh` drives it)."""

    name: str

    def start_refresh(self, settings: Any) -> None:
        """Make the model trainable and build its optimiser (``settings``: the config's
        ``reward.refresh`` section: ``learning_rate``, ``updates``, ...)."""

    def refresh(
        self, images: torch.Tensor, prompts: Sequence[str], seed: Sequence[int]
    ) -> dict[str, float]:
        """Train on the policy's ``images`` uint8 ``[N, H, W, 3]`` of ``prompts`` (N str) as
        negatives; deterministic given its inputs and ``seed``. Returns the refresh's figures."""

    def frozen_copy(self) -> Reward:
        """The reward as it is now, never refreshed (what evaluation scores with)."""

    def refresh_state(self) -> dict[str, Any]:
        """The refreshed weights and the optimiser's state (what a checkpoint holds)."""

    def load_refresh_state(self, state: dict[str, Any]) -> None: ...


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


class ModelReward:
    """What the rewards scored by a pretrained model (CLIP, ImageReward) share.

    The device and dtype the model runs in (bf16 on CUDA, fp32 on the CPU), images per forward
    pass, the input checks of the reward contract, and the cumulative counters behind
    ``stats()``. A subclass calls :meth:`_setup` first in its constructor and scores a non-empty,
    checked batch in :meth:`_score`.
    """

    name: str

    def _setup(
        self, name: str, device: str | torch.device | None, batch_size: int, preprocess: str
    ) -> None:
        if preprocess not in ("tensor", "pil"):
            raise ValueError(f"preprocess must be 'tensor' or 'pil', got {preprocess!r}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.name, self.batch_size = name, batch_size
        self.device = default_device(device)
        self.dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self._scored = 0  # prompts scored
        self._truncated = 0  # of them, cut to the text tower's limit

    @torch.inference_mode()
    def __call__(self, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        """Score ``images`` uint8 [N, H, W, 3] against ``prompts`` (N str) -> float32 [N] on CPU."""
        check_reward_inputs(images, prompts)
        if images.shape[0] == 0:
            return torch.zeros(0)
        return self._score(images, prompts)

    def _score(self, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        raise NotImplementedError

    def stats(self) -> dict[str, float]:
        """Cumulative counters: prompts scored and prompts cut to the text tower's limit."""
        return {"prompts_scored": float(self._scored), "prompts_truncated": float(self._truncated)}


def reward_stats(reward: object) -> dict[str, float]:
    """The reward's cumulative counters (``reward.stats()``), or ``{}`` if it keeps none."""
    stats = getattr(reward, "stats", None)
    return dict(stats()) if callable(stats) else {}


@dataclass(frozen=True)
class EnsembleSpec:
    """A term of the reward over several components (``reward.ensemble``): per sample,
    ``mean_m r_m - std_coef * std_m r_m`` (``std`` over the ``M`` members, divided by ``M``) or
    ``min_m r_m``, times ``weight``. A NaN member makes the term NaN."""

    members: tuple[str, ...]
    rule: str = "mean_minus_std"  # "mean_minus_std" | "min"
    std_coef: float = 1.0
    weight: float = 1.0

    def combine(self, parts: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The ensemble's score float ``[N]`` of the members' values ``parts[m]`` ``[N]``."""
        r = torch.stack([parts[m].float() for m in self.members])  # [M, N]
        if self.rule == "min":
            return r.min(dim=0).values  # NaN propagates
        if self.rule != "mean_minus_std":
            raise ValueError(f"ensemble rule {self.rule!r}: expected 'mean_minus_std' or 'min'")
        return r.mean(dim=0) - self.std_coef * r.std(dim=0, correction=0)


class CompositeReward:
    """Weighted sum of rewards: ``total = sum_k w_k * r_k`` with each ``r_k`` reported apart,
    plus ``w_E * E(r_members)`` with an ensemble (:class:`EnsembleSpec`).

    Args:
        parts: ``(reward, weight)`` pairs; the rewards' ``name`` must be distinct (they key the
            per-reward report).
        ensemble: an ensemble term over some of the parts (their weights 0), or None.
        diversity_embedding: the part whose ``embed`` the diversity figures are measured in
            (``reward.diversity_embedding``); None: the heaviest part that has one
            (:mod:`maskgrpo_ray.algo.diversity`).
        train_embedding: the part whose ``embed`` ``train.diversity``'s own figures
            (``diversity_train/*``) are measured in; None: it reads the reported ones.
        judge: a reward that is no part of the sum, whose ``accuracy`` is the composite's
            (the evaluation's GenEval scorer, ``eval.geneval``); None: a part's ``accuracy``.
    """

    name = "total"

    def __init__(
        self,
        parts: Sequence[tuple[Reward, float]],
        *,
        diversity_embedding: str | None = None,
        train_embedding: str | None = None,
        ensemble: EnsembleSpec | None = None,
        judge: Reward | None = None,
    ) -> None:
        self.judge = judge
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
        embeds = [n for n, r in self.rewards.items() if callable(getattr(r, "embed", None))]
        for field_name, named in (
            ("diversity_embedding", diversity_embedding),
            ("train_embedding", train_embedding),
        ):
            if named is not None and named not in embeds:
                raise ValueError(
                    f"{field_name}={named!r} is no reward part with an image embedding; the "
                    f"parts that have one: {embeds} (of {names})"
                )
        self.diversity_embedding = diversity_embedding
        self.train_embedding = train_embedding
        missing = [m for m in (ensemble.members if ensemble else ()) if m not in self.rewards]
        if missing:
            raise ValueError(f"ensemble members {missing} are no reward part (of {names})")
        self.ensemble = ensemble

    def total(self, parts: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """``sum_k w_k r_k`` (+ the ensemble's weighted term) float32 ``[N]`` of the parts'
        unweighted values; a NaN part makes the total NaN whatever its weight."""
        first = next(iter(parts.values()))
        total = torch.zeros(first.shape[0], dtype=torch.float32)  # [N]
        for name, values in parts.items():
            if values.shape != total.shape:
                raise ValueError(f"reward {name!r} returned {tuple(values.shape)}, expected [N]")
            total += self.weights[name] * values
        if self.ensemble is not None:
            total += self.ensemble.weight * self.ensemble.combine(parts)
        return total

    def score(
        self, images: torch.Tensor, prompts: Sequence[str]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Score every reward once.

        Returns:
            ``total`` float32 [N] (the weighted sum) and ``parts`` name -> unweighted float32 [N].
        """
        check_reward_inputs(images, prompts)
        parts = {name: r(images, prompts).float().cpu() for name, r in self.rewards.items()}
        return self.total(parts), parts

    def __call__(self, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        return self.score(images, prompts)[0]

    def stats(self) -> dict[str, float]:
        """Every part's counters (and the judge's), keyed ``"<name>/<counter>"``."""
        named = {**self.rewards, **({self.judge.name: self.judge} if self.judge else {})}
        return {f"{n}/{k}": v for n, r in named.items() for k, v in reward_stats(r).items()}


# --------------------------------------------------------------------------- factory

RewardFactory = Callable[..., Reward]
REWARD_REGISTRY: dict[str, RewardFactory] = {}
"""kind -> factory called with the spec's keyword arguments (and ``device`` where it takes one)."""
_TAKES_DEVICE: set[str] = set()

# Kinds whose module registers them on import; imported by build_reward on first use.
_BUILTIN_KIND_MODULES = {
    "clip": "maskgrpo_ray.rewards.clip",
    "imagereward": "maskgrpo_ray.rewards.imagereward",
    "geneval": "maskgrpo_ray.rewards.geneval",
    "pickscore": "maskgrpo_ray.rewards.pickscore",
    "toy_rules": "maskgrpo_ray.worlds.toy.rewards",
    "toy_geneval": "maskgrpo_ray.worlds.toy.rewards",
    "shapes_clip": "maskgrpo_ray.worlds.shapes.rewards",
    "shapes_judge": "maskgrpo_ray.worlds.shapes.rewards",
    "sim_cost": "maskgrpo_ray.rewards.sim_cost",
}


_CHECK_FILES: dict[str, Callable[..., None]] = {}
_HUB_FIELDS: dict[str, tuple[HubField, ...]] = {}
_EMBEDS: set[str] = set()  # kinds with embed(images): diversity/pairwise, diversity/nn
_REFRESHES: set[str] = set()  # kinds that are RefreshableReward (reward.refresh)


def register_reward(
    kind: str,
    *,
    takes_device: bool = False,
    check_files: Callable[..., None] | None = None,
    hub_fields: tuple[HubField, ...] = (),
    embeds: bool = False,
    refreshes: bool = False,
) -> Callable[[RewardFactory], RewardFactory]:
    """Decorator: make ``factory`` the builder of reward ``kind`` for :func:`build_reward`.

    Args:
        kind: the name used in the config (``"clip"``).
        takes_device: pass ``build_reward``'s ``device`` to the factory as ``device=``.
        check_files: called with the factory's keyword arguments before anything starts
            (:func:`check_reward_files`): raises a ``UserError`` when the reward's files are
            not here, without building the model.
        hub_fields: the ``args`` that take a Hugging Face hub id; the driver replaces them by
            local snapshot folders before any actor starts (:mod:`maskgrpo_ray.weights.hub`).
        embeds: the reward has ``embed(images) -> float [N, D]`` (a space the diversity
            figures ``diversity/pairwise`` and ``diversity/nn``, and ``train.diversity``, can
            be measured in; ``reward.diversity_embedding`` may name only such a component).
        refreshes: the built reward is a :class:`RefreshableReward` (``reward.refresh.component``
            may name only such a component).
            A reward with ``layouts(images) -> list of N hashable keys`` (equal for the same
            detected layout) gives ``diversity/layouts``; that method is found on the built
            reward, no flag declares it (:mod:`maskgrpo_ray.algo.diversity`).
    """

    def decorate(factory: RewardFactory) -> RewardFactory:
        if kind in REWARD_REGISTRY and REWARD_REGISTRY[kind] is not factory:
            raise ValueError(f"reward kind {kind!r} is registered twice")
        REWARD_REGISTRY[kind] = factory
        if takes_device:
            _TAKES_DEVICE.add(kind)
        if check_files is not None:
            _CHECK_FILES[kind] = check_files
        if hub_fields:
            _HUB_FIELDS[kind] = hub_fields
        if embeds:
            _EMBEDS.add(kind)
        if refreshes:
            _REFRESHES.add(kind)
        return factory

    return decorate


class RewardDependencyMissing(UserError, ImportError):
    """A reward kind whose Python package is not installed."""


class RewardKindUnknown(UserError, ValueError):
    """A reward kind that no module registered."""


def reward_hub_fields(kind: str) -> tuple[HubField, ...]:
    """The ``args`` of reward ``kind`` that take a hub id (its module imported first)."""
    _factory(kind)
    return _HUB_FIELDS.get(kind, ())


def reward_embeds(kind: str) -> bool:
    """Whether reward ``kind`` (its module imported first) has an image embedding."""
    _factory(kind)
    return kind in _EMBEDS


def reward_refreshes(kind: str) -> bool:
    """Whether reward ``kind`` (its module imported first) can keep training during RL."""
    _factory(kind)
    return kind in _REFRESHES


def check_reward_files(specs: Sequence[RewardSpec]) -> None:
    """Before any actor starts: every reward kind imports and finds its files (no model is
    built, nothing is downloaded unless asked); raises a ``UserError`` naming what is missing."""
    for spec in specs:
        _factory(spec.kind)
        check = _CHECK_FILES.get(spec.kind)
        if check is not None:
            check(**dict(spec.kwargs))


@dataclass(frozen=True)
class RewardSpec:
    """One reward of a composition: its kind, weight, constructor arguments and report name."""

    kind: str
    weight: float = 1.0
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    name: str | None = None  # the key in the per-reward report; default: the kind


def _factory(kind: str) -> RewardFactory:
    if kind not in REWARD_REGISTRY and kind in _BUILTIN_KIND_MODULES:
        try:
            importlib.import_module(_BUILTIN_KIND_MODULES[kind])
        except ImportError as err:
            raise RewardDependencyMissing(
                f"reward kind {kind!r} cannot be used here: {one_line(str(err))}"
            ) from err
    if kind not in REWARD_REGISTRY:
        known = sorted(set(REWARD_REGISTRY) | set(_BUILTIN_KIND_MODULES))
        raise RewardKindUnknown(
            f"unknown reward kind {kind!r}; known kinds: {known}. A new kind registers itself "
            "with @register_reward(kind) in a module imported before build_reward is called"
        )
    return REWARD_REGISTRY[kind]


def build_reward(
    specs: Sequence[RewardSpec | tuple[str, float, Mapping[str, Any]]],
    *,
    device: str | torch.device | None = None,
    diversity_embedding: str | None = None,
    train_embedding: str | None = None,
    ensemble: EnsembleSpec | None = None,
) -> CompositeReward:
    """Build every reward of ``specs`` now (so missing weights fail at start) and compose them.

    Args:
        specs: :class:`RewardSpec` or ``(kind, weight, kwargs)`` tuples.
        device: where model rewards run (``None``: CUDA if present, else CPU).
        diversity_embedding, train_embedding, ensemble: the composite's
            (:class:`CompositeReward`).

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
    return CompositeReward(
        parts,
        diversity_embedding=diversity_embedding,
        train_embedding=train_embedding,
        ensemble=ensemble,
    )
