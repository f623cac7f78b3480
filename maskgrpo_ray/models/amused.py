"""aMUSEd (``model.kind: amused``) as a :class:`MaskedImagePolicy`, equal to ``AmusedPipeline``.

diffusers' own classes, as the library ships them (``models/amused_loading.py`` loads them):
the U-ViT ``UVit2DModel`` (trained), the VQ-GAN ``VQModel`` and the CLIP-L/14 text encoder
``CLIPTextModelWithProjection`` (both frozen, ``requires_grad=False``), the ``CLIPTokenizer``.

* Prompting: ``tokenize`` pads every prompt to the tokenizer's ``model_max_length`` (77) as the
  pipeline does (``long [B, 77]``); ``null_condition`` is the empty prompt, the pipeline's
  default negative prompt. A binding encodes each distinct prompt once (no gradient):
  ``text_embeds`` (the pooled projection) and ``hidden_states[-2]``, the pipeline's two inputs.
* Micro-conditioning: ``[width, height, crop_0, crop_1, aesthetic score]`` in the text
  states' dtype, the pipeline's order (width first) and defaults (the image's size, ``(0, 0)``,
  6).
* Guidance exactly as ``AmusedPipeline``: with ``guidance_scale > 1`` the unconditional rows run
  first in one batch with the conditional ones and ``uncond + w * (cond - uncond)``; at
  ``w <= 1`` the conditional logits alone (not Show-o's ``cfg_mix``).
* Codebook space: states hold ``V = codebook_size`` for a mask; the U-ViT gets aMUSEd's
  ``mask_token_id`` (``vocab_size - 1``) there. Logits ``[N, V, h, w]`` become ``[N, L, V]``.
* Schedules (``AmusedScheduler``): :class:`AmusedMaskSchedule` (cosine or linear ``mask_len``
  with its floor and clamps) and :class:`LinspaceAnneal` (``torch.linspace(tau_0, end, S)``,
  the Gumbel temperature of ``mask_by_random_topk``; the rollout's ``gumbel_temperature`` is
  ``tau_0``, aMUSEd's default 2).
* ``decode_images``: ``VQModel.decode(..., force_not_quantize=True).sample.clip(0, 1)``, then
  ``round(255 x)`` as the pipeline's image processor: ``uint8 [N, H, W, 3]``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from maskgrpo_ray.models.amused_loading import (
    AmusedParts,
    check_amused_folder,
    load_amused_parts,
)
from maskgrpo_ray.models.base import LogitsFn, MaskedImagePolicy
from maskgrpo_ray.models.registry import ModelEntry, register_model
from maskgrpo_ray.weights.hub_field import HubField

if TYPE_CHECKING:
    from maskgrpo_ray.config import Config, ModelConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class AmusedModelConfig(BaseModel):
    """``model.args`` of ``model.kind: amused``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str = Field(
        description="aMUSEd diffusers folder (amused/amused-256 layout), an HF cache repo id, or "
        "a hub id hf://org/name[@revision] (downloaded by the driver)"
    )
    variant: Literal["fp16"] | None = Field(
        None, description="weights variant to read ('fp16': *.fp16.safetensors); null: default"
    )
    resolution_px: int | None = Field(
        None,
        ge=1,
        description="image side in pixels (a multiple of the VQ-GAN's downscale, 16); null: the "
        "pipeline's default, transformer sample_size x downscale (256 or 512)",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="dtype of the U-ViT and the text encoder (the VQ-GAN is float32)"
    )
    masking_schedule: Literal["cosine", "linear"] | None = Field(
        None, description="AmusedScheduler's mask_len schedule; null: the folder's scheduler's"
    )
    gumbel_temperature_end: float = Field(
        0.0,
        ge=0,
        description="end of AmusedScheduler's Gumbel temperatures linspace(tau_0, end, S); tau_0 "
        "is rollout.gumbel_temperature (the pipeline's default (2, 0))",
    )
    micro_cond_orig_size: tuple[int, int] | None = Field(
        None,
        description="micro-conditioning (width, height) in pixels; null: the generated image's "
        "size, as AmusedPipeline passes",
    )
    micro_cond_crop_coords: tuple[int, int] = Field(
        (0, 0), description="micro-conditioning crop coordinates (the pipeline's default (0, 0))"
    )
    micro_cond_aesthetic_score: float = Field(
        6.0, description="micro-conditioning aesthetic score (the pipeline's default 6)"
    )
    decode_batch_size: int = Field(8, ge=1, description="images per VQ-GAN decode call")


