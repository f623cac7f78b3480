"""The GenEval-shaped world's grammar, scenes and renderer.

A scene is one to four objects on a black canvas of ``grid x grid`` tokens of ``patch_px``
pixels (32 x 32 px by default). An object is a shape (:data:`CLASSES`) of a colour
(:data:`COLOURS`) inside a square box of 2, 3 or 4 tokens aligned to the token grid, drawn one
pixel inside its box, so that a box's corner, edge and inner tokens are different patches (the
tokenizer sees where an object ends) and two objects never touch. Boxes never overlap.

Prompts follow GenEval's templates for its six tags (Ghosh et al., 2023), with shapes as the
object classes; each prompt carries its GenEval metadata line (:mod:`maskgrpo_ray.prompts.geneval_schema`)
and GenEval's rule (the official evaluator's, :mod:`maskgrpo_ray.prompts.geneval_rule`) judges
a scene's detected objects against it:

============== ================================ =======================================
tag            prompt                           metadata ``include`` (``exclude``)
============== ================================ =======================================
single_object  "a circle"                       circle x1
two_object     "a circle and a square"          circle x1, square x1
counting       "three circles"                  circle x3 (circle x4 excluded)
colors         "a red circle"                   red circle x1
position       "a circle left of a square"      square x1, circle x1 left of it
color_attr     "a red circle and a blue square" red circle x1, blue square x1
============== ================================ =======================================

The training and evaluation prompts are disjoint (:func:`split_prompts`): evaluation holds out
combinations of each template (and every single-object prompt: training meets the classes in the
other templates), as the paper evaluates GenEval zero-shot.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np

from maskgrpo_ray.prompts.geneval_rule import decide
from maskgrpo_ray.prompts.geneval_schema import RELATIONS, TAGS

CLASSES = ("circle", "square", "triangle", "diamond")
PLURAL = {c: c + "s" for c in CLASSES}
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (230, 40, 40),
    "green": (40, 200, 60),
    "blue": (50, 90, 235),
    "yellow": (240, 220, 40),
    "purple": (170, 60, 220),
    "white": (235, 235, 235),
}
COLOUR_NAMES = tuple(COLOURS)
BACKGROUND_RGB = (0, 0, 0)
PALETTE = np.array([BACKGROUND_RGB, *COLOURS.values()], dtype=np.uint8)  # [1 + colours, 3]
COUNT_WORDS = {2: "two", 3: "three", 4: "four"}
SIZES = (2, 3, 4)  # an object's box side, in tokens
WORDS = (
    "<pad>",
    "<null>",
    "a",
    "and",
    "of",
    "left",
    "right",
    "above",
    "below",
    *COUNT_WORDS.values(),
    *CLASSES,
    *PLURAL.values(),
    *COLOUR_NAMES,
)
PROMPT_TOKENS = 8  # P: the longest prompt, "a red circle and a blue square", has 7 words
# part of every shapes cache key (codebook, base policy, reward model): their data are scenes
# drawn correct under this rule; "geneval-exact": the official evaluator's, position scenes
# redrawn until its relation holds with the dead zone (earlier caches drew on box centres alone)
DATA_VERSION = {"scene_rule": "geneval-exact"}
REL_WORDS = {"left of": "left of", "right of": "right of", "above": "above", "below": "below"}


@dataclass(frozen=True)
class Obj:
    """One object: its class, colour and box (top-left token ``row``, ``col``; ``size`` tokens)."""

    cls: str
    colour: str
    row: int
    col: int
    size: int

    def centre(self) -> tuple[float, float]:
        """The box centre ``(x, y)`` in token units (y down), as the detector measures it."""
        return (self.col + self.size / 2, self.row + self.size / 2)


@dataclass(frozen=True)
class Prompt:
    """A prompt of the grammar with its GenEval metadata."""

    tag: str
    text: str
    include: tuple[dict[str, Any], ...]
    exclude: tuple[dict[str, Any], ...] = ()

    def metadata(self) -> dict[str, Any]:
        """GenEval's metadata line (``tag``, ``include``, ``exclude``, ``prompt``)."""
        out: dict[str, Any] = {"tag": self.tag, "include": [dict(c) for c in self.include]}
        if self.exclude:
            out["exclude"] = [dict(c) for c in self.exclude]
        out["prompt"] = self.text
        return out


