"""The policy interface shared by the rollout, the learner and every model.

A *masked image policy* is a text-conditioned masked generative model over a codebook of ``V``
image tokens laid out on ``L`` positions. Its state convention is fixed here once:

* image tokens are ``long [N, L]`` in *codebook space* ``0 .. V-1``;
* a masked position holds ``V`` (``policy.mask_index``), never a vocabulary id of the model.

Conditions are the policy's own token ids ``long [N, P]`` (``tokenize`` makes them, padded so
that rows stack). ``conditioned`` binds a batch of conditions (and the guidance scale) and
returns a :data:`LogitsFn` that maps image states to codebook logits; the pure algorithms in
``maskgrpo_ray.algo`` only ever see that function. Binding first lets a model reuse work that
depends on the text alone (Show-o's text-prefix keys and values) across all unmasking steps.

A policy also carries its sampler's schedules: ``mask_schedule`` (how many positions stay masked
after each unmasking step) and ``gumbel_anneal`` (the remasking noise's temperature per step),
Show-o's by default; :func:`maskgrpo_ray.pipeline.phases.generate` passes them to the sampler. A model
with other schedules overrides them (``mask_schedule = staticmethod(my_schedule)``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

import torch
from torch import nn

from maskgrpo_ray.algo.schedule import (
    GumbelAnneal,
    MaskSchedule,
    compounding_anneal,
    num_masked_after_step,
)

# image tokens [N, L] (masked = V) -> codebook logits [N, L, V], float32
LogitsFn = Callable[[torch.Tensor], torch.Tensor]


def cfg_mix(cond: torch.Tensor, uncond: torch.Tensor, guidance_scale: float) -> torch.Tensor:
    """Show-o's classifier-free guidance: ``(1 + w) * cond - w * uncond``.

    Note this is *not* ``uncond + w (cond - uncond)``: Show-o's ``w`` equals the usual scale
    minus one. ``w = 0`` returns ``cond`` unchanged.
    """
    if guidance_scale == 0.0:
        return cond
    return (1.0 + guidance_scale) * cond - guidance_scale * uncond


def prompt_problems(policy: MaskedImagePolicy, prompts: Sequence[str]) -> list[str | None]:
    """Per prompt: None if ``policy`` can read it, else why (its tokenizer's ValueError)."""
    out: list[str | None] = []
    for prompt in prompts:
        try:
            policy.tokenize([prompt])
            out.append(None)
        except ValueError as err:
            out.append(str(err))
    return out


class MaskedImagePolicy(nn.Module, ABC):
    """Abstract text-to-image masked generative policy (toy model, Show-o, ...)."""

    codebook_size: int  # V
    num_image_tokens: int  # L
    image_grid: tuple[int, int]  # (h, w) with h * w == L, row-major
    mask_schedule: MaskSchedule = staticmethod(num_masked_after_step)  # Show-o's cosine m_t
    gumbel_anneal: GumbelAnneal = staticmethod(compounding_anneal)  # Show-o's compounding tau_t

    @property
    def mask_index(self) -> int:
        """The value a masked position holds in codebook-space states (``V``)."""
        return self.codebook_size

    @abstractmethod
    def tokenize(self, prompts: Sequence[str]) -> torch.Tensor:
        """Prompts -> condition ids ``long [B, P]`` (the policy's own prompt layout)."""

    @abstractmethod
    def null_condition(self, n: int) -> torch.Tensor:
        """The unconditional prompt for guidance, ``long [n, P]`` (same ``P`` as ``tokenize``)."""

    def set_activation_checkpointing(self, enabled: bool) -> bool:
        """Recompute activations in the backward pass instead of keeping them (memory for
        compute; the gradients are the same). Returns whether this model supports it."""
        return not enabled

    @abstractmethod
    def conditioned(self, cond_ids: torch.Tensor, guidance_scale: float = 0.0) -> LogitsFn:
        """Bind conditions ``long [N, P]``; return ``f(image_tokens [N, L]) -> logits [N, L, V]``.

        With ``guidance_scale > 0`` the returned logits are :func:`cfg_mix` of the conditional
        and unconditional logits at the same image state. Gradients flow when called outside
        ``torch.no_grad``.
        """

    @abstractmethod
    def decode_images(self, image_tokens: torch.Tensor) -> torch.Tensor:
        """Codebook tokens ``long [N, L]`` (no mask) -> pixels ``uint8 [N, H, W, 3]``."""
