"""Prompts: loading (a registered prompt set, .txt, .json, .jsonl, .parquet) with their metadata,
deduplication, and a resumable prompt stream."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from maskgrpo_ray.errors import UserError, read_utf8
from maskgrpo_ray.models.registry import get_prompt_set
from maskgrpo_ray.prompts import geneval_schema

log = logging.getLogger(__name__)


TEXT_KEYS = ("prompt", "caption")
FORMATS = (".txt", ".json", ".jsonl", ".parquet")
_COLUMN_FIX = "set data.prompt_column (or --prompt-column) to the one that holds the prompt text"


class PromptDataError(UserError, ValueError):
    """A prompts file that cannot be used; the message names the file, the field and the fix."""


class PromptFileMissing(PromptDataError, FileNotFoundError):
    """The prompts file named is not there."""


@dataclass(frozen=True)
class PromptRecord:
    """One prompt: its text, everything else its line or row held (``meta``: e.g. GenEval's
    ``tag``, ``include``, ``exclude``), and where it came from (``file:line``)."""

    text: str
    meta: dict[str, Any] | None = None
    source: str = ""


@dataclass(frozen=True)
class LoadedPrompts:
    """The prompts of a file or prompt set, after dropping blanks and duplicates
    (``dropped``: reason -> count, reasons ``"blank"`` and ``"duplicate"``)."""

    records: list[PromptRecord]
    dropped: dict[str, int] = field(default_factory=dict)
    source: str = ""

    @property
    def texts(self) -> list[str]:
        return [r.text for r in self.records]


def normalize_text(text: str) -> str:
    """Strip and collapse every run of whitespace to one space: the form prompts are compared,
    deduplicated and excluded in."""
    return " ".join(text.split())


def _text(value: Any, where: str, key: str) -> str:
    """A text field's value, normalised; null is a blank prompt (dropped and counted)."""
    if value is None:
        return ""
    if not isinstance(value, str):
        raise PromptDataError(
            f"{where}: field {key!r} holds {type(value).__name__} {value!r}, not text; "
            f"write the prompt as a string, or {_COLUMN_FIX}"
        )
    return normalize_text(value)


def _object_record(item: dict[str, Any], column: str | None, where: str) -> PromptRecord:
    keys = [column] if column else list(TEXT_KEYS)
    key = next((k for k in keys if k in item), None)
    if key is None:
        raise PromptDataError(
            f"{where}: no prompt text: the object has keys {sorted(item)} but none of "
            f"{keys}; set data.prompt_column (or --prompt-column) to the key that holds it"
        )
    meta = {k: v for k, v in item.items() if k != key}
    return PromptRecord(_text(item[key], where, key), meta or None, where)


def _item_record(item: Any, column: str | None, where: str) -> PromptRecord:
    if isinstance(item, str):
        return PromptRecord(normalize_text(item), None, where)
    if isinstance(item, dict):
        return _object_record(item, column, where)
    raise PromptDataError(
        f"{where}: expected a prompt string or an object with a {'/'.join(TEXT_KEYS)} key, "
        f"found {type(item).__name__} {item!r}; fix that entry"
    )


def _read_text(path: Path) -> str:
    return read_utf8(path, PromptDataError)


def _json_records(path: Path, column: str | None) -> list[PromptRecord]:
    try:
        items = json.loads(_read_text(path) or "[]")
    except json.JSONDecodeError as err:
        raise PromptDataError(
            f"{path}: not valid JSON ({err}); a .json prompts file holds a list of strings or "
            f"of objects with a {' or '.join(repr(k) for k in TEXT_KEYS)} key"
        ) from err
    if not isinstance(items, list):
        raise PromptDataError(
            f"{path}: expected a JSON list of prompts, found a {type(items).__name__}; write a "
            'list such as [{"caption": "..."}], or one object a line in a .jsonl file'
        )
    return [_item_record(it, column, f"{path}[{i}]") for i, it in enumerate(items)]


def _jsonl_records(path: Path, column: str | None) -> list[PromptRecord]:
    out = []
    for i, line in enumerate(_read_text(path).splitlines()):
        where = f"{path}:{i + 1}"
        if not line.strip():
            out.append(PromptRecord("", None, where))  # a blank line: dropped and counted
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as err:
            raise PromptDataError(
                f"{where}: not valid JSON ({err.msg} at column {err.colno}); a .jsonl file holds "
                "one JSON object (or string) per line: fix or remove that line"
            ) from err
        out.append(_item_record(item, column, where))
    return out