@dataclass(frozen=True)
class AmusedMaskSchedule:
    """``AmusedScheduler.step``'s ``mask_len``, positions left masked after step ``t`` of ``S``.

    ``r = (t + 1) / S`` (float32), ``ratio = cos(r pi / 2)`` (cosine) or ``1 - r`` (linear),
    ``m_t = max(1, min(masked - 1, floor(L ratio)))``, and 0 at the last step (the scheduler's
    ``timestep == 0`` commits every position). The same tensor operations as the scheduler, so
    the floors agree bit for bit.
    """

    kind: str = "cosine"

    def __call__(self, step: int, num_steps: int, num_tokens: int, num_masked: int) -> int:
        if step >= num_steps - 1:
            return 0
        ratio = (torch.tensor(step) + 1) / num_steps  # (step_idx + 1) / len(timesteps)
        if self.kind == "cosine":
            mask_ratio = torch.cos(ratio * math.pi / 2)
        elif self.kind == "linear":
            mask_ratio = 1 - ratio
        else:
            raise ValueError(f"unknown masking schedule {self.kind!r}: 'cosine' or 'linear'")
        mask_len = int((num_tokens * mask_ratio).floor())
        return max(1, min(num_masked - 1, mask_len))


class LinspaceAnneal:
    """``AmusedScheduler``'s Gumbel temperature: ``tau_t = torch.linspace(tau_0, end, S)[t]``.

    A :data:`GumbelAnneal` sees ``(tau_{t-1}, t, S)``; the start is the ``tau_0`` that step 0
    receives. Step 0 computes the whole float32 ``linspace`` (the scheduler's own call, so the
    values agree bit for bit) and keeps ``(tau_{t-1}, t, S) -> tau_t``; later steps read it.
    A ``tau_{t-1}`` that no step 0 produced gets the same line in float arithmetic,
    ``tau + (end - tau) / (S - t)`` (within an ulp or two of ``linspace``).
    """

    _MAX_KEPT = 4096

    def __init__(self, end: float = 0.0) -> None:
        self.end = float(end)
        self._next: dict[tuple[float, int, int], float] = {}

    def __call__(self, tau: float, step: int, num_steps: int) -> float:
        if step == 0:
            temps = torch.linspace(tau, self.end, num_steps).tolist()  # float32 values
            if len(self._next) > self._MAX_KEPT:
                self._next.clear()
            for t in range(1, num_steps):
                self._next[(temps[t - 1], t, num_steps)] = temps[t]
            return float(temps[0])
        known = self._next.get((tau, step, num_steps))
        if known is not None:
            return known
        return tau + (self.end - tau) / (num_steps - step)