# ----------------------------------------------------------------------------- the grammar


def _single(c: str) -> Prompt:
    return Prompt("single_object", f"a {c}", ({"class": c, "count": 1},))


def _two(a: str, b: str) -> Prompt:
    return Prompt(
        "two_object", f"a {a} and a {b}", ({"class": a, "count": 1}, {"class": b, "count": 1})
    )


def _counting(c: str, n: int) -> Prompt:
    text = f"{COUNT_WORDS[n]} {PLURAL[c]}"
    return Prompt("counting", text, ({"class": c, "count": n},), ({"class": c, "count": n + 1},))


def _colors(col: str, c: str) -> Prompt:
    return Prompt("colors", f"a {col} {c}", ({"class": c, "count": 1, "color": col},))


def _position(a: str, rel: str, b: str) -> Prompt:
    inc = ({"class": b, "count": 1}, {"class": a, "count": 1, "position": [rel, 0]})
    return Prompt("position", f"a {a} {rel} a {b}", inc)


def _color_attr(ca: str, a: str, cb: str, b: str) -> Prompt:
    inc = ({"class": a, "count": 1, "color": ca}, {"class": b, "count": 1, "color": cb})
    return Prompt("color_attr", f"a {ca} {a} and a {cb} {b}", inc)


@cache
def all_prompts() -> tuple[Prompt, ...]:
    """Every prompt of the grammar, tag by tag, in a fixed order."""
    pairs = list(itertools.permutations(CLASSES, 2))
    out = [_single(c) for c in CLASSES]
    out += [_two(a, b) for a, b in pairs]
    out += [_counting(c, n) for c in CLASSES for n in COUNT_WORDS]
    out += [_colors(col, c) for col in COLOUR_NAMES for c in CLASSES]
    out += [_position(a, r, b) for a, b in pairs for r in RELATIONS]
    colour_pairs = list(itertools.permutations(COLOUR_NAMES, 2))
    out += [_color_attr(ca, a, cb, b) for a, b in pairs for ca, cb in colour_pairs]
    return tuple(out)


# evaluation prompts per tag (held-out combinations), and the training prompts kept per tag
# held out per tag: every single-object prompt, half of the 12 two-object and counting prompts, 8
# of each other template; GenEval's overall is the mean over tags (eval_accuracy/tag_mean)
EVAL_PER_TAG = {**dict.fromkeys(TAGS, 8), "single_object": 4, "two_object": 6, "counting": 6}
TRAIN_CAP_PER_TAG = 36


@cache
def split_prompts(seed: int = 0) -> tuple[tuple[Prompt, ...], tuple[Prompt, ...]]:
    """The disjoint ``(train, eval)`` split: per tag, :data:`EVAL_PER_TAG` prompts drawn for
    evaluation (every single-object prompt among them); of the rest, at most
    :data:`TRAIN_CAP_PER_TAG` per tag for training (so the 348 colour-attribute combinations
    do not drown the other tags). Deterministic in ``seed``."""
    rng = np.random.default_rng(seed)
    train: list[Prompt] = []
    held: list[Prompt] = []
    by_tag: dict[str, list[Prompt]] = {}
    for p in all_prompts():
        by_tag.setdefault(p.tag, []).append(p)
    for tag, prompts in by_tag.items():
        order = rng.permutation(len(prompts)).tolist()
        n_eval = min(EVAL_PER_TAG[tag], len(prompts))
        held += [prompts[i] for i in sorted(order[:n_eval])]
        rest = [prompts[i] for i in order[n_eval:]][:TRAIN_CAP_PER_TAG]
        train += sorted(rest, key=prompts.index)
    return tuple(train), tuple(held)


@cache
def prompt_index() -> dict[str, Prompt]:
    """Prompt text -> its :class:`Prompt`."""
    return {p.text: p for p in all_prompts()}


