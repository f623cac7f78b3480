"""The shapes world as a model kind (``model.kind: shapes``, settings ``model.shapes``) and a
prompt set (``data.prompts: shapes``: the training split; evaluation uses the held-out split),
with its GenEval rule for ``maskgrpo eval`` and the defaults its reward kinds take from it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from maskgrpo_ray.config import ShapesModelConfig
from maskgrpo_ray.models.registry import (
    GenEvalScorer,
    ModelEntry,
    register_model,
    register_prompt_set,
)
from maskgrpo_ray.worlds.shapes import judge, scenes
from maskgrpo_ray.worlds.shapes.policy import PolicySpec, ShapesPolicy, WorldSpec
from maskgrpo_ray.worlds.shapes.pretrain import load_or_pretrain
from maskgrpo_ray.worlds.shapes.reward_model import RewardModelSpec
from maskgrpo_ray.worlds.shapes.reward_model import load_or_train as load_or_train_reward

if TYPE_CHECKING:
    import torch

    from maskgrpo_ray.config import Config, ModelConfig

REWARD_KINDS = ("shapes_clip", "shapes_judge")


def world_spec(s: ShapesModelConfig) -> WorldSpec:
    return WorldSpec(s.grid, s.patch_px, s.max_codes, s.codebook_renders, s.seed)


def policy_spec(s: ShapesModelConfig) -> PolicySpec:
    """The ``model.shapes`` section as the base policy's spec."""
    return PolicySpec(
        world=world_spec(s),
        d_model=s.d_model,
        layers=s.layers,
        heads=s.heads,
        ff_mult=s.ff_mult,
        pretrain_steps=s.pretrain_steps,
        pretrain_batch=s.pretrain_batch,
        pretrain_lr=s.pretrain_lr,
        noise_prob=s.noise_prob,
        seed=s.seed,
    )


def reward_spec(s: ShapesModelConfig) -> RewardModelSpec:
    """The ``model.shapes`` section as the reward model's spec."""
    return RewardModelSpec(
        world_spec(s),
        s.reward_dim,
        s.reward_width,
        s.reward_steps,
        s.reward_batch,
        s.reward_lr,
        s.seed,
    )


def _build(model: ModelConfig, device: torch.device) -> ShapesPolicy:
    return load_or_pretrain(policy_spec(model.shapes)).to(device)


def _prepare(model: ModelConfig) -> None:
    """Pre-train (or load) the tokenizer, the base policy and the reward model once, in the
    driver, so that no actor builds them."""
    load_or_pretrain(policy_spec(model.shapes))
    load_or_train_reward(reward_spec(model.shapes))


def _check(cfg: Config) -> None:
    tokens = cfg.model.shapes.grid**2
    for field, steps in (
        ("rollout.unmasking_steps", cfg.rollout.unmasking_steps),
        ("eval.unmasking_steps", cfg.eval.unmasking_steps or 0),
    ):
        if steps > tokens:
            raise ValueError(
                f"{field}={steps} exceeds the shapes image's {tokens} tokens: every step must "
                f"commit at least one token; lower {field}"
            )


def _reward_defaults(model: ModelConfig, reward_kind: str) -> dict[str, Any]:
    """The world's settings for its reward kinds (the reward model is the world's own)."""
    s = model.shapes
    if reward_kind == "shapes_judge":
        return {"grid": s.grid, "patch_px": s.patch_px}
    if reward_kind == "shapes_clip":
        r = reward_spec(s)
        w = r.world
        return {
            "grid": w.grid,
            "patch_px": w.patch_px,
            "max_codes": w.max_codes,
            "codebook_renders": w.codebook_renders,
            "seed": s.seed,
            "dim": r.dim,
            "width": r.width,
            "steps": r.steps,
            "batch": r.batch,
            "lr": r.lr,
            "clutter": r.clutter,
        }
    return {}


def _geneval_rule(model: ModelConfig) -> GenEvalScorer:
    patch_px = model.shapes.patch_px  # GenEval's rule on the detector's objects
    return lambda images, metas: {"geneval": judge.judge(images, metas, patch_px)["geneval"]}


def shapes_prompts(split: str) -> list[str]:
    """The grammar's prompts: the training split, or the held-out evaluation split."""
    train, held_out = scenes.split_prompts()
    return [p.text for p in (train if split == "train" else held_out)]


def shapes_prompt_metadata(text: str) -> dict[str, Any]:
    """A prompt's GenEval metadata line."""
    return scenes.parse(text).metadata()


register_model(
    "shapes",
    ModelEntry(
        build=_build,
        config_section=ShapesModelConfig,
        check=_check,
        prepare=_prepare,
        reward_defaults=_reward_defaults,
        geneval_rule=_geneval_rule,
    ),
)
register_prompt_set("shapes", shapes_prompts, metadata=shapes_prompt_metadata)
