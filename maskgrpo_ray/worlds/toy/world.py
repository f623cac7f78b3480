"""The toy world: a compositional caption grammar, a palette image space and its scenes.

Captions read "<count> <colour> dots on the <position>", e.g. "two red dots on the left".
An image is a ``grid x grid`` array of palette indices (0 = black background); each cell is
one image token and decodes to a ``cell_px x cell_px`` patch of its palette colour. A scene is
*correct* for its caption when exactly ``count`` cells have the colour, all of them lie in
the named half of the canvas, and no cell has any other colour: the GenEval-style check the
rule reward (``maskgrpo_ray.worlds.toy.rewards``) applies to decoded pixels.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from maskgrpo_ray.prompts.geneval_rule import decide, select_boxes

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 200, 60),
    "blue": (40, 80, 230),
    "yellow": (235, 220, 50),
    "magenta": (210, 50, 210),
    "cyan": (50, 215, 215),
}
BACKGROUND_RGB = (0, 0, 0)
PALETTE: list[tuple[int, int, int]] = [BACKGROUND_RGB, *COLOURS.values()]  # index = token
COLOUR_NAMES = list(COLOURS)
COUNT_WORDS = ["one", "two", "three", "four"]
POSITIONS = ["left", "right", "top", "bottom"]
WORDS = ["<pad>", "<null>", *COUNT_WORDS, *COLOUR_NAMES, "dot", "dots", "on", "the", *POSITIONS]
CAPTION_TOKENS = 6  # P: "<count> <colour> dots on the <position>"


@dataclass(frozen=True)
class Caption:
    count: int  # 1..4
    colour: int  # palette index 1..6
    position: str  # left | right | top | bottom

    @property
    def text(self) -> str:
        noun = "dot" if self.count == 1 else "dots"
        return f"{COUNT_WORDS[self.count - 1]} {COLOUR_NAMES[self.colour - 1]} {noun} on the {self.position}"

    def geneval_metadata(self) -> dict[str, object]:
        """This caption as a GenEval metadata line (``tag``, ``include``, ``exclude``,
        ``prompt``). The toy's one object class is ``"dot"``; ``region`` (a canvas half) is the
        toy's own key, GenEval's ``position`` being relative to a second object. The tag is
        ``single_object`` for one dot, else ``counting``. The exclude of ``count + 1`` dots
        (GenEval's counting clause, here on every caption) makes GenEval's rule equal to the
        toy reward's: exactly ``count`` dots, all of the colour, all in the half."""
        colour = COLOUR_NAMES[self.colour - 1]
        item = {"class": "dot", "count": self.count, "color": colour, "region": self.position}
        meta: dict[str, object] = {
            "tag": "single_object" if self.count == 1 else "counting",
            "include": [item],
            "exclude": [{"class": "dot", "count": self.count + 1}],
            "prompt": self.text,
        }
        return meta

    @classmethod
    def parse(cls, text: str) -> Caption:
        """Parse a caption of the grammar; raises ValueError naming the offending word."""
        words = text.strip().lower().split()
        if len(words) != 6 or words[3:5] != ["on", "the"] or words[2] not in ("dot", "dots"):
            raise ValueError(
                f"prompt {text!r} is not of the toy grammar '<count> <colour> dots on the "
                f"<position>' (count in {COUNT_WORDS}, colour in {COLOUR_NAMES}, position in "
                f"{POSITIONS})"
            )
        if words[0] not in COUNT_WORDS or words[1] not in COLOUR_NAMES or words[5] not in POSITIONS:
            raise ValueError(f"prompt {text!r} has a word outside the toy vocabulary {WORDS[2:]}")
        return cls(COUNT_WORDS.index(words[0]) + 1, COLOUR_NAMES.index(words[1]) + 1, words[5])


def all_captions() -> list[Caption]:
    return [
        Caption(n, c, p)
        for n, c, p in itertools.product(range(1, 5), range(1, len(COLOURS) + 1), POSITIONS)
    ]


def split_captions(
    eval_fraction: float = 0.25, seed: int = 0
) -> tuple[list[Caption], list[Caption]]:
    """Deterministic (train, held-out eval) split of the 96 captions."""
    caps = all_captions()
    perm = torch.randperm(len(caps), generator=torch.Generator().manual_seed(seed)).tolist()
    n_eval = max(1, round(len(caps) * eval_fraction))
    eval_idx = set(perm[:n_eval])
    return [c for i, c in enumerate(caps) if i not in eval_idx], [caps[i] for i in sorted(eval_idx)]


def region_mask(position: str, grid: int) -> torch.Tensor:
    """bool ``[grid, grid]``: the half of the canvas a position names."""
    m = torch.zeros(grid, grid, dtype=torch.bool)
    h = grid // 2
    if position == "left":
        m[:, :h] = True
    elif position == "right":
        m[:, h:] = True
    elif position == "top":
        m[:h, :] = True
    elif position == "bottom":
        m[h:, :] = True
    else:
        raise ValueError(f"unknown position {position!r}; expected one of {POSITIONS}")
    return m


def correct_layouts(cap: Caption, grid: int) -> int:
    """The number of correct scenes of a caption (so of distinct correct images: a scene
    decodes to one image): ``count`` cells of the colour among the named half's cells, every
    other cell background, ``C(half, count)``."""
    return math.comb(int(region_mask(cap.position, grid).sum()), cap.count)


def render_scene(
    cap: Caption, grid: int, g: torch.Generator, corrupt: str | None = None
) -> torch.Tensor:
    """A scene ``long [grid, grid]`` for a caption; ``corrupt`` makes it deliberately wrong.

    ``corrupt``: None (correct), ``"count"`` (one dot more or fewer), ``"place"`` (one dot in
    the other half) or ``"extra"`` (an extra dot of another colour).
    """
    grid_img = torch.zeros(grid, grid, dtype=torch.long)
    inside = region_mask(cap.position, grid).flatten().nonzero().squeeze(1)
    outside = (~region_mask(cap.position, grid)).flatten().nonzero().squeeze(1)
    count = cap.count
    if corrupt == "count":
        count = count + 1 if (count == 1 or torch.rand(1, generator=g).item() < 0.5) else count - 1
    cells = inside[torch.randperm(len(inside), generator=g)[:count]]
    if corrupt == "place":
        out = outside[torch.randint(len(outside), (1,), generator=g)]
        cells = torch.cat([cells[:-1], out])
    flat = grid_img.view(-1)
    flat[cells] = cap.colour
    if corrupt == "extra":
        free = (flat == 0).nonzero().squeeze(1)
        spot = free[torch.randint(len(free), (1,), generator=g)]
        other = [c for c in range(1, len(PALETTE)) if c != cap.colour]
        flat[spot] = other[int(torch.randint(len(other), (1,), generator=g))]
    return grid_img


def decode_palette(tokens: torch.Tensor, grid: int, cell_px: int) -> torch.Tensor:
    """Palette tokens ``long [N, L]`` -> pixels ``uint8 [N, grid*cell_px, grid*cell_px, 3]``."""
    palette = torch.tensor(PALETTE, dtype=torch.uint8, device=tokens.device)  # [V, 3]
    img = palette[tokens.clamp(0, len(PALETTE) - 1)].view(-1, grid, grid, 3)
    return img.repeat_interleave(cell_px, dim=1).repeat_interleave(cell_px, dim=2)


def pixels_to_cells(images: torch.Tensor, grid: int) -> torch.Tensor:
    """Read a decoded image back to palette cells: nearest palette colour of each patch mean.

    Args:
        images: uint8 ``[N, H, W, 3]`` with ``H = W = grid * cell_px``.
    Returns:
        long ``[N, grid, grid]``.
    """
    n, h, w, _ = images.shape
    if h % grid or w % grid:
        raise ValueError(f"image size {h}x{w} is not a multiple of the grid {grid}")
    x = images.float().view(n, grid, h // grid, grid, w // grid, 3).mean(dim=(2, 4))  # [N,g,g,3]
    palette = torch.tensor(PALETTE, dtype=torch.float32)
    d = ((x[..., None, :] - palette) ** 2).sum(-1)  # [N, g, g, V]
    return d.argmin(-1)


# ----------------------------------------------------------------------------- GenEval's rule
# on toy images, the official evaluator's (maskgrpo_ray.prompts.geneval_rule.decide) on exact
# detections, plus the toy's own ``region`` key.


def toy_detections(cells: torch.Tensor, cell_px: int) -> dict[str, list[tuple[Any, ...]]]:
    """The dots of one toy image ``long [g, g]`` (palette cells) as raw detections for
    :func:`~maskgrpo_ray.prompts.geneval_rule.decide`: class ``"dot"`` -> boxes
    ``(x0, y0, x1, y1, score, colour, regions)``, one per lit cell in row-major order.

    The box is the cell's square in pixels (``x1 = x0 + cell_px``). Detection is exact, so every
    score is 1.0 (a lit cell is a dot; the toy has no confidence to rank dots by): the evaluator's
    ``argsort(scores)[::-1]`` then orders them as NumPy orders that array of equal scores (the
    evaluator's own call on the same array, deterministic). The toy's metadata makes the order
    moot: its exclude of ``count + 1`` dots leaves a correct image ``count`` dots, all of which
    the include judges. ``colour`` (the palette name) and
    ``regions`` (the canvas halves the cell lies in) ride after the score for the colour and
    region checks."""
    g = cells.shape[0]
    masks = {p: region_mask(p, g) for p in POSITIONS}
    dots: list[tuple[Any, ...]] = []
    for r, c in (cells != 0).nonzero().tolist():
        colour = COLOUR_NAMES[int(cells[r, c]) - 1]
        regions = frozenset(p for p, m in masks.items() if m[r, c])
        box = (c * cell_px, r * cell_px, (c + 1) * cell_px, (r + 1) * cell_px)
        dots.append((*(float(v) for v in box), 1.0, colour, regions))
    return {"dot": dots}


def _palette_colours(classname: str, boxes: list[tuple[Any, ...]]) -> list[str]:
    """The toy's colour classifier: each dot's palette colour (exact)."""
    return [b[5] for b in boxes]


def toy_decide(cells: torch.Tensor, meta: Mapping[str, Any], cell_px: int) -> tuple[bool, str]:
    """GenEval's decision on one toy image ``long [g, g]``: the evaluator's rule on
    :func:`toy_detections`, then the toy's ``region`` key of an include (its ``count`` most
    confident dots, those the rule judged, all lie in the named half), reason appended."""
    dets = toy_detections(cells, cell_px)
    correct, reason = decide(dets, meta, _palette_colours)
    kept = select_boxes(dets, str(meta["tag"]))
    for req in meta.get("include", []):
        found = kept.get(req["class"], [])[: req["count"]]
        if "region" in req and len(found) == req["count"]:
            outside = sum(req["region"] not in b[6] for b in found)
            if outside:
                correct = False
                msg = f"expected {req['class']} on the {req['region']}, found {outside} outside"
                reason = f"{reason}\n{msg}" if reason else msg
    return correct, reason


def score_toy(
    images: torch.Tensor, metas: Sequence[Mapping[str, Any]], grid: int
) -> dict[str, torch.Tensor]:
    """``geneval`` ``[N]`` (0/1): GenEval's rule on toy images ``uint8 [N, H, W, 3]``, one
    metadata object per image (:func:`toy_decide`)."""
    if images.shape[0] != len(metas):
        raise ValueError(f"{images.shape[0]} images but {len(metas)} metadata lines")
    cells = pixels_to_cells(images.cpu(), grid)
    cell_px = images.shape[1] // grid
    correct = [float(toy_decide(c, m, cell_px)[0]) for c, m in zip(cells, metas)]
    return {"geneval": torch.tensor(correct, dtype=torch.float32)}
