"""The ``evidence`` section: what a config's recipe is known to keep, and where that is written.

``maskgrpo plan --config`` prints it beside the recipe's images per GPU-second, so a speed is
never quoted without what it costs in quality. A recipe is the settings that can change what a
run learns (the selection of unmasking steps, the batch, the lag, the objective, ...); the
cluster plumbing (actor counts, resources, paths, checkpoints, logging) is not part of it, so
changing it keeps the evidence (:func:`recipe_keys`).

Part of the one config tree (:mod:`maskgrpo_ray.config`, the import point); plain pydantic.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from maskgrpo_ray.config.base import Strict

LABELS = {
    "none": "no quality evidence",
    "paper": "paper",
    "proxy_toy": "proxy (toy)",
    "proxy_shapes": "proxy (shapes world)",
    "other_model": "another model's paper",
}
"""How the planner names each source: a proxy world's figures are never a real model's."""


class EvidenceConfig(Strict):
    """What the config's recipe is known to keep, measured where (``maskgrpo plan`` prints it)."""

    source: Literal["none", "paper", "proxy_toy", "proxy_shapes", "other_model"] = Field(
        "none",
        description="where the recipe's quality was measured: paper (the Mask-GRPO paper's own "
        "figure for this setting), proxy_toy / proxy_shapes (a paired figure on the embedded "
        "toy world / the GenEval-shaped shapes world: a proxy, not the real model), "
        "other_model (a published figure of the same reward on another model, not this "
        "one), none",
    )
    quality: str = Field(
        "",
        description="the figure, e.g. 'GenEval 0.73 (Show-o base 0.53)'; empty with source none",
    )
    reference: str = Field(
        "", description="where the figure is written (a paper's table, a doc's section)"
    )
    levers: str = Field(
        "",
        description="what another world measured on a lever this recipe shares (learning rate, "
        "EMA, KL, B, ...), naming the world, and what this file does with it; printed after "
        "the evidence line (a proxy's finding never replaces a real model's figure)",
    )

    @model_validator(mode="after")
    def _complete(self) -> EvidenceConfig:
        if self.source != "none" and not (self.quality and self.reference):
            raise ValueError(
                f"evidence.source={self.source!r} without evidence.quality and "
                "evidence.reference: a source needs the figure and where it is written; set "
                "both, or source 'none'"
            )
        if self.source == "none" and (self.quality or self.reference):
            raise ValueError(
                f"evidence.quality={self.quality!r} with evidence.source='none': name where the "
                "figure was measured (paper, proxy_toy or proxy_shapes), or leave quality empty"
            )
        return self

    def line(self) -> str:
        """One line: ``paper: GenEval 0.73 (...) [reference]``, or ``no quality evidence``."""
        out = (
            LABELS["none"]
            if self.source == "none"
            else f"{LABELS[self.source]}: {self.quality} [{self.reference}]"
        )
        return f"{out}; shared levers: {self.levers}" if self.levers else out


# fields that do not change what a run learns: the cluster's shape, resources and bookkeeping
_PLUMBING_SECTIONS = ("run.", "logging.", "learner.", "data.", "eval.", "evidence.")
_PLUMBING_LEAVES = (
    "num_actors",
    "num_cpus_per_actor",
    "num_gpus_per_actor",
    "custom_resources",
    "max_restarts",
    "call_timeout_seconds",
    "prompts_per_chunk",
    "micro_batch_pairs_per_gpu",
    # the step-signal probe measures on its own streams (the weights learned are the same)
    "step_signal_every_steps",
    "step_signal_batches",
    "step_signal_prompts_per_batch",
)


def recipe_keys(keys: list[str]) -> list[str]:
    """The dotted keys among ``keys`` (``--set`` overrides) that change the recipe, so that the
    file's evidence no longer applies. ``data.`` counts as plumbing (it names files), ``eval.`` too
    (it changes what is measured, not what is learned)."""
    out = []
    for key in keys:
        if key.startswith(_PLUMBING_SECTIONS) or key.rsplit(".", 1)[-1] in _PLUMBING_LEAVES:
            continue
        out.append(key)
    return out
