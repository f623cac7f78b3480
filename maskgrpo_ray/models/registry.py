"""Model kinds by name: ``model.kind`` is looked up here, never branched on.

A kind is one :class:`ModelEntry` registered with :func:`register_model` by the module that
implements it (its schedule, prompting and loading stay behind :class:`MaskedImagePolicy`).
The built-in kinds register on first use (their modules are imported lazily: Show-o's is
large). Any other kind lives in a module named in ``model.plugins``:
:func:`maskgrpo_ray.config.kinds.load_plugins` imports those modules (or ``.py`` files), in every
process that validates a config or builds a policy (the driver, each Ray rollout actor and
learner rank), so a kind registered at import time is found there. Registering a kind also
registers its config rules (its settings section and cross-field check) in
:mod:`maskgrpo_ray.config.kinds`, where validating a config finds them: the config never imports
this registry, and the table of built-in kinds' modules is that module's ``BUILTIN_KINDS``.

The registry also holds named built-in prompt sets (``data.prompts``), since a model's world
can bring its own captions (the toy world's grammar), with their GenEval metadata when they have
it. Callers ask the entry what a kind or a set can do; none branches on its name.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from maskgrpo_ray.config.kinds import BUILTIN_KINDS, KindRules, register_kind, rules_for

if TYPE_CHECKING:
    import torch

    from maskgrpo_ray.config import Config, ModelConfig
    from maskgrpo_ray.models.base import MaskedImagePolicy
    from maskgrpo_ray.weights.hub_field import HubField


GenEvalScorer = Callable[["torch.Tensor", Sequence[Mapping[str, Any]]], dict[str, "torch.Tensor"]]
"""``(images uint8 [N, H, W, 3], metadata of each image) -> {"geneval": float32 [N]}``."""


@dataclass(frozen=True)
class ModelEntry:
    """How to build and check one model kind.

    Attributes:
        build: ``(model_cfg, device) -> MaskedImagePolicy``; ``model_cfg`` is the whole
            ``model`` config section (a kind without a section of its own reads ``model.args``).
        config_section: the pydantic model of the kind's settings. A kind that is not one of the
            sections of ``ModelConfig`` (``toy``, ``showo``) has ``model.args`` validated by it.
        check: cross-field rules on the whole :class:`Config`; raises ``ValueError`` whose
            message names the field, the value and the fix.
        prepare: run once in the driver before any actor starts (e.g. pre-train and cache the
            base model so that actors load it instead of each building it).
        check_files: ``model_cfg -> None``, before anything starts (``maskgrpo validate``
            too): the files the kind reads exist (nothing downloaded, nothing built); raises a
            ``UserError`` naming the field, the path and the fix.
        reward_defaults: ``(model_cfg, reward_kind) -> kwargs`` that a reward component of that
            kind gets unless its ``args`` set them (e.g. the toy rules reward's ``grid``).
        hub_fields: the fields of the ``model`` section that take a Hugging Face hub id
            (``org/name[@revision]``) besides a local path; :func:`maskgrpo_ray.weights.hub.resolve_config`
            replaces those ids by local snapshot folders in the driver before any actor starts.
        geneval_rule: ``model_cfg -> scorer``, where ``scorer(images uint8 [N, H, W, 3],
            metadata of each image) -> {"geneval": float32 [N]}`` applies GenEval's rule to the
            kind's images by exact detection (the toy world's palette cells); None: the kind
            has no such scorer (its GenEval folders are for the official evaluator).
        correct_images: ``model_cfg -> count``, where ``count(prompt)`` is the number of
            distinct correct images of a prompt of the kind's world (the toy's: every layout
            of the right dots), None where it is not known; evaluation then reports the
            ceiling of ``diversity/distinct`` beside it (``diversity/distinct_ceiling``:
            :func:`maskgrpo_ray.algo.diversity.expected_distinct_fraction`). None: no ceiling.
    """

    build: Callable[[ModelConfig, torch.device], MaskedImagePolicy]
    config_section: type[BaseModel] | None = None
    check: Callable[[Config], None] | None = None
    prepare: Callable[[ModelConfig], None] | None = None
    check_files: Callable[[ModelConfig], None] | None = None
    reward_defaults: Callable[[ModelConfig, str], Mapping[str, Any]] | None = None
    geneval_rule: Callable[[ModelConfig], GenEvalScorer] | None = None
    hub_fields: tuple[HubField, ...] = ()
    correct_images: Callable[[ModelConfig], Callable[[str], int | None]] | None = None


_MODELS: dict[str, ModelEntry] = {}


@dataclass(frozen=True)
class PromptSet:
    """A named built-in prompt set (``data.prompts``).

    Attributes:
        prompts: ``split ("train" | "eval") -> prompt texts``.
        metadata: ``text -> its GenEval metadata line`` (``tag``, ``include``, ...,
            ``prompt``); None: the set's prompts carry no metadata.
    """

    prompts: Callable[[str], list[str]]
    metadata: Callable[[str], Mapping[str, Any]] | None = None


_PROMPT_SETS: dict[str, PromptSet] = {}
_BUILTIN_PROMPT_SETS = {
    "toy": "maskgrpo_ray.worlds.toy.model",
    "shapes": "maskgrpo_ray.worlds.shapes.model",
}


def register_model(kind: str, entry: ModelEntry) -> None:
    """Register ``entry`` under ``kind`` (registering the same entry again is a no-op)."""
    old = _MODELS.get(kind)
    if old is not None and old != entry:
        raise ValueError(f"model kind {kind!r} is already registered ({old.build!r})")
    register_kind(kind, KindRules(entry.config_section, entry.check))  # validating finds them
    _MODELS[kind] = entry


def model_kinds() -> list[str]:
    """Every kind that can be built now: built-ins and registered ones, sorted."""
    return sorted(set(_MODELS) | set(BUILTIN_KINDS))


def get_model(kind: str, plugins: Iterable[str] = ()) -> ModelEntry:
    """The entry of ``kind`` after importing ``plugins``; ValueError naming the known kinds."""
    rules_for(kind, plugins)  # imports the plugins and the built-in kind's module, or refuses
    if kind not in _MODELS:
        raise ValueError(
            f"model.kind={kind!r} has config rules (maskgrpo_ray.config.kinds.register_kind) but "
            "no model; register the kind with maskgrpo_ray.models.registry.register_model"
        )
    return _MODELS[kind]


def entry_for(model: ModelConfig) -> ModelEntry:
    """The entry of a ``model`` config section (its plugins imported first)."""
    return get_model(model.kind, model.plugins)


def build_model(model: ModelConfig, device: torch.device) -> MaskedImagePolicy:
    """``model.kind``'s policy on ``device``."""
    return entry_for(model).build(model, device)


