"""Models and rewards by Hugging Face hub id: resolved once, on the driver, to local folders.

Convention (docs/models.md, "Models by hub id"): a weights field holds a local path, or a hub
id ``hf://org/name`` with an optional ``@revision`` (a branch, a tag or a commit):
``hf://showlab/show-o-512x512@main`` (huggingface_hub's own ``hf://`` scheme). The scheme makes
the request explicit: a mistyped relative path never becomes a download, and a bare
``org/name`` keeps its old meaning (a repository already in the Hugging Face cache, nothing
fetched).

A hub id in the config is the user asking for that repository: it is downloaded when not
cached. ``MASKGRPO_ALLOW_DOWNLOADS`` keeps governing every name the config does not spell as a
hub id (CLIP tags, ImageReward's release, defaults). :func:`resolve_config` runs in the driver
before any actor starts and hands back a config whose hub ids are local snapshot folders, so
actors never touch the hub. ``huggingface_hub`` reads ``HF_HOME``, ``HF_HUB_CACHE``,
``HF_HUB_OFFLINE``, ``HF_TOKEN`` and ``HF_ENDPOINT`` itself: nothing here sets or overrides them.

This is the driver-side resolution. What a hub-able field *is* (:class:`HubField`, the id's
grammar) lives low in the house, in :mod:`maskgrpo_ray.weights.hub_field`, where the model and reward
modules that declare their fields import it; this module reads those declarations (through the
registries, at call time) and is imported by the commands only. No torch, no ray: ``maskgrpo
validate`` imports this module.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm import tqdm as _base_tqdm

from maskgrpo_ray.weights.hub_field import SCHEME, HubError, HubField, HubRef, parse_hub_id

if TYPE_CHECKING:
    from maskgrpo_ray.config import Config

__all__ = [  # the hub-id grammar is importable from here too (its home: hub_field)
    "SCHEME",
    "HubError",
    "HubField",
    "HubRef",
    "Resolved",
    "parse_hub_id",
    "pending_fields",
    "resolve_config",
    "resolve_ref",
]

log = logging.getLogger(__name__)

_TRUE = {"1", "true", "yes", "on"}


@dataclass(frozen=True)
class Resolved:
    """Where a hub id of the config was found: ``folder`` None when it was checked on the hub
    but not downloaded (``maskgrpo validate``)."""

    field: str
    ref: HubRef
    commit: str | None
    folder: Path | None
    cache_hit: bool


def hub_offline() -> bool:
    """``HF_HUB_OFFLINE`` as ``huggingface_hub`` sees it (frozen at its import) or as set now."""
    from huggingface_hub import constants

    env = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE
    return env or bool(constants.HF_HUB_OFFLINE)


class DownloadProgress(_base_tqdm):
    """huggingface_hub's byte and file bars, shown on stderr even when it is not a terminal (a
    Ray job's log, a CI log), at most one refresh a second there; ``HF_HUB_DISABLE_PROGRESS_BARS``
    still turns them off. (huggingface_hub's own class hides them off a terminal.)"""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        off = os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS", "").strip().lower() in _TRUE
        kwargs.setdefault("file", sys.stderr)
        kwargs["disable"] = off
        if not getattr(kwargs["file"], "isatty", lambda: False)():
            kwargs.setdefault("mininterval", 1.0)
        super().__init__(*args, **kwargs)


def _error(field: str, ref: HubRef, why: str) -> HubError:
    offline = hub_offline()
    rev = ref.revision or "main"
    also = "unset HF_HUB_OFFLINE where the hub is reachable, or " if offline else ""
    return HubError(
        f"{field}: hub id {str(ref)!r} (revision {rev}) {why}; HF_HUB_OFFLINE is "
        f"{'on' if offline else 'off'}, endpoint {_endpoint()}; fix: {also}point {field} at a "
        f"local folder holding the repo's files (e.g. `hf download {ref.repo_id} --revision "
        f"{rev} --local-dir DIR` where the hub is reachable)"
    )


def _endpoint() -> str:
    from huggingface_hub import constants

    return str(constants.ENDPOINT)


def _snapshot(ref: HubRef, spec: HubField, **kwargs: Any) -> Path:
    from huggingface_hub import snapshot_download

    allow = list(spec.allow_patterns) if spec.allow_patterns is not None else None
    ignore = list(spec.ignore_patterns) if spec.ignore_patterns is not None else None
    folder = snapshot_download(
        ref.repo_id,
        revision=ref.revision,
        allow_patterns=allow,
        ignore_patterns=ignore,
        tqdm_class=DownloadProgress,
        **kwargs,
    )
    return Path(folder)


def _held_files(folder: Path) -> set[str]:
    if not folder.is_dir():
        return set()
    return {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()}


def resolve_ref(field: str, ref: HubRef, spec: HubField, *, download: bool) -> Resolved:
    """The local snapshot folder of ``ref``: from the cache, else downloaded (``download``,
    the hub reachable), else only checked on the hub (``download`` False, online).

    Raises:
        HubError: one line naming ``field``, the id, the revision, the offline mode and the fix.
    """
    from huggingface_hub import HfApi
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        cached: Path | None = _snapshot(ref, spec, local_files_only=True)
    except LocalEntryNotFoundError:
        cached = None
    offline = hub_offline()
    if cached is not None and (offline or not download):
        return Resolved(field, ref, cached.name, cached, cache_hit=True)
    try:
        if not download:  # validate: the repo and the revision exist, nothing fetched
            if offline:
                raise LocalEntryNotFoundError("offline")
            info = HfApi().repo_info(ref.repo_id, revision=ref.revision)
            return Resolved(field, ref, info.sha, None, cache_hit=False)
        before = _held_files(cached) if cached is not None else set()
        folder = _snapshot(ref, spec)
    except RevisionNotFoundError:
        raise _error(field, ref, "names no revision of that repository") from None
    except GatedRepoError:
        raise _error(field, ref, "is gated: accept its terms and set HF_TOKEN") from None
    except RepositoryNotFoundError:
        raise _error(
            field, ref, "is no repository there (or a private one: set HF_TOKEN)"
        ) from None
    except HfHubHTTPError as err:
        status = err.response.status_code if err.response is not None else "?"
        raise _error(field, ref, f"failed on the hub (HTTP {status})") from None
    except LocalEntryNotFoundError as err:
        why = (
            "is not in the cache and the hub may not be contacted"
            if offline
            else f"cannot be reached and is not in the cache ({_cause(err)})"
        )
        raise _error(field, ref, why) from None
    except Exception as err:  # repo_info (validate) raises the HTTP client's own errors
        if not _is_transport(err):
            raise
        raise _error(field, ref, f"cannot be reached ({type(err).__name__})") from None
    hit = cached == folder and _held_files(folder) == before
    return Resolved(field, ref, folder.name, folder, cache_hit=hit)


def _is_transport(err: BaseException) -> bool:
    """A connection failure of the HTTP client huggingface_hub uses (httpx2, httpx, requests)."""
    from huggingface_hub.errors import OfflineModeIsEnabled

    client = type(err).__module__.split(".")[0] in {"httpx2", "httpx", "requests", "urllib3"}
    return isinstance(err, (OfflineModeIsEnabled, OSError)) or client


def _cause(err: BaseException) -> str:
    while err.__cause__ is not None:
        err = err.__cause__
    return type(err).__name__


def _model_fields(cfg: Config) -> Sequence[HubField]:
    from maskgrpo_ray.models.registry import entry_for

    return entry_for(cfg.model).hub_fields


def _reward_fields(kind: str) -> Sequence[HubField]:
    from maskgrpo_ray.rewards.base import reward_hub_fields

    return reward_hub_fields(kind)


METRIC_FIELDS: dict[str, tuple[HubField, ...]] = {
    # eval.metrics[] specs whose weights (and processor) may be hub ids
    "pickscore": (
        HubField("weights", ignore_patterns=("*.bin", "*.msgpack", "*.h5", "*.onnx*")),
        HubField("processor", allow_patterns=("*.json", "*.txt")),
    ),
    "imagereward": (
        HubField(
            "weights", allow_patterns=("ImageReward.pt", "med_config.json"), file="ImageReward.pt"
        ),
    ),
}
"""Evaluation metrics' hub-able fields, by ``eval.metrics[].kind``."""


def _places(cfg: Config) -> list[tuple[str, list[Any], str, HubField]]:
    """``(config key, path in the tree, key in that node, field)`` of every hub-able value."""
    out: list[tuple[str, list[Any], str, HubField]] = []
    for spec in _model_fields(cfg):
        *head, leaf = ["model", *spec.key.split(".")]
        out.append((".".join([*head, leaf]), list(head), leaf, spec))
    for i, comp in enumerate(cfg.reward.components):
        for spec in _reward_fields(comp.kind):
            parents: list[Any] = ["reward", "components", i, "args", *spec.key.split(".")[:-1]]
            leaf = spec.key.split(".")[-1]
            out.append((f"reward.components[{i}].args.{spec.key}", parents, leaf, spec))
    for i, metric in enumerate(cfg.eval.metrics):
        for spec in METRIC_FIELDS.get(metric.kind, ()):
            out.append((f"eval.metrics[{i}].{spec.key}", ["eval", "metrics", i], spec.key, spec))
    if cfg.eval.geneval is not None:  # the evaluation's GenEval scorer: the reward kind's fields
        for spec in _reward_fields("geneval"):
            out.append((f"eval.geneval.{spec.key}", ["eval", "geneval"], spec.key, spec))
    return out


def _node(tree: Any, path: list[Any]) -> Any:
    for part in path:
        if isinstance(tree, dict):
            tree = tree.get(part)
        elif isinstance(tree, list) and isinstance(part, int) and part < len(tree):
            tree = tree[part]
        else:
            return None
    return tree


def resolve_config(cfg: Config, *, download: bool = True) -> tuple[Config, list[Resolved]]:
    """``cfg`` with every hub id of a weights field replaced by its local snapshot folder.

    Runs once, in the driver, before any actor starts; logs one line per repository (id,
    revision, commit, folder, cache hit). ``download`` False (``maskgrpo validate``): nothing is
    fetched; a repository not in the cache is checked on the hub (or fails, offline) and keeps
    its id in the returned config (``Resolved.folder`` None).

    Raises:
        HubError: a hub id that cannot be resolved (one line).
    """
    from maskgrpo_ray.config import validate_config

    tree = cfg.model_dump(mode="json")
    found: list[Resolved] = []
    for key, parents, leaf, spec in _places(cfg):
        node = _node(tree, parents)
        value = node.get(leaf) if isinstance(node, dict) else None
        try:
            ref = parse_hub_id(value)
        except HubError as err:
            raise HubError(f"{key}: {err}") from None
        if ref is None:
            continue
        res = resolve_ref(key, ref, spec, download=download)
        found.append(res)
        if res.folder is None:
            log.info(
                "hub %s: %s revision %s = commit %s, not downloaded (validate)",
                key, ref.repo_id, ref.revision or "main", res.commit,
            )  # fmt: skip
            continue
        log.info(
            "hub %s: %s revision %s = commit %s at %s (%s)",
            key, ref.repo_id, ref.revision or "main", res.commit, res.folder,
            "cache hit" if res.cache_hit else "downloaded",
        )  # fmt: skip
        assert isinstance(node, dict)
        local = res.folder / spec.file if spec.file else res.folder
        if spec.file and not local.is_file():
            raise _error(key, ref, f"holds no {spec.file} (this field takes that file)")
        node[leaf] = spec.local_prefix + str(local)
    return (validate_config(tree) if found else cfg), found


def pending_fields(found: Sequence[Resolved]) -> set[str]:
    """The config keys whose hub ids were checked but not downloaded (their files unchecked)."""
    return {r.field for r in found if r.folder is None}
