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

from maskgrpo_ray.models.registry import get_prompt_set

log = logging.getLogger(__name__)


GENEVAL_TAGS = ("single_object", "two_object", "counting", "colors", "position", "color_attr")
TEXT_KEYS = ("prompt", "caption")


class PromptDataError(ValueError):
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
    (``dropped``: reason -> count)."""

    records: list[PromptRecord]
    dropped: dict[str, int] = field(default_factory=dict)
    source: str = ""

    @property
    def texts(self) -> list[str]:
        return [r.text for r in self.records]


def _norm(text: str) -> str:
    return " ".join(str(text).split())


def _object_record(item: dict[str, Any], column: str | None, where: str) -> PromptRecord:
    keys = [column] if column else list(TEXT_KEYS)
    key = next((k for k in keys if k in item), None)
    if key is None:
        raise PromptDataError(
            f"{where}: no prompt text: the object has keys {sorted(item)} but none of "
            f"{keys}; set data.prompt_column (or --prompt-column) to the key that holds it"
        )
    meta = {k: v for k, v in item.items() if k != key}
    return PromptRecord(_norm(item[key]), meta or None, where)


def _file_records(path: Path, column: str | None) -> list[PromptRecord]:
    """Every record of a prompts file, blanks included (dropped later, counted)."""
    name = str(path)
    if path.suffix == ".txt":
        lines = path.read_text().splitlines()
        return [PromptRecord(_norm(x), None, f"{name}:{i + 1}") for i, x in enumerate(lines)]
    if path.suffix in (".json", ".jsonl"):
        if path.suffix == ".json":
            try:
                items = json.loads(path.read_text() or "[]")
            except json.JSONDecodeError as err:
                raise PromptDataError(
                    f"{name}: not valid JSON ({err}); expected a list of strings or of objects "
                    'with a "prompt" or "caption" key'
                ) from err
            if not isinstance(items, list):
                raise PromptDataError(
                    f"{name}: expected a JSON list of prompts, found {type(items).__name__}"
                )
            numbered = [(f"{name}[{i}]", it) for i, it in enumerate(items)]
        else:
            numbered = []
            for i, line in enumerate(path.read_text().splitlines()):
                if not line.strip():
                    continue
                try:
                    numbered.append((f"{name}:{i + 1}", json.loads(line)))
                except json.JSONDecodeError as err:
                    raise PromptDataError(
                        f"{name}:{i + 1}: not valid JSON ({err.msg}); a .jsonl file holds one "
                        "JSON object (or string) per line"
                    ) from err
        out = []
        for where, it in numbered:
            if isinstance(it, str):
                out.append(PromptRecord(_norm(it), None, where))
            elif isinstance(it, dict):
                out.append(_object_record(it, column, where))
            else:
                raise PromptDataError(f"{where}: expected a string or an object, found {it!r}")
        return out
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        names = pq.read_schema(path).names
        keys = [column] if column else list(TEXT_KEYS)
        key = next((k for k in keys if k in names), None)
        if key is None:
            raise PromptDataError(
                f"{name}: no column {' or '.join(repr(k) for k in keys)}; its columns are "
                f"{names}; set data.prompt_column (or --prompt-column) to the one that holds "
                "the prompt text"
            )
        rows = pq.read_table(path).to_pylist()
        return [
            PromptRecord(_norm(r.pop(key) or ""), r or None, f"{name} row {i}")
            for i, r in enumerate(rows)
        ]
    raise PromptDataError(
        f"{name}: unknown prompts format {path.suffix!r}; use .txt, .json, .jsonl or .parquet"
    )


def load_prompt_records(
    spec: str, split: str = "train", *, column: str | None = None, require_tag: bool = False
) -> LoadedPrompts:
    """A registered prompt set's ``split`` (``"toy"``: the toy grammar's train or held-out eval
    split, with GenEval-style metadata), else a prompts file.

    Files: ``.txt`` one prompt a line; ``.json`` a list of strings or of objects (the official
    release's ``{"caption": ...}``); ``.jsonl`` one object or string a line (GenEval's
    ``evaluation_metadata.jsonl``); ``.parquet`` one column. The text is ``column``, else
    ``"prompt"``, else ``"caption"``; the other keys or columns travel as ``meta``. Whitespace
    is normalised; blanks and repeated texts (the first is kept, whatever its metadata) are
    dropped and counted. Raises :class:`PromptDataError` naming the file, the field and the fix.
    """
    prompt_set = get_prompt_set(spec)
    if prompt_set is not None:
        records = []
        for i, text in enumerate(prompt_set(split)):
            meta = None
            if spec == "toy":
                from maskgrpo_ray.toyworld import Caption

                meta = {k: v for k, v in Caption.parse(text).geneval_metadata().items()}
                meta.pop("prompt")
            records.append(PromptRecord(_norm(text), meta, f"{spec}[{split}][{i}]"))
    else:
        path = Path(spec)
        if not path.is_file():
            raise PromptFileMissing(
                f"{spec}: no such prompts file (nor a registered prompt set such as 'toy'); "
                "check data.prompts / data.eval_prompts (or --prompts)"
            )
        records = _file_records(path, column)
    kept: list[PromptRecord] = []
    seen: set[str] = set()
    dropped = {"blank": 0, "duplicate": 0}
    for r in records:
        if not r.text:
            dropped["blank"] += 1
        elif r.text in seen:
            dropped["duplicate"] += 1
        else:
            seen.add(r.text)
            kept.append(r)
    if any(dropped.values()):
        log.warning(
            "%s: dropped %d blank and %d repeated prompts (kept the first of each)",
            spec,
            dropped["blank"],
            dropped["duplicate"],
        )
    if not kept:
        raise PromptDataError(
            f"{spec}: holds no prompts ({dropped['blank']} blank, {dropped['duplicate']} "
            "repeated); fill it, or point data.prompts / --prompts at another file"
        )
    if require_tag:
        for r in kept:
            if not r.meta or r.meta.get("tag") not in GENEVAL_TAGS:
                tag = (r.meta or {}).get("tag")
                raise PromptDataError(
                    f"{r.source}: field 'tag' is {tag!r}; GenEval metadata needs a tag in "
                    f"{list(GENEVAL_TAGS)} on every line (see docs/prompts.md)"
                )
    return LoadedPrompts(kept, {k: v for k, v in dropped.items() if v}, spec)


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
