"""Checkpoint storage: a local/NFS folder or an object store (``s3://bucket/prefix``), via fsspec.

A location holds ``step_000010/`` folders and a ``latest`` pointer (a one-line object naming
one of them). Each checkpoint folder carries ``manifest.json``: every file's relative path,
size in bytes and sha256. The manifest is written last, so a folder without one is an
incomplete upload; the pointer is replaced only after the manifest is in place.

Writing: the caller fills a local staging folder; :meth:`CheckpointStore.save` adds the
manifest and publishes it. On a local filesystem the staging folder sits beside the
checkpoints and is renamed into place (atomic); on an object store it is a temporary folder
uploaded file by file, manifest last. The newest ``keep`` checkpoints are retained.

Reading: :meth:`CheckpointStore.fetch_valid` brings the newest valid checkpoint to a local
folder (in place for a local store) and checks it against its manifest; a corrupt latest
checkpoint is skipped for the previous one with a WARNING naming both and the problem.

Object-store credentials and endpoint come from the environment as the filesystem library
reads them (for S3: ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``,
``AWS_ENDPOINT_URL``, ``AWS_DEFAULT_REGION``, ``AWS_PROFILE``, or the node's IAM role); other
filesystem options come from ``run.storage_options``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

log = logging.getLogger(__name__)

LATEST = "latest"
MANIFEST = "manifest.json"
STEP_PREFIX = "step_"
_HASH_BLOCK = 1 << 20


class CheckpointError(RuntimeError):
    """No usable checkpoint where one was expected; the message names the location and fix."""


def step_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:06d}"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(_HASH_BLOCK):
            h.update(block)
    return h.hexdigest()


def build_manifest(folder: Path) -> dict[str, Any]:
    """``{"files": {relpath: {"size": bytes, "sha256": hex}}}`` of every file under ``folder``."""
    files = {}
    for f in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = f.relative_to(folder).as_posix()
        if rel != MANIFEST:
            files[rel] = {"size": f.stat().st_size, "sha256": sha256_file(f)}
    return {"format": 1, "files": files}


def verify_folder(folder: Path, manifest: Mapping[str, Any]) -> str | None:
    """What is wrong with ``folder`` against ``manifest`` (None: every file is as listed)."""
    for rel, want in manifest["files"].items():
        f = folder / rel
        if not f.is_file():
            return f"file {rel} is missing"
        size = f.stat().st_size
        if size != want["size"]:
            return f"file {rel} has {size} bytes, the manifest says {want['size']} (truncated?)"
        if sha256_file(f) != want["sha256"]:
            return f"file {rel} does not match its sha256 in the manifest (corrupted)"
    return None


class CheckpointStore:
    """The checkpoints of one run at ``location`` (a path or an fsspec URL).

    Args:
        location: ``/mnt/shared/runs/x/checkpoints``, ``s3://bucket/prefix``, ... One location
            per run: two runs given the same one resume each other's checkpoints.
        options: keyword options of the fsspec filesystem (``run.storage_options``).
    """

    def __init__(self, location: str, options: Mapping[str, Any] | None = None) -> None:
        self.location = location
        self.fs, root = fsspec.core.url_to_fs(location, **dict(options or {}))
        self.root = root.rstrip("/")
        self.is_local = isinstance(self.fs, LocalFileSystem)

    def _path(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    # ------------------------------------------------------------------ write

    def save(self, step: int, write: Callable[[Path], None], keep: int) -> str:
        """Call ``write(folder)`` on a local staging folder, publish it as ``step_<step>``
        (manifest last), point ``latest`` at it, drop all but the newest ``keep``.
        Returns the published checkpoint's location."""
        name = step_name(step)
        if self.is_local:
            Path(self.root).mkdir(parents=True, exist_ok=True)
            staging = Path(self.root) / f".tmp-{name}-{os.getpid()}"
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir()
        else:
            staging = Path(tempfile.mkdtemp(prefix=f"maskgrpo-{name}-"))
        try:
            write(staging)
            manifest = build_manifest(staging)
            (staging / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
            if self.is_local:
                self._publish_local(staging, name)
            else:
                self._publish_remote(staging, name, manifest)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        self._write_latest(name)
        self._retain(keep, name)
        return self._display(name)

    def remove_staging(self) -> list[str]:
        """Remove what unfinished writes left at a local location (``.tmp-step_*`` staging
        folders, the ``latest`` pointer's temporary file): a writer killed mid-write never
        reaches its cleanup. Call it before any write of the run (one location per run). The
        paths removed; none for an object store (its staging is a local temporary folder)."""
        if not self.is_local or not Path(self.root).is_dir():
            return []
        gone = []
        for p in sorted(Path(self.root).glob(f".tmp-{STEP_PREFIX}*")) + [
            Path(self._path(f".{LATEST}.tmp"))
        ]:
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            elif p.exists():
                p.unlink()
            else:
                continue
            gone.append(str(p))
        return gone

    def _publish_local(self, staging: Path, name: str) -> None:
        for f in staging.rglob("*"):
            if f.is_file():
                with f.open("rb") as fh:
                    os.fsync(fh.fileno())
        final = Path(self._path(name))
        if final.exists():
            shutil.rmtree(final)
        os.replace(staging, final)

    def _publish_remote(self, staging: Path, name: str, manifest: Mapping[str, Any]) -> None:
        final = self._path(name)
        if self.fs.exists(final):
            self.fs.rm(final, recursive=True)
        for rel in manifest["files"]:
            self.fs.put_file(str(staging / rel), f"{final}/{rel}")
        self.fs.put_file(str(staging / MANIFEST), f"{final}/{MANIFEST}")  # last: complete

    def _write_latest(self, name: str) -> None:
        if self.is_local:
            tmp = Path(self._path(f".{LATEST}.tmp"))
            tmp.write_text(name + "\n")
            os.replace(tmp, self._path(LATEST))
        else:
            self.fs.pipe_file(self._path(LATEST), (name + "\n").encode())  # one PUT: atomic

    def _retain(self, keep: int, newest: str) -> None:
        """Keep ``newest`` and the ``keep - 1`` before it; drop later ones (an earlier timeline
        that a resume from an older checkpoint has replaced)."""
        names = self.list()
        stale = [n for n in names if n > newest]
        if stale:
            log.info("dropping checkpoints after %s from an earlier attempt: %s", newest, stale)
        older = [n for n in names if n < newest]
        for old in stale + older[: max(len(older) - (keep - 1), 0)]:
            self.fs.rm(self._path(old), recursive=True)

    # ------------------------------------------------------------------ read

    def list(self) -> list[str]:
        """The checkpoint names (``step_NNNNNN``) at the location, oldest first."""
        self.fs.invalidate_cache()
        if not self.fs.exists(self.root):
            return []
        names = [p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(self.root, detail=False)]
        return sorted(n for n in names if n.startswith(STEP_PREFIX))

    def latest(self) -> str | None:
        """The name the ``latest`` pointer holds, or None when there is no pointer."""
        path = self._path(LATEST)
        self.fs.invalidate_cache()
        if not self.fs.exists(path):
            return None
        return bytes(self.fs.cat_file(path)).decode().strip() or None

    def has_checkpoints(self) -> bool:
        return self.latest() is not None or bool(self.list())

    def fetch_valid(self, scratch: Path) -> Path | None:
        """The newest valid checkpoint as a local folder, or None when the location has none.

        Tries the one ``latest`` names, then the others newest first; each is brought into
        ``scratch`` (object stores; a local store is checked in place) and checked against its
        manifest. Skipping one logs a WARNING naming it, what was wrong, and the one tried
        next. Raises :class:`CheckpointError` when checkpoints exist but none is valid.
        """
        pointer = self.latest()
        names = self.list()
        if pointer is None and not names:
            return None
        order = sorted(names, reverse=True)
        if pointer is not None:
            order = [pointer] + [n for n in order if n != pointer]
        problems: list[tuple[str, str]] = []
        if pointer is None:
            problems.append((LATEST, "the latest pointer is missing"))
        for name in order:
            if problems:
                bad, why = problems[-1]
                log.warning(
                    "checkpoint %s is not usable: %s; falling back to %s",
                    self._display(bad),
                    why,
                    self._display(name),
                )
            folder, problem = self._fetch_checked(name, scratch)
            if problem is None:
                log.info("checkpoint %s verified against its manifest", self._display(name))
                return folder
            problems.append((name, problem))
        lines = "; ".join(f"{n}: {why}" for n, why in problems)
        raise CheckpointError(
            f"no valid checkpoint at {self.location} ({lines}). Fix: restore the files from a "
            f"backup, or start the run from scratch with a run.storage/--run-dir that holds no "
            f"checkpoints (or delete the checkpoints at {self.location})"
        )

    def _fetch_checked(self, name: str, scratch: Path) -> tuple[Path, str | None]:
        remote = self._path(name)
        if not self.fs.exists(remote):
            return scratch, "it does not exist"
        mpath = f"{remote}/{MANIFEST}"
        if not self.fs.exists(mpath):
            return scratch, f"{MANIFEST} is missing (an incomplete write)"
        try:
            manifest = json.loads(bytes(self.fs.cat_file(mpath)))
            files = manifest["files"]
        except (ValueError, KeyError, TypeError) as err:
            return scratch, f"{MANIFEST} is unreadable ({err})"
        if self.is_local:
            folder = Path(remote)
        else:
            folder = scratch / name
            shutil.rmtree(folder, ignore_errors=True)
            for rel, want in files.items():
                src = f"{remote}/{rel}"
                if not self.fs.exists(src):
                    return folder, f"file {rel} is missing"
                size = self.fs.info(src)["size"]
                if size != want["size"]:
                    return folder, (
                        f"file {rel} has {size} bytes, the manifest says {want['size']} "
                        "(truncated?)"
                    )
                (folder / rel).parent.mkdir(parents=True, exist_ok=True)
                self.fs.get_file(src, str(folder / rel))
            (folder / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        return folder, verify_folder(folder, manifest)

    def _display(self, name: str) -> str:
        if "://" in self.location:
            return f"{self.location.rstrip('/')}/{name}"
        return str(Path(self.location) / name)
