"""Verifiable rewards of the toy world, computed from decoded *pixels* (not tokens).

For a caption "<count> <colour> dots on the <position>" the image is read back into palette
cells (nearest palette colour of each patch) and judged like GenEval: exact count of the
colour, every dot of it in the named half, nothing of another colour.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from maskgrpo_ray.rewards.base import register_reward
from maskgrpo_ray.worlds.toy import world as toyworld
from maskgrpo_ray.worlds.toy.world import Caption


def judge(images: torch.Tensor, prompts: Sequence[str], grid: int) -> dict[str, torch.Tensor]:
    """Per-sample checks; every value is ``[N]``; unparsable prompts give NaN scores.

    Returns keys ``count_ok``, ``position_ok``, ``clean_ok``, ``correct`` (float 0/1 or NaN) and
    ``score`` (partial credit in [0, 1]: mean of a count term ``0.5 ** |n - count|``, the share
    of the colour's dots inside the named half, and ``1 / (1 + other dots)``).
    """
    if images.shape[0] != len(prompts):
        raise ValueError(f"{images.shape[0]} images but {len(prompts)} prompts")
    cells = toyworld.pixels_to_cells(images.cpu(), grid)  # [N, g, g]
    out = {
        k: torch.full((len(prompts),), float("nan"))
        for k in ("count_ok", "position_ok", "clean_ok", "correct", "score")
    }
    for i, prompt in enumerate(prompts):
        try:
            cap = Caption.parse(prompt)
        except ValueError:
            continue
        is_c = cells[i] == cap.colour
        n = int(is_c.sum())
        n_in = int((is_c & toyworld.region_mask(cap.position, grid)).sum())
        n_other = int(((cells[i] != 0) & ~is_c).sum())
        count_ok, pos_ok, clean_ok = n == cap.count, n > 0 and n_in == n, n_other == 0
        out["count_ok"][i] = float(count_ok)
        out["position_ok"][i] = float(pos_ok)
        out["clean_ok"][i] = float(clean_ok)
        out["correct"][i] = float(count_ok and pos_ok and clean_ok)
        out["score"][i] = (
            0.5 ** abs(n - cap.count) + (n_in / n if n else 0.0) + 1.0 / (1 + n_other)
        ) / 3.0
    return out


TOY_TERMS = ("score+correct", "score", "correct")


class ToyRuleReward:
    """``reward(images uint8 [N, H, W, 3], prompts) -> float [N]``: partial credit + 1 if correct.

    The reward is in [0, 2]; an unparsable prompt scores NaN (the driver counts and skips it).
    ``accuracy`` gives the GenEval-style 0/1 correctness used for held-out evaluation.
    ``terms`` picks the terms: ``score+correct`` (the default), or one of them alone (two
    components ``score`` and ``correct`` of weight 1 sum to the default: the two-component
    reward GDPO, ``train.advantage: gdpo``, is compared on).
    """

    name = "toy_rules"

    def __init__(self, grid: int = 4, terms: str = "score+correct") -> None:
        if terms not in TOY_TERMS:
            raise ValueError(f"toy_rules reward: terms={terms!r} must be one of {TOY_TERMS}")
        self.grid, self.terms = grid, terms

    def __call__(self, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        j = judge(images, prompts, self.grid)
        if self.terms == "score":
            return j["score"]
        if self.terms == "correct":
            return j["correct"]
        return j["score"] + j["correct"]

    def accuracy(self, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        return judge(images, prompts, self.grid)["correct"]

    def embed(self, images: torch.Tensor) -> torch.Tensor:
        """What this reward sees of an image: its palette cells, one-hot, float ``[N, L * C]``
        (``1 - cos`` of two images is the share of cells that differ; ``maskgrpo_ray.algo.diversity``)."""
        return cell_features(images, self.grid)

    def layouts(self, images: torch.Tensor) -> list[tuple[int, ...]]:
        """The layout this reward reads of each image: its palette cells as a tuple
        (``diversity/layouts``)."""
        return cell_layouts(images, self.grid)


def cell_layouts(images: torch.Tensor, grid: int) -> list[tuple[int, ...]]:
    """The palette cells read from the pixels of each image, row-major, as ``N`` tuples of
    ``L`` palette ids: equal exactly when two images show the same dots."""
    cells = toyworld.pixels_to_cells(images.cpu(), grid)  # [N, g, g]
    return [tuple(c) for c in cells.flatten(1).tolist()]


def cell_features(images: torch.Tensor, grid: int) -> torch.Tensor:
    """The palette cells read from the pixels, one-hot and flattened: float ``[N, L * C]``."""
    cells = toyworld.pixels_to_cells(images.cpu(), grid)  # [N, g, g]
    onehot = torch.nn.functional.one_hot(cells.long().flatten(1), len(toyworld.PALETTE))
    return onehot.flatten(1).float()


@register_reward("toy_rules", embeds=True)
def build_toy_rules(
    grid: int = 4, name: str = "toy_rules", terms: str = "score+correct"
) -> ToyRuleReward:
    """Factory for ``build_reward``: ``grid`` must match the toy model's ``model.toy.grid``;
    ``terms``: ``score+correct``, ``score`` or ``correct``."""
    r = ToyRuleReward(grid, terms)
    r.name = name
    return r


class ToyGenEvalReward:
    """GenEval's rule (``toyworld.score_toy``) on the toy world's pixels, from each prompt's
    metadata rather than its text: ``reward(images, prompts, metas) -> float [N]`` in {0, 1}.

    Reads the prompt files' metadata (``uses_prompt_metadata``: the scorer passes each image's
    prompt metadata). A prompt without GenEval metadata is an error for its batch (the scorer
    counts the lost samples and the run goes on), never a silent guess from the text.
    """

    name = "toy_geneval"
    uses_prompt_metadata = True

    def __init__(self, grid: int = 4) -> None:
        self.grid = grid

    def __call__(
        self,
        images: torch.Tensor,
        prompts: Sequence[str],
        metas: Sequence[dict | None] | None = None,
    ) -> torch.Tensor:
        metas = list(metas) if metas is not None else [None] * len(prompts)
        for prompt, meta in zip(prompts, metas, strict=True):
            if not meta or "include" not in meta:
                raise ValueError(
                    f"toy_geneval reward: prompt {prompt!r} has no GenEval metadata; use a "
                    "prompts file with tag/include per line (maskgrpo prompts make --kind toy)"
                )
        full = [{**m, "prompt": p} for p, m in zip(prompts, metas, strict=True) if m]
        return toyworld.score_toy(images, full, self.grid)["geneval"]

    def accuracy(
        self,
        images: torch.Tensor,
        prompts: Sequence[str],
        metas: Sequence[dict | None] | None = None,
    ) -> torch.Tensor:
        return self(images, prompts, metas)

    def embed(self, images: torch.Tensor) -> torch.Tensor:
        """The palette cells, one-hot (as :meth:`ToyRuleReward.embed`)."""
        return cell_features(images, self.grid)

    def layouts(self, images: torch.Tensor) -> list[tuple[int, ...]]:
        """The palette cells as a tuple per image (as :meth:`ToyRuleReward.layouts`)."""
        return cell_layouts(images, self.grid)


@register_reward("toy_geneval", embeds=True)
def build_toy_geneval(grid: int = 4, name: str = "toy_geneval") -> ToyGenEvalReward:
    """Factory for ``build_reward``: ``grid`` must match the toy model's ``model.toy.grid``."""
    r = ToyGenEvalReward(grid)
    r.name = name
    return r
