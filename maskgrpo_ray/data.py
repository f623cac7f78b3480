"""Prompts: loading (a registered prompt set, .txt, .json, .jsonl) and a resumable prompt stream."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from maskgrpo_ray.models.registry import get_prompt_set

log = logging.getLogger(__name__)


def load_prompts(spec: str, split: str = "train") -> list[str]:
    """A registered prompt set's ``split`` (``"toy"``: the toy grammar's train or held-out eval
    split; see ``models.registry.register_prompt_set``), else a file of prompts.

    Files: ``.txt`` one prompt a line; ``.json`` a list of strings or of objects with a
    ``"prompt"`` or ``"caption"`` key (the official release's format); ``.jsonl`` one such
    object or string a line. Blank prompts are skipped.
    """
    prompt_set = get_prompt_set(spec)
    if prompt_set is not None:
        return prompt_set(split)
    path = Path(spec)
    if not path.exists():
        raise FileNotFoundError(f"data.prompts={spec!r}: no such file (or a registered prompt set)")
    if path.suffix == ".txt":
        items: list[Any] = path.read_text().splitlines()
    elif path.suffix == ".json":
        items = json.loads(path.read_text())
    elif path.suffix == ".jsonl":
        items = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    else:
        raise ValueError(f"data.prompts={spec!r}: expected .txt, .json or .jsonl")
    out = []
    for it in items:
        text = it if isinstance(it, str) else (it.get("prompt") or it.get("caption") or "")
        if str(text).strip():
            out.append(str(text).strip())
    if not out:
        raise ValueError(f"data.prompts={spec!r} holds no prompts")
    return out


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