class AmusedPolicy(MaskedImagePolicy):
    """aMUSEd (U-ViT + VQ-GAN + CLIP text encoder) behind the policy interface."""

    def __init__(
        self,
        parts: AmusedParts,
        *,
        resolution_px: int | None = None,
        masking_schedule: str | None = None,
        gumbel_temperature_end: float = 0.0,
        micro_cond_orig_size: tuple[int, int] | None = None,
        micro_cond_crop_coords: tuple[int, int] = (0, 0),
        micro_cond_aesthetic_score: float = 6.0,
        decode_batch_size: int = 8,
    ):
        super().__init__()
        tcfg, vcfg = parts.transformer.config, parts.vqvae.config
        if vcfg.num_vq_embeddings != tcfg.codebook_size:
            raise ValueError(
                f"VQ-GAN codebook {vcfg.num_vq_embeddings} != U-ViT codebook {tcfg.codebook_size}"
            )
        if not tcfg.codebook_size <= parts.mask_token_id < tcfg.vocab_size:
            raise ValueError(
                f"mask_token_id {parts.mask_token_id} is not an extra id of the U-ViT "
                f"(codebook {tcfg.codebook_size}, vocabulary {tcfg.vocab_size})"
            )
        scale = 2 ** (len(vcfg.block_out_channels) - 1)  # the pipeline's vae_scale_factor
        resolution_px = resolution_px or tcfg.sample_size * scale
        if resolution_px % scale:
            raise ValueError(f"resolution_px {resolution_px} is not a multiple of {scale}")
        side = resolution_px // scale
        self.transformer = parts.transformer
        self.text_encoder = parts.text_encoder.requires_grad_(False)
        self.vqvae = parts.vqvae.requires_grad_(False)
        self.tokenizer = parts.tokenizer
        self.mask_token_id = parts.mask_token_id
        self.codebook_size = int(tcfg.codebook_size)
        self.num_image_tokens = side * side
        self.image_grid = (side, side)
        self.resolution_px = resolution_px
        self.mask_schedule = AmusedMaskSchedule(masking_schedule or parts.masking_schedule)
        self.gumbel_anneal = LinspaceAnneal(gumbel_temperature_end)
        width, height = micro_cond_orig_size or (resolution_px, resolution_px)
        self.micro_conds = (width, height, *micro_cond_crop_coords, micro_cond_aesthetic_score)
        self.decode_batch_size = decode_batch_size

    @property
    def device(self) -> torch.device:
        return next(self.transformer.parameters()).device

    def set_activation_checkpointing(self, enabled: bool) -> bool:
        """Not supported: ``UVit2DModel``'s own switch (``gradient_checkpointing``) fails in
        diffusers 0.42.1 (its checkpointed layer takes no keyword arguments but is called with
        them), and the library's classes are used as shipped."""
        return not enabled

    def tokenize(self, prompts: Sequence[str]) -> torch.Tensor:
        """Prompts -> CLIP ids ``long [B, 77]``, padded and truncated as the pipeline does."""
        return self.tokenizer(
            list(prompts),
            return_tensors="pt",
            padding="max_length",
            truncation=True,
            max_length=self.tokenizer.model_max_length,
        ).input_ids.long()

    def null_condition(self, n: int) -> torch.Tensor:
        """The empty prompt (the pipeline's negative prompt), ``long [n, 77]``."""
        return self.tokenize([""]).expand(n, -1).clone()

    @torch.no_grad()
    def _encode(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The pipeline's two text inputs for ``ids [B, P]``, one batch: the pooled projection
        ``text_embeds [B, D]`` and the penultimate ``hidden_states[-2] [B, P, H]``."""
        out = self.text_encoder(ids.to(self.device), return_dict=True, output_hidden_states=True)
        return out.text_embeds, out.hidden_states[-2]

    def encode_prompts(self, cond_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """CLIP features of ``cond_ids [N, P]`` (no gradient), each distinct row encoded once
        (one batch): ``text_embeds [N, D]`` and ``hidden_states[-2] [N, P, H]``."""
        unique, inverse = torch.unique(cond_ids, dim=0, return_inverse=True)
        pooled, hidden = self._encode(unique)
        inverse = inverse.to(pooled.device)
        return pooled[inverse], hidden[inverse]

    def conditioned(self, cond_ids: torch.Tensor, guidance_scale: float = 0.0) -> LogitsFn:
        """Bind ``cond_ids [N, P]``; ``f(image_tokens [N, L]) -> float32 logits [N, L, V]``.

        ``guidance_scale > 1``: ``uncond + w (cond - uncond)`` in the U-ViT's dtype, the
        unconditional rows first in the batch (AmusedPipeline's order and arithmetic).
        """
        n = cond_ids.shape[0]
        side_h, side_w = self.image_grid
        guided = guidance_scale > 1.0  # AmusedPipeline: guidance only above 1
        pooled, hidden = self.encode_prompts(cond_ids)  # [N, D], [N, P, H]
        if guided:
            # One empty prompt per distinct prompt in one batch, as the pipeline encodes its
            # negative prompts: CLIP's last bits depend on the batch (1e-7 between 1 and 2 rows).
            distinct = len(torch.unique(cond_ids, dim=0))
            null_pooled, null_hidden = self._encode(self.null_condition(distinct))
            rows = torch.zeros(n, dtype=torch.long, device=pooled.device)
            pooled = torch.cat((null_pooled[rows], pooled))  # [2N, D]
            hidden = torch.cat((null_hidden[rows], hidden))  # [2N, P, H]
        micro = torch.tensor([self.micro_conds], dtype=hidden.dtype, device=hidden.device)
        micro = micro.expand(pooled.shape[0], -1)  # [M, 5]

        def logits(image_tokens: torch.Tensor) -> torch.Tensor:
            if image_tokens.shape != (n, self.num_image_tokens):
                raise ValueError(
                    f"image tokens {tuple(image_tokens.shape)} != bound {(n, self.num_image_tokens)}"
                )
            tokens = image_tokens.to(self.device)
            ids = torch.where(tokens == self.codebook_size, self.mask_token_id, tokens)
            ids = ids.view(n, side_h, side_w)
            if guided:
                ids = torch.cat((ids, ids))
            out = self.transformer(
                ids, micro_conds=micro, pooled_text_emb=pooled, encoder_hidden_states=hidden
            )  # [M, V, h, w]
            if guided:
                uncond, cond = out.chunk(2)
                out = uncond + guidance_scale * (cond - uncond)
            return out.flatten(2).transpose(1, 2).float()  # [N, L, V]

        return logits

    @torch.no_grad()
    def decode_images(self, image_tokens: torch.Tensor) -> torch.Tensor:
        """Codebook tokens ``long [N, L]`` -> ``uint8 [N, H, W, 3]``, the pipeline's decode."""
        h, w = self.image_grid
        channels = self.vqvae.config.latent_channels
        ids = image_tokens.clamp(0, self.codebook_size - 1)
        ids = ids.to(next(self.vqvae.parameters()).device)
        chunks = []
        for part in ids.split(self.decode_batch_size):
            shape = (part.shape[0], h, w, channels)
            pixels = self.vqvae.decode(part.view(-1, h, w), force_not_quantize=True, shape=shape)
            rgb = pixels.sample.clip(0, 1).permute(0, 2, 3, 1).float()  # [n, H, W, 3] in [0, 1]
            chunks.append((rgb * 255).round().to(torch.uint8))
        return torch.cat(chunks).cpu()


def amused_settings(model: ModelConfig) -> AmusedModelConfig:
    """``model.args`` of an ``amused`` model section, validated."""
    return AmusedModelConfig.model_validate(model.args)


def policy_from_settings(
    s: AmusedModelConfig, device: torch.device | str | None = None
) -> AmusedPolicy:
    """The policy that ``model.args`` describe, loaded on ``device`` (CPU by default)."""
    parts = load_amused_parts(
        s.path, dtype=DTYPES[s.dtype], device=torch.device(device or "cpu"), variant=s.variant
    )
    return AmusedPolicy(
        parts,
        resolution_px=s.resolution_px,
        masking_schedule=s.masking_schedule,
        gumbel_temperature_end=s.gumbel_temperature_end,
        micro_cond_orig_size=s.micro_cond_orig_size,
        micro_cond_crop_coords=s.micro_cond_crop_coords,
        micro_cond_aesthetic_score=s.micro_cond_aesthetic_score,
        decode_batch_size=s.decode_batch_size,
    )


def _build(model: ModelConfig, device: torch.device) -> AmusedPolicy:
    return policy_from_settings(amused_settings(model), device)


def _check(cfg: Config) -> None:
    scales: dict[str, float | None] = {
        "rollout.guidance_scale": cfg.rollout.guidance_scale,
        "eval.guidance_scale": cfg.eval.guidance_scale,
    }
    for key, w in scales.items():
        if w is not None and 0.0 < w < 1.0:
            raise ValueError(
                f"{key}={w}: aMUSEd guides as AmusedPipeline, uncond + w (cond - uncond) only for "
                "w > 1 (w <= 1 gives the conditional logits alone); set 0 (off) or a scale > 1 "
                "(the pipeline's default is 10)"
            )


def _check_files(model: ModelConfig) -> None:
    s = amused_settings(model)
    check_amused_folder(s.path, "model.args.path", s.variant)


register_model(
    "amused",
    ModelEntry(
        build=_build,
        config_section=AmusedModelConfig,
        check=_check,
        check_files=_check_files,
        # the loader reads safetensors only: a repo's pickled and other-framework files stay
        hub_fields=(HubField("args.path", ignore_patterns=("*.bin", "*.msgpack", "*.onnx*")),),
    ),
)
