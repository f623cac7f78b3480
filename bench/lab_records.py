"""The lab's records (``bench/records/<key>.json``): the key's config part, the fields that
differ from the config schema's defaults (a field added later at a default that keeps today's
behaviour keeps every record), and committing a record the moment it lands (``--commit``)."""

from __future__ import annotations

import contextlib
import json
import subprocess
from pathlib import Path
from typing import Any


def schema_defaults() -> dict[str, Any]:
    """Every config field's schema default as ``{"section.field": value}`` (JSON values; a
    field without a default is absent)."""
    from pydantic import BaseModel

    from maskgrpo_ray.config import Config

    out: dict[str, Any] = {}

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, f in model.model_fields.items():
            ann = f.annotation
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                walk(ann, f"{prefix}{name}.")
            elif not f.is_required():
                v = f.get_default(call_default_factory=True)
                # a default with no JSON form: its field is always in the key
                with contextlib.suppress(TypeError):
                    out[f"{prefix}{name}"] = json.loads(json.dumps(_jsonable(v)))

    walk(Config, "")
    return out


def _jsonable(v: Any) -> Any:
    from pydantic import BaseModel

    if isinstance(v, BaseModel):
        return v.model_dump(mode="json")
    if isinstance(v, list | tuple):
        return [_jsonable(x) for x in v]
    return v


def non_default(resolved: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """The flattened ``resolved`` config's fields whose value is not the schema default."""
    flat: dict[str, Any] = {}

    def walk(d: dict[str, Any], prefix: str) -> None:
        for k, v in d.items():
            path = f"{prefix}{k}"
            if path in defaults:  # a field with a default: kept where it differs
                if defaults[path] != v:
                    flat[path] = v
            elif isinstance(v, dict):  # a section: its fields
                walk(v, path + ".")
            else:  # a field without a default (or one whose default has no JSON form)
                flat[path] = v

    walk(resolved, "")
    return flat


def commit_record(root: Path, path: Path, what: str) -> None:
    """Commit one record file (and nothing else) to the checkout's current branch; a failure
    is said in one line and the batch goes on (the record stays on disk)."""
    git = ["git", "-C", str(root)]
    try:
        subprocess.run([*git, "add", "--", str(path)], check=True, capture_output=True)
        subprocess.run(
            [*git, "commit", "-q", "-m", f"bench record: {what} ({path.stem})", "--", str(path)],
            check=True,
            capture_output=True,
        )
    except (OSError, subprocess.CalledProcessError) as e:
        err = getattr(e, "stderr", b"") or b""
        print(f"record {path.name} not committed: {err.decode(errors='replace').strip() or e}")