def prepare_model(model: ModelConfig) -> None:
    """Run the kind's one-off preparation (driver side, before actors start); may do nothing."""
    entry = entry_for(model)
    if entry.prepare is not None:
        entry.prepare(model)


def check_model_files(model: ModelConfig) -> None:
    """The kind's file checks (:attr:`ModelEntry.check_files`); may do nothing."""
    entry = entry_for(model)
    if entry.check_files is not None:
        entry.check_files(model)


def reward_defaults(model: ModelConfig, reward_kind: str) -> dict[str, Any]:
    """Keyword defaults the model kind gives a reward component of ``reward_kind``."""
    entry = entry_for(model)
    return dict(entry.reward_defaults(model, reward_kind)) if entry.reward_defaults else {}


def register_prompt_set(
    name: str,
    prompts: Callable[[str], list[str]],
    *,
    metadata: Callable[[str], Mapping[str, Any]] | None = None,
) -> None:
    """Register a named prompt set for ``data.prompts``: ``prompts`` maps a split to its texts,
    ``metadata`` (optional) a text to its GenEval metadata line."""
    _PROMPT_SETS[name] = PromptSet(prompts, metadata)


def prompt_set_names() -> list[str]:
    """Every named prompt set: built-ins and registered ones, sorted."""
    return sorted(set(_PROMPT_SETS) | set(_BUILTIN_PROMPT_SETS))


def get_prompt_set(name: str) -> PromptSet | None:
    """The named prompt set, or None when ``name`` is not one (a file path, then)."""
    if name not in _PROMPT_SETS and name in _BUILTIN_PROMPT_SETS:
        importlib.import_module(_BUILTIN_PROMPT_SETS[name])
    return _PROMPT_SETS.get(name)