def parse(text: str) -> Prompt:
    """The grammar's prompt of ``text`` (case and spaces folded); ValueError naming the fix."""
    key = " ".join(text.strip().lower().split())
    found = prompt_index().get(key)
    if found is None:
        raise ValueError(
            f"prompt {text!r} is not of the shapes grammar (GenEval's templates over the shapes "
            f"{list(CLASSES)} and colours {list(COLOUR_NAMES)}, e.g. 'a red circle left of a "
            "square'; `maskgrpo prompts make --kind shapes` lists them)"
        )
    return found


# ----------------------------------------------------------------------------- scenes


def _place(
    sizes: Sequence[int], grid: int, rng: np.random.Generator, tries: int = 200
) -> list[tuple[int, int]] | None:
    """Top-left corners of non-overlapping boxes of ``sizes`` on the grid, or None."""
    taken = np.zeros((grid, grid), dtype=bool)
    out = []
    for s in sizes:
        for _ in range(tries):
            r, c = (int(v) for v in rng.integers(0, grid - s + 1, size=2))
            if not taken[r : r + s, c : c + s].any():
                taken[r : r + s, c : c + s] = True
                out.append((r, c))
                break
        else:
            return None
    return out


def _random_objects(
    specs: Sequence[tuple[str, str]], grid: int, rng: np.random.Generator
) -> list[Obj]:
    """Objects of the given ``(class, colour)`` at random sizes and free places."""
    while True:
        sizes = [int(rng.choice(SIZES)) for _ in specs]
        corners = _place(sizes, grid, rng)
        if corners is not None:
            return [
                Obj(c, col, r, k, s)
                for (c, col), (r, k), s in zip(specs, corners, sizes, strict=True)
            ]


def _colour(rng: np.random.Generator, avoid: Sequence[str] = ()) -> str:
    return str(rng.choice([c for c in COLOUR_NAMES if c not in avoid]))


def sample_scene(prompt: Prompt, grid: int, rng: np.random.Generator, patch_px: int) -> list[Obj]:
    """A random scene that is correct for ``prompt`` (:func:`is_correct` at ``patch_px``): what
    the prompt leaves open (colours, sizes, places) is drawn at random; nothing else is in the
    scene. A position scene is drawn again until GenEval's relation, dead zone included, holds."""
    inc = prompt.include
    if prompt.tag == "counting":
        n = inc[0]["count"]
        return _random_objects([(inc[0]["class"], _colour(rng))] * n, grid, rng)
    specs = [(c["class"], c.get("color") or _colour(rng)) for c in inc]
    if prompt.tag != "position":
        return _random_objects(specs, grid, rng)
    while True:
        scene = _random_objects(specs, grid, rng)
        if is_correct(prompt, scene, patch_px):
            return scene


def scene_detections(objs: Sequence[Obj], patch_px: int) -> dict[str, list[tuple[Any, ...]]]:
    """What the judge's detector finds in a drawn scene's render, as raw detections for GenEval's
    rule: class -> ``(x0, y0, x1, y1, 1.0, colour)``, the drawn square in pixels (one pixel inside
    the object's token box) with a perfect match's score."""
    found: dict[str, list[tuple[Any, ...]]] = {}
    for o in objs:
        inner = o.size * patch_px - 2
        x0, y0 = o.col * patch_px + 1, o.row * patch_px + 1
        box = (float(x0), float(y0), float(x0 + inner), float(y0 + inner), 1.0, o.colour)
        found.setdefault(o.cls, []).append(box)
    return found


def box_colours(classname: str, boxes: list[tuple[Any, ...]]) -> list[str]:
    """The shapes world's colour classifier: each box's palette colour, carried after its score
    (exact: an object is drawn in one palette colour)."""
    return [b[5] for b in boxes]


def is_correct(prompt: Prompt, objs: Sequence[Obj], patch_px: int) -> bool:
    """GenEval's rule (:func:`~maskgrpo_ray.prompts.geneval_rule.decide`, the official
    evaluator's) on a drawn scene at ``patch_px``: what the judge decides on its render."""
    return decide(scene_detections(objs, patch_px), prompt.metadata(), box_colours)[0]


