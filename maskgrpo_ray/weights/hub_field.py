"""What a hub-able config value is: :class:`HubField` (declared by the model and reward
modules), :class:`HubRef` and the grammar of a hub id (``hf://org/name[@revision]``).

The ground floor of the hub convention (docs/models.md, "Models by hub id"): no torch, no ray,
no config, no registry, so any room may declare its fields. Resolving ids to local folders is
the driver's work, in :mod:`maskgrpo_ray.weights.hub`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from maskgrpo_ray.errors import UserError

SCHEME = "hf://"
_HUB_ID = re.compile(
    r"^hf://(?P<repo>[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*)(?:@(?P<rev>[^\s@]+))?$"
)


class HubError(UserError):
    """A hub id that cannot be resolved: unreachable, offline and not cached, no such repo or
    revision. One line: the field, the id, the revision, the offline mode and the fix."""


@dataclass(frozen=True)
class HubRef:
    """A hub repository at a revision (None: the default branch, ``main``)."""

    repo_id: str
    revision: str | None = None

    def __str__(self) -> str:
        return SCHEME + self.repo_id + (f"@{self.revision}" if self.revision else "")


@dataclass(frozen=True)
class HubField:
    """A config value that may be a hub id.

    Attributes:
        key: dotted place in the config section that declares it (``showo.showo_path`` in
            ``model``, ``model_name`` in a reward component's ``args``).
        local_prefix: the scheme put before the resolved folder (open_clip's ``local-dir:``).
        allow_patterns / ignore_patterns: the repository files fetched (``snapshot_download``'s
            filters: a repo may hold the same weights in several formats).
        file: a field that takes a file, not a folder: this file of the snapshot (ImageReward's
            ``ImageReward.pt``); it must be in the repository.
    """

    key: str
    local_prefix: str = ""
    allow_patterns: tuple[str, ...] | None = None
    ignore_patterns: tuple[str, ...] | None = None
    file: str = ""


def parse_hub_id(value: Any) -> HubRef | None:
    """The hub id ``value`` spells (``hf://org/name[@revision]``), or None (any other value:
    a local path, a bare name).

    Raises:
        HubError: an ``hf://`` value that is not ``hf://org/name[@revision]``.
    """
    if not isinstance(value, str) or not value.startswith(SCHEME):
        return None
    m = _HUB_ID.match(value)
    if m is None:
        raise HubError(
            f"{value!r} is not a hub id: write hf://org/name or hf://org/name@revision "
            "(a branch, a tag or a commit), or a local folder path"
        )
    return HubRef(m["repo"], m["rev"])