def _parquet_records(path: Path, column: str | None) -> list[PromptRecord]:
    from maskgrpo_ray.extras import require

    pa = require("pyarrow", f"the Parquet prompt file {path}")
    pq = require("pyarrow.parquet", f"the Parquet prompt file {path}")

    try:
        schema = pq.read_schema(path)
    except (pa.ArrowException, OSError) as err:
        raise PromptDataError(
            f"{path}: not a readable Parquet file ({err}); check the file, or give the prompts "
            "as .txt, .json or .jsonl"
        ) from err
    keys = [column] if column else list(TEXT_KEYS)
    key = next((k for k in keys if k in schema.names), None)
    if key is None:
        raise PromptDataError(
            f"{path}: no column {' or '.join(repr(k) for k in keys)}; its columns are "
            f"{schema.names}; {_COLUMN_FIX}"
        )
    kind = schema.field(key).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise PromptDataError(
            f"{path}: column {key!r} holds {kind}, not text; its columns are {schema.names}; "
            f"{_COLUMN_FIX}"
        )
    rows = pq.read_table(path).to_pylist()
    return [
        PromptRecord(_text(r.pop(key), f"{path} row {i}", key), r or None, f"{path} row {i}")
        for i, r in enumerate(rows)
    ]


def _file_records(path: Path, column: str | None) -> list[PromptRecord]:
    """Every record of a prompts file, blanks included (dropped later, counted)."""
    suffix = path.suffix.lower()
    if suffix == ".txt":
        lines = _read_text(path).splitlines()
        return [
            PromptRecord(normalize_text(x), None, f"{path}:{i + 1}") for i, x in enumerate(lines)
        ]
    if suffix == ".json":
        return _json_records(path, column)
    if suffix == ".jsonl":
        return _jsonl_records(path, column)
    if suffix == ".parquet":
        return _parquet_records(path, column)
    raise PromptDataError(
        f"{path}: unknown prompts format {path.suffix!r}; use one of {', '.join(FORMATS)} "
        "(docs/prompts.md)"
    )


def _set_records(spec: str, split: str) -> list[PromptRecord]:
    """A registered prompt set's ``split``, with each caption's GenEval metadata when the set
    has it (the toy grammar's)."""
    prompt_set = get_prompt_set(spec)
    assert prompt_set is not None
    records = []
    for i, text in enumerate(prompt_set.prompts(split)):
        meta = None
        if prompt_set.metadata is not None:
            meta = dict(prompt_set.metadata(text))
            meta.pop("prompt", None)  # the record's text
        records.append(PromptRecord(normalize_text(text), meta, f"{spec}[{split}][{i}]"))
    return records


def dedupe(records: Sequence[PromptRecord], spec: str) -> LoadedPrompts:
    """Drop blank texts and repeats of a text (the first occurrence is kept, whatever the
    metadata of the later ones), counting each reason; one log line says what went and why."""
    kept: list[PromptRecord] = []
    first: dict[str, PromptRecord] = {}
    blank: list[str] = []
    repeats: list[str] = []
    conflicts = 0
    for r in records:
        if not r.text:
            blank.append(r.source)
        elif r.text in first:
            repeats.append(f"{r.source} repeats {first[r.text].source}")
            conflicts += r.meta != first[r.text].meta
        else:
            first[r.text] = r
            kept.append(r)
    dropped = {k: len(v) for k, v in (("blank", blank), ("duplicate", repeats)) if v}
    if dropped:
        log.warning(
            "%s: kept %d prompts; dropped %d blank (e.g. %s) and %d repeated texts, the first "
            "occurrence kept (e.g. %s; %d of the repeats had other metadata, which was dropped)",
            spec,
            len(kept),
            len(blank),
            ", ".join(blank[:3]) or "-",
            len(repeats),
            "; ".join(repeats[:3]) or "-",
            conflicts,
        )
    else:
        log.info("%s: %d prompts, no blank or repeated text", spec, len(kept))
    return LoadedPrompts(kept, dropped, spec)


def _check_tags(records: Sequence[PromptRecord]) -> None:
    for r in records:
        tag = (r.meta or {}).get("tag")
        if tag not in geneval_schema.TAGS:
            what = "has no field 'tag'" if tag is None else f"has field 'tag' = {tag!r}"
            raise PromptDataError(
                f"{r.source}: prompt {r.text!r} {what}; GenEval metadata needs a tag, one of "
                f"{list(geneval_schema.TAGS)}, on every line: add it (with 'include', see "
                "docs/prompts.md), write the file with `maskgrpo prompts make --kind geneval`, "
                "or do not require tags"
            )


