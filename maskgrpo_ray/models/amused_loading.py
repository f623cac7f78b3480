"""aMUSEd's files: a diffusers folder in the layout of ``amused/amused-256`` / ``amused-512``.

A folder holds ``model_index.json`` and one subfolder per component, each loaded with the class
the library ships for it: ``transformer/`` (diffusers ``UVit2DModel``), ``vqvae/`` (diffusers
``VQModel``), ``text_encoder/`` (transformers ``CLIPTextModelWithProjection``), ``tokenizer/``
(transformers ``CLIPTokenizer``) and ``scheduler/`` (``AmusedScheduler``'s config: the mask
token id and the masking schedule). Loading is safe: safetensors only (``use_safetensors=True``;
a component stored only as a pickled ``.bin`` is refused), ``local_files_only`` (nothing is
downloaded), no remote code. A name that is not a local folder is looked up in the Hugging Face
cache (``amused/amused-256`` once ``huggingface-cli download`` has filled it).

:func:`save_tiny_random_amused` writes a tiny folder of the same classes with random weights
(tests, CPU demos): same layout, same loader.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from maskgrpo_ray.models.showo_loading import ModelFilesMissing, resolve_pretrained_folder

COMPONENTS = ("transformer", "vqvae", "text_encoder", "tokenizer", "scheduler")
_WEIGHT_STEM = {"transformer": "diffusion_pytorch_model", "vqvae": "diffusion_pytorch_model"}
_WEIGHT_STEM["text_encoder"] = "model"  # transformers' name
LAYOUT = (
    "an aMUSEd diffusers folder (the amused/amused-256 layout: model_index.json, transformer/, "
    "vqvae/, text_encoder/, tokenizer/, scheduler/)"
)


@dataclass
class AmusedParts:
    """The loaded components of one aMUSEd folder."""

    transformer: Any  # diffusers UVit2DModel
    vqvae: Any  # diffusers VQModel
    text_encoder: Any  # transformers CLIPTextModelWithProjection
    tokenizer: Any  # transformers CLIPTokenizer
    mask_token_id: int  # AmusedScheduler.config.mask_token_id (vocab_size - 1)
    masking_schedule: str  # AmusedScheduler.config.masking_schedule: "cosine" | "linear"


def _weights_name(component: str, variant: str | None) -> str:
    stem = _WEIGHT_STEM[component]
    return f"{stem}.{variant}.safetensors" if variant else f"{stem}.safetensors"


def check_amused_folder(path: str, field: str, variant: str | None = None) -> Path:
    """The folder ``path`` resolves to, after checking that every component is there in
    safetensors; :class:`ModelFilesMissing` naming ``field``, the path and the fix otherwise."""
    fix = f"point {field} at {LAYOUT}, or fill the HF cache (huggingface-cli download <repo>)"
    try:
        folder = resolve_pretrained_folder(path)
    except ModelFilesMissing as err:
        raise ModelFilesMissing(f"{field}: {err}") from None
    needed = [folder / "model_index.json"] + [folder / c for c in COMPONENTS]
    for place in needed:
        if not place.exists():
            raise ModelFilesMissing(f"{field}: {place} does not exist; {fix}")
    for component in _WEIGHT_STEM:
        name = _weights_name(component, variant)
        sub = folder / component
        if not ((sub / name).is_file() or (sub / f"{name}.index.json").is_file()):
            held = sorted(p.name for p in sub.iterdir())
            raise ModelFilesMissing(
                f"{field}: {sub} has no {name} (only safetensors are read, never a pickled "
                f".bin; variant {variant!r}); it holds {held}; {fix}"
            )
    tok = folder / "tokenizer"
    if not ((tok / "tokenizer.json").is_file() or (tok / "vocab.json").is_file()):
        raise ModelFilesMissing(
            f"{field}: {tok} has neither tokenizer.json nor vocab.json + merges.txt; {fix}"
        )
    if not (folder / "scheduler" / "scheduler_config.json").is_file():
        raise ModelFilesMissing(f"{field}: {folder / 'scheduler'} has no scheduler_config.json")
    return folder


def load_amused_parts(
    path: str,
    *,
    field: str = "model.args.path",
    dtype: torch.dtype = torch.float32,
    vqvae_dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    variant: str | None = None,
) -> AmusedParts:
    """Load the five components of the folder ``path`` (see the module docstring).

    Args:
        path: a local folder or a repo id in the Hugging Face cache.
        field: the config field named in errors.
        dtype: the transformer's and the text encoder's weights; vqvae_dtype: the VQ-GAN's
            (float32: its fp16 decode gives NaNs, as the model card warns).
        variant: the weights variant (``"fp16"`` reads ``*.fp16.safetensors``).
    """
    from diffusers import UVit2DModel, VQModel
    from transformers import CLIPTextModelWithProjection, CLIPTokenizer

    folder = check_amused_folder(path, field, variant)
    safe: dict[str, Any] = {"use_safetensors": True, "local_files_only": True, "variant": variant}
    transformer = UVit2DModel.from_pretrained(folder / "transformer", torch_dtype=dtype, **safe)
    vqvae = VQModel.from_pretrained(folder / "vqvae", torch_dtype=vqvae_dtype, **safe)
    text_encoder: Any = CLIPTextModelWithProjection.from_pretrained(
        folder / "text_encoder", dtype=dtype, **safe
    )
    tokenizer = CLIPTokenizer.from_pretrained(folder / "tokenizer", local_files_only=True)
    scheduler = json.loads((folder / "scheduler" / "scheduler_config.json").read_text())
    return AmusedParts(
        transformer=transformer.to(device).eval(),
        vqvae=vqvae.to(device).eval(),
        text_encoder=text_encoder.to(device).eval(),
        tokenizer=tokenizer,
        mask_token_id=int(scheduler["mask_token_id"]),
        masking_schedule=str(scheduler.get("masking_schedule", "cosine")),
    )


def _write_tiny_clip_tokenizer(folder: Path, merges: tuple[str, ...]) -> None:
    """A byte-level BPE vocabulary in CLIP's order: the 256 byte symbols, the same with
    ``</w>``, the merges, then ``<|startoftext|>`` and ``<|endoftext|>`` (any text encodes)."""
    from tokenizers.pre_tokenizers import ByteLevel

    symbols = sorted(ByteLevel.alphabet())
    tokens = symbols + [s + "</w>" for s in symbols] + [m.replace(" ", "") for m in merges]
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(tokens)}))
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    config = {"model_max_length": 77, "tokenizer_class": "CLIPTokenizer"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


TINY_MERGES = ("r e", "o n", "t h", "th e</w>", "d o", "e d</w>", "o t</w>", "l e")


def _tiny_vqvae(codebook_size: int, vq_levels: int) -> Any:
    """A tiny VQ-GAN of ``vq_levels`` blocks (``2^(vq_levels - 1)`` pixels per token a side)."""
    from diffusers import VQModel

    return VQModel(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * vq_levels,
        up_block_types=("UpDecoderBlock2D",) * vq_levels,
        block_out_channels=(16,) * vq_levels,
        layers_per_block=1,
        act_fn="silu",
        latent_channels=4,
        norm_num_groups=4,
        num_vq_embeddings=codebook_size,
        mid_block_add_attention=False,
        lookup_from_codebook=True,
    )


def save_tiny_random_amused(
    folder: str | Path,
    *,
    seed: int = 0,
    codebook_size: int = 16,
    grid: int = 4,
    vq_levels: int = 3,
) -> Path:
    """Write a tiny aMUSEd folder: the real classes with random weights (``random_init_``:
    non-trivial logits), ``L = grid^2`` image tokens, ``V = codebook_size`` (the mask id is
    ``V + 1``, the U-ViT's last id, not ``V``: as in aMUSEd, codebook and mask ids are apart),
    images of ``grid * 2^(vq_levels - 1)`` pixels a side. The same ``seed`` writes the same
    weights."""
    from diffusers import AmusedScheduler, UVit2DModel
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, CLIPTokenizer

    from maskgrpo_ray.models.showo import random_init_

    out = Path(folder)
    _write_tiny_clip_tokenizer(out / "tokenizer", TINY_MERGES)
    tokenizer = CLIPTokenizer.from_pretrained(out / "tokenizer", local_files_only=True)
    clip = CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=77,
        projection_dim=8,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    text_encoder = random_init_(CLIPTextModelWithProjection(clip), seed)
    transformer: Any = UVit2DModel(
        hidden_size=32,
        cond_embed_dim=clip.projection_dim,
        micro_cond_encode_dim=2,
        micro_cond_embed_dim=5 * 2,  # five micro-conditions, each encoded to 2
        encoder_hidden_size=clip.hidden_size,
        vocab_size=codebook_size + 2,  # spare ids, the mask last (aMUSEd: 8192 + 64 ids)
        codebook_size=codebook_size,
        in_channels=16,
        block_out_channels=16,
        num_res_blocks=1,
        block_num_heads=2,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        sample_size=grid,
    )
    vqvae = _tiny_vqvae(codebook_size, vq_levels)
    random_init_(transformer, seed + 1)
    random_init_(vqvae, seed + 2, spread=0.1)
    transformer.save_pretrained(out / "transformer", safe_serialization=True)
    vqvae.save_pretrained(out / "vqvae", safe_serialization=True)
    text_encoder.save_pretrained(out / "text_encoder", safe_serialization=True)
    scheduler: Any = AmusedScheduler(mask_token_id=codebook_size + 1)
    scheduler.save_pretrained(out / "scheduler")
    index = {
        "_class_name": "AmusedPipeline",
        "scheduler": ["diffusers", "AmusedScheduler"],
        "text_encoder": ["transformers", "CLIPTextModelWithProjection"],
        "tokenizer": ["transformers", "CLIPTokenizer"],
        "transformer": ["diffusers", "UVit2DModel"],
        "vqvae": ["diffusers", "VQModel"],
    }
    (out / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
    return out
