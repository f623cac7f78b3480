"""GenEval-style training prompts: templates over object classes, colours, counts and positions.

Each prompt comes with its metadata in GenEval's ``evaluation_metadata.jsonl`` format (``tag``,
``include``, ``exclude``, ``prompt``; see ``prompts/geneval_schema.py``), so a reward or an
evaluator can check it. The templates are those of GenEval's ``prompts/create_prompts.py``
(its classes, colours, counts two to four, relations; no "<colour> person"), with proper
English plurals ("two people", where GenEval writes "two persons"). As Flow-GRPO does, the
training prompts are kept disjoint from the evaluation prompts: a prompt whose text, or whose
metadata (:func:`metadata_key`), is excluded is never emitted.

Every tag's template is a finite pool indexed ``0 .. POOL_SIZES[tag] - 1`` (:data:`TEMPLATES`),
so sampling is without replacement, the same for the same seed, and the error for asking too
much is exact.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from maskgrpo_ray.prompts.geneval_rule import COLORS
from maskgrpo_ray.prompts.geneval_schema import GENEVAL_CLASSES, RELATIONS
from maskgrpo_ray.prompts.geneval_schema import TAGS as GENEVAL_TAGS
from maskgrpo_ray.prompts.loading import normalize_text

OBJECTS: tuple[str, ...] = GENEVAL_CLASSES  # the 80 COCO classes, as GenEval names them
COLOURABLE = tuple(o for o in OBJECTS if o != "person")  # GenEval writes no "<colour> person"
COUNTS = {2: "two", 3: "three", 4: "four"}
IRREGULAR = {
    "person": "people",
    "sheep": "sheep",
    "skis": "skis",
    "scissors": "scissors",
    "knife": "knives",
    "computer mouse": "computer mice",
}
ENUMERATE_LIMIT = 50_000  # pools up to this size are listed whole (exact exclusion counts)


def plural(noun: str) -> str:
    """English plural of a class name (``"wine glass"`` -> ``"wine glasses"``)."""
    if noun in IRREGULAR:
        return IRREGULAR[noun]
    if noun.endswith(("s", "sh", "ch", "x")):
        return noun + "es"
    return noun + "s"


def article(word: str) -> str:
    """``"an"`` before a vowel sound, else ``"a"`` (enough for these class and colour names)."""
    return "an" if word[0] in "aeiou" else "a"


def _a(phrase: str) -> str:
    return f"{article(phrase)} {phrase}"


def _pair(i: int, items: Sequence[str]) -> tuple[str, str]:
    """The ``i``-th of the ``len(items) * (len(items) - 1)`` ordered pairs of distinct items."""
    a, r = divmod(i, len(items) - 1)
    return items[a], items[r + (r >= a)]


def _single(i: int) -> dict[str, Any]:
    obj = OBJECTS[i]
    return {
        "tag": "single_object",
        "include": [{"class": obj, "count": 1}],
        "prompt": f"a photo of {_a(obj)}",
    }


def _two(i: int) -> dict[str, Any]:
    a, b = _pair(i, OBJECTS)
    return {
        "tag": "two_object",
        "include": [{"class": a, "count": 1}, {"class": b, "count": 1}],
        "prompt": f"a photo of {_a(a)} and {_a(b)}",
    }


def _counting(i: int) -> dict[str, Any]:
    k, c = divmod(i, len(COUNTS))
    obj, n = OBJECTS[k], 2 + c
    return {
        "tag": "counting",
        "include": [{"class": obj, "count": n}],
        "exclude": [{"class": obj, "count": n + 1}],
        "prompt": f"a photo of {COUNTS[n]} {plural(obj)}",
    }


def _colors(i: int) -> dict[str, Any]:
    k, c = divmod(i, len(COLORS))
    obj, colour = COLOURABLE[k], COLORS[c]
    return {
        "tag": "colors",
        "include": [{"class": obj, "count": 1, "color": colour}],
        "prompt": f"a photo of {_a(colour)} {obj}",
    }


def _position(i: int) -> dict[str, Any]:
    # "a photo of a A <relation> a B": B is include[0], A (include[1]) is <relation> it
    k, r = divmod(i, len(RELATIONS))
    a, b = _pair(k, OBJECTS)
    relation = RELATIONS[r]
    return {
        "tag": "position",
        "include": [
            {"class": b, "count": 1},
            {"class": a, "count": 1, "position": [relation, 0]},
        ],
        "prompt": f"a photo of {_a(a)} {relation} {_a(b)}",
    }


def _color_attr(i: int) -> dict[str, Any]:
    k, c = divmod(i, len(COLORS) * (len(COLORS) - 1))
    a, b = _pair(k, COLOURABLE)
    ca, cb = _pair(c, COLORS)
    return {
        "tag": "color_attr",
        "include": [
            {"class": a, "count": 1, "color": ca},
            {"class": b, "count": 1, "color": cb},
        ],
        "prompt": f"a photo of {_a(ca)} {a} and {_a(cb)} {b}",
    }


_N, _C = len(OBJECTS), len(COLOURABLE)
TEMPLATES: dict[str, tuple[int, Callable[[int], dict[str, Any]]]] = {
    "single_object": (_N, _single),
    "two_object": (_N * (_N - 1), _two),
    "counting": (_N * len(COUNTS), _counting),
    "colors": (_C * len(COLORS), _colors),
    "position": (_N * (_N - 1) * len(RELATIONS), _position),
    "color_attr": (_C * (_C - 1) * len(COLORS) * (len(COLORS) - 1), _color_attr),
}
POOL_SIZES = {tag: size for tag, (size, _) in TEMPLATES.items()}


def metadata_key(meta: Mapping[str, Any]) -> str:
    """What a GenEval metadata line asks for, whatever its wording: tag, include, exclude. The
    include order counts only where a ``position`` refers to an earlier include."""
    include = list(meta.get("include") or [])
    if not any(isinstance(c, Mapping) and "position" in c for c in include):
        include = sorted(include, key=lambda c: json.dumps(c, sort_keys=True))
    return json.dumps([meta.get("tag"), include, meta.get("exclude") or []], sort_keys=True)


def fair_shares(n: int, capacity: Mapping[str, int]) -> dict[str, int]:
    """``n`` split over the tags of ``capacity`` (tag -> prompts it can give) as evenly as
    they allow: a tag with less than its share gives all it has and the others share the rest
    (the first tags take the remainder). Raises ValueError when all of them give fewer."""
    tags = list(capacity)
    total = sum(capacity.values())
    if total < n:
        raise ValueError(
            f"n={n} (--n): the templates give only {total} distinct prompts (by tag, after "
            f"leaving out the excluded ones: {dict(capacity)}); ask for fewer, or add tags "
            "(--tags)"
        )
    shares: dict[str, int] = {}
    open_tags = sorted(tags, key=lambda t: capacity[t])  # smallest capacities settle first
    left = n
    while open_tags:
        even = left // len(open_tags)
        if capacity[open_tags[0]] < even:
            tag = open_tags.pop(0)
            shares[tag] = capacity[tag]
            left -= capacity[tag]
            continue
        order = [t for t in tags if t in open_tags]
        for i, t in enumerate(order):
            shares[t] = even + (1 if i < left % len(order) else 0)
        break
    return {t: shares[t] for t in tags}


def _candidates(
    tag: str, excluded: Callable[[dict[str, Any]], bool], limit: int
) -> tuple[int, list[dict[str, Any]] | None]:
    """A tag's capacity after exclusion (exact for a pool listed whole, else a lower bound:
    the pool less ``limit``, the number of excluded prompts) and, when listed, its prompts."""
    size, make = TEMPLATES[tag]
    if size > ENUMERATE_LIMIT:
        return max(0, size - limit), None
    pool = [m for m in map(make, range(size)) if not excluded(m)]
    return len(pool), pool


def make_geneval_prompts(
    n: int,
    *,
    seed: int = 0,
    tags: Sequence[str] | None = None,
    exclude_prompts: Iterable[str] = (),
    exclude_metadata: Iterable[Mapping[str, Any]] = (),
) -> list[dict[str, Any]]:
    """``n`` distinct GenEval-style prompts with metadata, in a seeded random order.

    The tags (default: all six) share ``n`` equally where their pools allow
    (:func:`fair_shares`). A prompt is never emitted when its text is in ``exclude_prompts``
    (compared after :func:`~maskgrpo_ray.prompts.loading.normalize_text`) or when its
    :func:`metadata_key` is that of a line of ``exclude_metadata`` (the evaluation set, whose
    wording may differ: GenEval writes "two persons"). The same arguments give the same list.

    Raises:
        ValueError: an unknown tag, ``n < 1``, or more prompts than the templates can give.
    """
    tags = list(tags or GENEVAL_TAGS)
    unknown = [t for t in tags if t not in TEMPLATES]
    if unknown:
        raise ValueError(f"--tags: unknown tags {unknown}; known: {list(GENEVAL_TAGS)}")
    if n < 1:
        raise ValueError(f"n={n} (--n): ask for at least one prompt")
    texts = {normalize_text(p) for p in exclude_prompts}
    keys = {metadata_key(m) for m in exclude_metadata}

    def excluded(meta: dict[str, Any]) -> bool:
        return meta["prompt"] in texts or bool(keys) and metadata_key(meta) in keys

    rng = random.Random(seed)
    listed = {t: _candidates(t, excluded, len(texts) + len(keys)) for t in dict.fromkeys(tags)}
    shares = fair_shares(n, {t: cap for t, (cap, _) in listed.items()})
    out: list[dict[str, Any]] = []
    for tag, share in shares.items():
        pool = listed[tag][1]
        if pool is not None:
            out += rng.sample(pool, share)
            continue
        size, make = TEMPLATES[tag]
        # at most len(texts) + len(keys) of the drawn prompts are excluded
        drawn = (
            make(i) for i in rng.sample(range(size), min(size, share + len(texts) + len(keys)))
        )
        out += [m for m in drawn if not excluded(m)][:share]
    rng.shuffle(out)
    return out


def prompt_set_metadata(name: str, split: str) -> list[dict[str, Any]]:
    """A named prompt set's ``split`` ("train" or "eval") with each prompt's metadata (the toy
    world's: GenEval-style, ``Caption.geneval_metadata``)."""
    from maskgrpo_ray.prompts.loading import load_prompt_records

    return [{**(r.meta or {}), "prompt": r.text} for r in load_prompt_records(name, split).records]
