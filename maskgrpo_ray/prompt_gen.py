"""GenEval-style training prompts: templates over object classes, colours, counts and positions.

Each prompt comes with its metadata in GenEval's ``evaluation_metadata.jsonl`` format (``tag``,
``include``, ``exclude``, ``prompt``; see ``evaluation/geneval.py``), so a reward or an
evaluator can check it. As Flow-GRPO does, the training prompts are kept disjoint from the
evaluation prompts: any text in ``exclude_prompts`` is never emitted.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from typing import Any

from maskgrpo_ray.data import GENEVAL_TAGS

# the 80 COCO classes, as GenEval names them
OBJECTS: tuple[str, ...] = (
    "person",
    "bicycle",
    "car",
    "motorcycle",
    "airplane",
    "bus",
    "train",
    "truck",
    "boat",
    "traffic light",
    "fire hydrant",
    "stop sign",
    "parking meter",
    "bench",
    "bird",
    "cat",
    "dog",
    "horse",
    "sheep",
    "cow",
    "elephant",
    "bear",
    "zebra",
    "giraffe",
    "backpack",
    "umbrella",
    "handbag",
    "tie",
    "suitcase",
    "frisbee",
    "skis",
    "snowboard",
    "sports ball",
    "kite",
    "baseball bat",
    "baseball glove",
    "skateboard",
    "surfboard",
    "tennis racket",
    "bottle",
    "wine glass",
    "cup",
    "fork",
    "knife",
    "spoon",
    "bowl",
    "banana",
    "apple",
    "sandwich",
    "orange",
    "broccoli",
    "carrot",
    "hot dog",
    "pizza",
    "donut",
    "cake",
    "chair",
    "couch",
    "potted plant",
    "bed",
    "dining table",
    "toilet",
    "tv",
    "laptop",
    "computer mouse",
    "tv remote",
    "computer keyboard",
    "cell phone",
    "microwave",
    "oven",
    "toaster",
    "sink",
    "refrigerator",
    "book",
    "clock",
    "vase",
    "scissors",
    "teddy bear",
    "hair drier",
    "toothbrush",
)
COLORS = ("red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white")
COUNTS = {2: "two", 3: "three", 4: "four"}
RELATIONS = ("left of", "right of", "above", "below")
IRREGULAR = {
    "person": "people",
    "sheep": "sheep",
    "skis": "skis",
    "scissors": "scissors",
    "knife": "knives",
    "computer mouse": "computer mice",
}


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


def _single(rng: random.Random) -> dict[str, Any]:
    obj = rng.choice(OBJECTS)
    return {
        "tag": "single_object",
        "include": [{"class": obj, "count": 1}],
        "prompt": f"a photo of {_a(obj)}",
    }


def _two(rng: random.Random) -> dict[str, Any]:
    a, b = rng.sample(OBJECTS, 2)
    return {
        "tag": "two_object",
        "include": [{"class": a, "count": 1}, {"class": b, "count": 1}],
        "prompt": f"a photo of {_a(a)} and {_a(b)}",
    }


def _counting(rng: random.Random) -> dict[str, Any]:
    obj, n = rng.choice(OBJECTS), rng.choice(list(COUNTS))
    return {
        "tag": "counting",
        "include": [{"class": obj, "count": n}],
        "exclude": [{"class": obj, "count": n + 1}],
        "prompt": f"a photo of {COUNTS[n]} {plural(obj)}",
    }


def _colors(rng: random.Random) -> dict[str, Any]:
    obj, colour = rng.choice(OBJECTS), rng.choice(COLORS)
    return {
        "tag": "colors",
        "include": [{"class": obj, "count": 1, "color": colour}],
        "prompt": f"a photo of {_a(colour + ' ' + obj)}",
    }


def _position(rng: random.Random) -> dict[str, Any]:
    # "a photo of a A <relation> a B": B is include[0], A (include[1]) is <relation> it
    a, b = rng.sample(OBJECTS, 2)
    relation = rng.choice(RELATIONS)
    return {
        "tag": "position",
        "include": [
            {"class": b, "count": 1},
            {"class": a, "count": 1, "position": [relation, 0]},
        ],
        "prompt": f"a photo of {_a(a)} {relation} {_a(b)}",
    }


def _color_attr(rng: random.Random) -> dict[str, Any]:
    a, b = rng.sample(OBJECTS, 2)
    ca, cb = rng.sample(COLORS, 2)
    return {
        "tag": "color_attr",
        "include": [
            {"class": a, "count": 1, "color": ca},
            {"class": b, "count": 1, "color": cb},
        ],
        "prompt": f"a photo of {_a(ca + ' ' + a)} and {_a(cb + ' ' + b)}",
    }


MAKERS = {
    "single_object": _single,
    "two_object": _two,
    "counting": _counting,
    "colors": _colors,
    "position": _position,
    "color_attr": _color_attr,
}
POOL_SIZES = {
    "single_object": len(OBJECTS),
    "two_object": len(OBJECTS) * (len(OBJECTS) - 1),
    "counting": len(OBJECTS) * len(COUNTS),
    "colors": len(OBJECTS) * len(COLORS),
    "position": len(OBJECTS) * (len(OBJECTS) - 1) * len(RELATIONS),
    "color_attr": len(OBJECTS) * (len(OBJECTS) - 1) * len(COLORS) * (len(COLORS) - 1),
}


def fair_shares(n: int, tags: Sequence[str]) -> dict[str, int]:
    """``n`` split over ``tags`` as evenly as their template pools allow: a tag whose pool is
    smaller than its share gives all it has and the rest goes to the others."""
    shares: dict[str, int] = {}
    open_tags = sorted(tags, key=lambda t: POOL_SIZES[t])  # smallest pools settle first
    left = n
    while open_tags:
        even = left // len(open_tags)
        tag = open_tags[0]
        if POOL_SIZES[tag] < even:
            shares[tag] = POOL_SIZES[tag]
            left -= POOL_SIZES[tag]
            open_tags.pop(0)
            continue
        order = [t for t in tags if t in open_tags]
        for i, t in enumerate(order):
            shares[t] = even + (1 if i < left % len(order) else 0)
        break
    if sum(shares.values()) < n:
        raise ValueError(
            f"--n {n}: the templates of tags {list(tags)} give only {sum(shares.values())} "
            "distinct prompts; ask for fewer"
        )
    return {t: shares[t] for t in tags}


def make_geneval_prompts(
    n: int,
    *,
    seed: int = 0,
    tags: Sequence[str] | None = None,
    exclude_prompts: Iterable[str] = (),
) -> list[dict[str, Any]]:
    """``n`` distinct GenEval-style prompts with metadata, the tags in equal shares where their
    templates allow (:func:`fair_shares`), none of them in ``exclude_prompts``; the same list
    for the same arguments. Raises ValueError when a tag cannot supply its share."""
    tags = list(tags or GENEVAL_TAGS)
    unknown = [t for t in tags if t not in MAKERS]
    if unknown:
        raise ValueError(f"--tags: unknown tags {unknown}; known: {list(GENEVAL_TAGS)}")
    if n < 1:
        raise ValueError(f"--n {n}: ask for at least one prompt")
    excluded = {" ".join(p.split()) for p in exclude_prompts}
    rng = random.Random(seed)
    shares = fair_shares(n, tags)
    by_tag: dict[str, list[dict[str, Any]]] = {t: [] for t in tags}
    seen: set[str] = set()
    for tag in tags:
        misses = 0
        while len(by_tag[tag]) < shares[tag]:
            meta = MAKERS[tag](rng)
            if meta["prompt"] in seen or meta["prompt"] in excluded:
                misses += 1
                if misses > 200 * shares[tag] + 1000:
                    raise ValueError(
                        f"tag {tag!r}: only {len(by_tag[tag])} new prompts found for a share of "
                        f"{shares[tag]} (its templates give {POOL_SIZES[tag]}, some excluded); "
                        "ask for fewer prompts (--n) or leave the tag out (--tags)"
                    )
                continue
            seen.add(meta["prompt"])
            by_tag[tag].append(meta)
    out = [m for t in tags for m in by_tag[t]]
    rng.shuffle(out)
    return out


def toy_prompt_metadata(split: str) -> list[dict[str, Any]]:
    """The toy world's ``split`` ("train" or "eval") captions with their GenEval-style metadata."""
    from maskgrpo_ray.models.registry import get_prompt_set
    from maskgrpo_ray.toyworld import Caption

    prompt_set = get_prompt_set("toy")
    assert prompt_set is not None
    return [Caption.parse(text).geneval_metadata() for text in prompt_set(split)]