def load_prompt_records(
    spec: str, split: str = "train", *, column: str | None = None, require_tag: bool = False
) -> LoadedPrompts:
    """A registered prompt set's ``split`` (``"toy"``: the toy grammar's train or held-out eval
    split, with GenEval-style metadata; a set without metadata: none), else a prompts file.

    Files: ``.txt`` one prompt a line; ``.json`` a list of strings or of objects (the official
    release's ``{"caption": ...}``); ``.jsonl`` one object or string a line (GenEval's
    ``evaluation_metadata.jsonl``); ``.parquet`` one column. The text is ``column``, else
    ``"prompt"``, else ``"caption"``; the other keys or columns travel as ``meta``. Whitespace
    is normalised (:func:`normalize_text`); blanks and repeated texts are dropped and counted
    (:func:`dedupe`: the first occurrence is kept, whatever its metadata, in either split).
    ``require_tag``: every prompt must carry a GenEval ``tag``.

    Raises:
        PromptDataError: naming the file, the field (line or row) and the fix, at load, before
            any actor starts; :class:`PromptFileMissing` (also a FileNotFoundError) for a
            missing file.
    """
    if get_prompt_set(spec) is not None:
        records = _set_records(spec, split)
    else:
        path = Path(spec)
        if path.is_dir():
            raise PromptDataError(
                f"{spec}: a folder, not a prompts file; point data.prompts / data.eval_prompts "
                "(or --prompts) at a .txt, .json, .jsonl or .parquet file"
            )
        if not path.is_file():
            raise PromptFileMissing(
                f"{spec}: no such prompts file (nor a registered prompt set such as 'toy'); "
                "check the path in data.prompts / data.eval_prompts (or --prompts)"
            )
        records = _file_records(path, column)
    loaded = dedupe(records, spec)
    if not loaded.records:
        why = ", ".join(f"{v} {k}" for k, v in loaded.dropped.items()) or "nothing in it"
        raise PromptDataError(
            f"{spec}: holds no prompts ({len(records)} entries, dropped: {why}); fill it, or "
            "point data.prompts / data.eval_prompts (or --prompts) at another file"
        )
    if require_tag:
        _check_tags(loaded.records)
    return loaded


def load_prompts(spec: str, split: str = "train", column: str | None = None) -> list[str]:
    """The prompt texts of :func:`load_prompt_records`."""
    return load_prompt_records(spec, split, column=column).texts


def keep_valid_prompts(
    prompts: Sequence[str], check: Callable[[str], Any]
) -> tuple[list[str], int]:
    """Drop prompts ``check`` rejects (it raises ValueError); returns (valid, number dropped)."""
    valid, bad = [], 0
    for p in prompts:
        try:
            check(p)
            valid.append(p)
        except ValueError as err:
            bad += 1
            if bad <= 5:
                log.warning("skipping bad prompt: %s", err)
    if bad:
        log.warning("skipped %d of %d prompts that the policy cannot read", bad, len(prompts))
    if not valid:
        raise ValueError("no valid prompt left after validation; see the warnings above")
    return valid, bad


class PromptStream:
    """An endless, reproducible stream: a fresh seeded permutation per epoch.

    ``position`` counts prompts handed out; the stream at a given position is fully determined
    by (prompts, seed, shuffle), so saving ``position`` is enough to resume exactly.
    """

    def __init__(self, prompts: Sequence[str], seed: int, shuffle: bool = True) -> None:
        self.prompts = list(prompts)
        self.seed, self.shuffle = seed, shuffle
        self.position = 0
        self._epoch = -1
        self._order: list[int] = []

    def _index(self, pos: int) -> int:
        epoch, offset = divmod(pos, len(self.prompts))
        if epoch != self._epoch:
            self._epoch = epoch
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
                self._order = torch.randperm(len(self.prompts), generator=g).tolist()
            else:
                self._order = list(range(len(self.prompts)))
        return self._order[offset]

    def take(self, n: int) -> tuple[list[str], list[int]]:
        """The next ``n`` prompts and their stream positions."""
        positions = list(range(self.position, self.position + n))
        self.position += n
        return [self.prompts[self._index(p)] for p in positions], positions

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = int(state["position"])