def corrupt_scene(
    prompt: Prompt, objs: list[Obj], grid: int, rng: np.random.Generator, patch_px: int
) -> list[Obj]:
    """A near miss of ``prompt``: the scene with one thing wrong that the prompt's tag tests
    (a count off by one, a colour, a class, a relation) and wrong for the prompt (at
    ``patch_px``), for noisy pre-training captions and the reward model's hard negatives."""
    for _ in range(50):
        wrong = _one_change(prompt, objs, grid, rng)
        if not is_correct(prompt, wrong, patch_px):
            return wrong
    return []  # never reached in practice (each tag has a change that breaks it); empty is wrong


def _one_change(prompt: Prompt, objs: list[Obj], grid: int, rng: np.random.Generator) -> list[Obj]:
    kind = str(rng.choice(["count", "colour", "class", "swap"]))
    objs = list(objs)
    if kind == "count" and (prompt.tag == "counting" or len(objs) == 1):
        n = len(objs) + (1 if len(objs) == 1 or rng.random() < 0.5 else -1)
        template = objs[0]
        return _random_objects([(template.cls, template.colour)] * n, grid, rng)
    i = int(rng.integers(len(objs)))
    o = objs[i]
    if kind == "colour" or (kind == "class" and prompt.tag == "counting"):
        objs[i] = Obj(o.cls, _colour(rng, [o.colour]), o.row, o.col, o.size)
    elif kind == "class":
        other = str(rng.choice([c for c in CLASSES if c != o.cls]))
        objs = [
            Obj(other, o.colour, o.row, o.col, o.size) if j == i else x for j, x in enumerate(objs)
        ]
    elif len(objs) == 2:  # swap the two objects' places (flips a relation, swaps attributes)
        a, b = objs
        objs = [
            Obj(a.cls, a.colour, b.row, b.col, b.size),
            Obj(b.cls, b.colour, a.row, a.col, a.size),
        ]
    else:
        objs[i] = Obj(o.cls, _colour(rng, [o.colour]), o.row, o.col, o.size)
    return objs


# ----------------------------------------------------------------------------- rendering


@cache
def shape_mask(cls: str, side_px: int) -> np.ndarray:
    """bool ``[side_px, side_px]``: the pixels of a ``cls`` filling a square of that side
    (pixel centres tested against the shape; no anti-aliasing, so renders are exact)."""
    c = (np.arange(side_px) + 0.5) / side_px * 2 - 1  # pixel centres in [-1, 1]
    x, y = np.meshgrid(c, c)  # y down
    if cls == "square":
        return np.ones((side_px, side_px), dtype=bool)
    if cls == "circle":
        return x * x + y * y <= 1.0
    if cls == "diamond":
        return np.abs(x) + np.abs(y) <= 1.0
    if cls == "triangle":  # apex up (its top row two pixels wide), base down
        return np.abs(x) <= (y + 1 + 2 / side_px) / 2 + 1e-9
    raise ValueError(f"unknown shape class {cls!r}; expected one of {CLASSES}")


def render_indices(objs: Sequence[Obj], grid: int, patch_px: int) -> np.ndarray:
    """The scene as palette indices, uint8 ``[H, W]`` (0 = background)."""
    side = grid * patch_px
    out = np.zeros((side, side), dtype=np.uint8)
    for o in objs:
        inner = o.size * patch_px - 2  # one pixel inside the box on every side
        top, left = o.row * patch_px + 1, o.col * patch_px + 1
        region = out[top : top + inner, left : left + inner]
        region[shape_mask(o.cls, inner)] = 1 + COLOUR_NAMES.index(o.colour)
    return out


def render(objs: Sequence[Obj], grid: int, patch_px: int) -> np.ndarray:
    """The scene in pixels, uint8 ``[H, W, 3]``."""
    return PALETTE[render_indices(objs, grid, patch_px)]
