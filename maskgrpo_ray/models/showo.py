"""Show-o as a :class:`MaskedImagePolicy`: the transformer, MAGVIT-v2 and universal prompting.

* ``tokenize`` gives Show-o's t2i text prefix ``long [B, P]`` (``P = max_text_len + 1`` = 129);
  ``conditioned`` appends ``<|soi|>``, the ``L`` image tokens and ``<|eoi|>`` per call.
* ``conditioned(cond_ids, w)`` returns float32 codebook logits ``[N, L, V]``: the columns
  ``offset .. offset+V-1`` of the image positions (the mask id dropped), with Show-o's guidance
  ``(1 + w) cond - w uncond`` where the conditional and unconditional rows run as one batch.
* Text-prefix reuse (default): text rows never attend to image rows, so the text's keys and
  values are computed once per distinct prompt and reused by every call of the bound function
  (all unmasking steps, all ``G`` samples); only the ``L + 2`` image rows run per call. With
  gradients on, each call recomputes the (deduplicated) prefix so that any backward pattern is
  correct, unless ``share_prefix_graph`` (one graph shared by all calls of a binding: backward
  once, over their summed loss).
* MAGVIT-v2 is frozen (``requires_grad=False``) and decodes in chunks to ``uint8 [N, H, W, 3]``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TypeVar

import torch
from torch import nn

from maskgrpo_ray.config import ShowoModelConfig
from maskgrpo_ray.models.base import LogitsFn, MaskedImagePolicy, cfg_mix
from maskgrpo_ray.models.magvit import CoderConfig, MagvitConfig, MAGVITv2, pixels_to_uint8
from maskgrpo_ray.models.registry import ModelEntry, register_model
from maskgrpo_ray.models.showo_loading import (
    BUILTIN_TOKENIZERS,
    DEFAULT_MAGVIT,
    HUB_FIELDS,
    ShowoFolderConfig,
    check_model_files,
    load_magvit,
    load_showo_transformer,
    resolve_pretrained_folder,
    save_showo_folder,
)
from maskgrpo_ray.models.showo_phi import LayerKV, PhiConfig, ShowoTransformer
from maskgrpo_ray.models.showo_prompting import (
    HashingWordTokenizer,
    IntegerIdTokenizer,
    ShowoVocab,
    TextTokenizer,
    image_rows_allow,
    image_segment,
    load_phi_tokenizer,
    omni_attention_allow,
    t2i_text_prefix,
    t2i_text_prefixes,
)

if TYPE_CHECKING:
    from maskgrpo_ray.config import Config, ModelConfig

log = logging.getLogger(__name__)
ModuleT = TypeVar("ModuleT", bound=nn.Module)
MAGVIT_DOWNSAMPLE = 16  # pixels per image token side


class _TextPrefix:
    """Keys/values of a bound batch's text prefixes, computed once per distinct prompt."""

    def __init__(
        self, model: ShowoTransformer, text_ids: torch.Tensor, vocab: ShowoVocab, share: bool
    ):
        self.model, self.share = model, share
        self.unique, self.inverse = torch.unique(text_ids, dim=0, return_inverse=True)  # [U, P]
        self.allow = omni_attention_allow(self.unique, vocab)  # [U, 1, P, P]
        self._cached: list[LayerKV] | None = None
        self._cached_grad: list[LayerKV] | None = None

    def _compute(self) -> list[LayerKV]:
        return self.model.text_kv(self.unique, self.allow)  # per layer [U, H, P, D]

    def rows(self) -> list[LayerKV]:
        """Per-row keys/values ``[M, H, P, D]`` for the bound rows."""
        grad = torch.is_grad_enabled() and any(p.requires_grad for p in self.model.parameters())
        if not grad:
            if self._cached is None:
                with torch.no_grad():
                    self._cached = self._compute()
            kv = self._cached
        elif self.share:
            if self._cached_grad is None:
                self._cached_grad = self._compute()
            kv = self._cached_grad
        else:
            kv = self._compute()
        return [(k.index_select(0, self.inverse), v.index_select(0, self.inverse)) for k, v in kv]


class ShowoPolicy(MaskedImagePolicy):
    """Show-o (Phi-1.5 transformer + MAGVIT-v2) behind the policy interface."""

    def __init__(
        self,
        transformer: ShowoTransformer,
        vq: MAGVITv2,
        tokenizer: TextTokenizer,
        vocab: ShowoVocab,
        *,
        num_image_tokens: int,
        max_text_len: int = 128,
        reuse_text_prefix: bool = True,
        share_prefix_graph: bool = False,
        decode_batch_size: int = 8,
        llm_model_path: str = "microsoft/phi-1_5",
    ):
        super().__init__()
        if transformer.config.vocab_size != vocab.vocab_size:
            raise ValueError(
                f"transformer vocabulary {transformer.config.vocab_size} != Show-o layout "
                f"{vocab.vocab_size} (llm_vocab_size + 10 + codebook_size + 1)"
            )
        if vq.config.codebook_size != vocab.codebook_size:
            raise ValueError(
                f"MAGVIT codebook {vq.config.codebook_size} != Show-o codebook {vocab.codebook_size}"
            )
        side = math.isqrt(num_image_tokens)
        if side * side != num_image_tokens:
            raise ValueError(f"num_image_tokens {num_image_tokens} must be a square (h = w)")
        self.transformer = transformer
        self.vq = vq.requires_grad_(False)
        self.tokenizer = tokenizer
        self.vocab = vocab
        self.codebook_size = vocab.codebook_size
        self.num_image_tokens = num_image_tokens
        self.image_grid = (side, side)
        self.max_text_len = max_text_len
        self.reuse_text_prefix = reuse_text_prefix
        self.share_prefix_graph = share_prefix_graph
        self.decode_batch_size = decode_batch_size
        self.llm_model_path = llm_model_path

    @property
    def device(self) -> torch.device:
        return self.transformer.showo.lm_head.weight.device

    def set_activation_checkpointing(self, enabled: bool) -> bool:
        """Each Phi decoder layer recomputed in backward (``torch.utils.checkpoint``)."""
        self.transformer.showo.model.gradient_checkpointing = enabled
        return True

    def tokenize(self, prompts: Sequence[str]) -> torch.Tensor:
        """Prompts -> t2i text prefixes ``long [B, max_text_len + 1]`` (on the CPU)."""
        return t2i_text_prefixes(prompts, self.tokenizer, self.vocab, self.max_text_len)

    def null_condition(self, n: int) -> torch.Tensor:
        """The ``''`` prompt: ``[PAD]*(P-3) <|t2i|> BOS EOS``, ``long [n, P]``."""
        return self.tokenize([""]).expand(n, -1).clone()

    def conditioned(self, cond_ids: torch.Tensor, guidance_scale: float = 0.0) -> LogitsFn:
        n, p = cond_ids.shape
        big_l, vocab = self.num_image_tokens, self.vocab
        guided = guidance_scale != 0.0
        text = cond_ids.to(self.device)
        if guided:  # rows [0, n) conditional, [n, 2n) unconditional
            null = torch.tensor(t2i_text_prefix([], vocab, p - 1), device=self.device)
            text = torch.cat((text, null.expand(n, -1)), dim=0)  # [2N, P]
        image_rows = slice(1, big_l + 1)  # soi | image tokens | eoi
        columns = vocab.codebook_columns

        def batch(image_tokens: torch.Tensor) -> torch.Tensor:
            if image_tokens.shape != (n, big_l):
                raise ValueError(f"image tokens {tuple(image_tokens.shape)} != bound {(n, big_l)}")
            seg = image_segment(image_tokens.to(self.device), vocab)  # [N, L+2]
            return torch.cat((seg, seg), dim=0) if guided else seg

        def mix(logits: torch.Tensor) -> torch.Tensor:  # [M, L, V] -> [N, L, V]
            if not guided:
                return logits
            cond, uncond = logits.chunk(2)
            return cfg_mix(cond, uncond, guidance_scale)

        if not self.reuse_text_prefix:

            def full(image_tokens: torch.Tensor) -> torch.Tensor:
                ids = torch.cat((text, batch(image_tokens)), dim=1)  # [M, P+L+2]
                allow = omni_attention_allow(ids, vocab)
                rows = slice(p + 1, p + 1 + big_l)
                return mix(self.transformer(ids, allow, rows=rows, columns=columns))

            return full

        prefix = _TextPrefix(self.transformer, text, vocab, self.share_prefix_graph)
        key_allow = image_rows_allow(text, big_l + 2, vocab.pad_id)  # [M, 1, 1, P+L+2]

        def reuse(image_tokens: torch.Tensor) -> torch.Tensor:
            logits = self.transformer.image_logits(
                batch(image_tokens), prefix.rows(), key_allow, rows=image_rows, columns=columns
            )
            return mix(logits)

        return reuse

    @torch.no_grad()
    def decode_images(self, image_tokens: torch.Tensor) -> torch.Tensor:
        """Codebook tokens ``long [N, L]`` -> ``uint8 [N, H, W, 3]`` (ids clamped as Show-o does)."""
        ids = image_tokens.clamp(0, self.codebook_size - 1).to(
            self.vq.decoder.conv_in.weight.device
        )
        chunks = [
            pixels_to_uint8(self.vq.decode_code(part, self.image_grid))
            for part in ids.split(self.decode_batch_size)
        ]
        return torch.cat(chunks).cpu()

    def folder_config(self) -> ShowoFolderConfig:
        v = self.vocab
        return ShowoFolderConfig(
            phi=self.transformer.config,
            llm_vocab_size=v.llm_vocab_size,
            codebook_size=v.codebook_size,
            num_vq_tokens=self.num_image_tokens,
            num_new_special_tokens=v.num_new_special_tokens,
            llm_model_path=self.llm_model_path,
            bos_id=v.bos_id,
            eos_id=v.eos_id,
        )

    def save_pretrained(self, folder: str | Path) -> Path:
        """Export the transformer as a Show-o folder (config.json + pytorch_model.safetensors).

        The tokenizer and MAGVIT-v2 are not trained and not written: keep pointing at theirs.
        """
        return save_showo_folder(folder, self.transformer.state_dict(), self.folder_config())


def random_init_(module: ModuleT, seed: int, spread: float = 0.2) -> ModuleT:
    """Overwrite every parameter (sorted by name) like the fixtures: embeddings ``N(0, 1)``,
    norm weights ``1 + spread N``, biases ``spread N``, weights ``N / sqrt(fan_in)``.

    Non-trivial logits, unlike the usual std-0.02 init, which makes them nearly uniform.
    """
    gen = torch.Generator().manual_seed(seed)
    owners = {
        f"{m}.{p}" if m else p: mod
        for m, mod in module.named_modules()
        for p, _ in mod.named_parameters(recurse=False)
    }
    with torch.no_grad():
        for name, param in sorted(module.named_parameters()):
            noise = torch.randn(param.shape, generator=gen)
            owner = owners[name]
            if isinstance(owner, nn.Embedding):
                value = noise
            elif name.endswith("bias"):
                value = spread * noise
            elif isinstance(owner, (nn.LayerNorm, nn.GroupNorm)):
                value = 1.0 + spread * noise
            else:
                value = noise / math.sqrt(param[0].numel())
            param.copy_(value)
    return module


def build_tiny_random_policy(
    seed: int = 0,
    *,
    num_image_tokens: int = 16,
    codebook_size: int = 64,
    llm_vocab_size: int = 100,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    max_text_len: int = 16,
    magvit_levels: int = 3,
    reuse_text_prefix: bool = True,
) -> ShowoPolicy:
    """A tiny random Show-o (real architecture, random weights, CPU) for end-to-end runs.

    Prompts go through :class:`HashingWordTokenizer`; BOS = EOS = ``llm_vocab_size - 10``.
    MAGVIT: 32 channels, ``magvit_levels`` levels, so images are ``sqrt(L) * 2^(levels-1)`` px
    square (16 px by default). The same ``seed`` gives the same weights in every process.
    """
    if codebook_size & (codebook_size - 1):
        raise ValueError(f"codebook_size {codebook_size} must be a power of two (LFQ)")
    vocab = ShowoVocab(
        llm_vocab_size=llm_vocab_size,
        codebook_size=codebook_size,
        bos_id=llm_vocab_size - 10,
        eos_id=llm_vocab_size - 10,
    )
    phi = PhiConfig(
        vocab_size=vocab.vocab_size,
        hidden_size=hidden_size,
        intermediate_size=4 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
    )
    side = math.isqrt(num_image_tokens)
    coder = CoderConfig(
        ch=32,
        ch_mult=(1,) * magvit_levels,
        num_res_blocks=(1,) * magvit_levels,
        resolution=side * 2 ** (magvit_levels - 1),
        z_channels=codebook_size.bit_length() - 1,
    )
    vq_cfg = MagvitConfig(encoder=coder, decoder=coder, codebook_dim=coder.z_channels)
    transformer = random_init_(ShowoTransformer(phi), seed)
    vq = random_init_(MAGVITv2(vq_cfg, with_encoder=False), seed + 1, spread=0.1)
    return ShowoPolicy(
        transformer,
        vq,
        HashingWordTokenizer(vocab),
        vocab,
        num_image_tokens=num_image_tokens,
        max_text_len=max_text_len,
        reuse_text_prefix=reuse_text_prefix,
    )


def load_showo_policy(
    showo_path: str | Path,
    magvit_path: str | Path,
    tokenizer_path: str | Path | None = None,
    *,
    dtype: torch.dtype = torch.bfloat16,
    vq_dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    num_image_tokens: int | None = None,
    max_text_len: int = 128,
    cache_dir: str | Path | None = None,
    reuse_text_prefix: bool = True,
    share_prefix_graph: bool = False,
) -> ShowoPolicy:
    """Load Show-o + MAGVIT-v2 + the phi-1_5 tokenizer from folders or the HF cache.

    ``tokenizer_path`` None uses the Show-o config's ``llm_model_path`` (``microsoft/phi-1_5``,
    looked up in the cache); ``"builtin:hashing"`` / ``"builtin:integer-ids"`` select the
    stand-in tokenizers (tiny test models only). ``num_image_tokens`` defaults to the config's
    ``num_vq_tokens`` (256 for show-o, 1024 for show-o-512x512).
    """
    transformer, cfg = load_showo_transformer(
        showo_path, dtype=dtype, device=device, cache_dir=cache_dir
    )
    vq = load_magvit(magvit_path, dtype=vq_dtype, device=device, cache_dir=cache_dir)
    spec = str(tokenizer_path) if tokenizer_path is not None else cfg.llm_model_path
    tokenizer: TextTokenizer
    if spec in BUILTIN_TOKENIZERS:
        vocab = cfg.vocab()
        tokenizer = (
            HashingWordTokenizer(vocab)
            if spec == "builtin:hashing"
            else IntegerIdTokenizer(vocab.llm_vocab_size)
        )
    else:
        folder = resolve_pretrained_folder(spec, cache_dir=cache_dir)
        tokenizer, llm_vocab_size, bos, eos = load_phi_tokenizer(folder)
        if llm_vocab_size != cfg.llm_vocab_size:
            raise ValueError(
                f"tokenizer {folder} has {llm_vocab_size} text ids, the model expects "
                f"llm_vocab_size {cfg.llm_vocab_size}: wrong tokenizer folder?"
            )
        vocab = cfg.vocab(bos, eos)
    if num_image_tokens and num_image_tokens != cfg.num_vq_tokens:
        log.warning(
            "%s was trained with %d image tokens; running it with %d",
            showo_path,
            cfg.num_vq_tokens,
            num_image_tokens,
        )
    return ShowoPolicy(
        transformer,
        vq,
        tokenizer,
        vocab,
        num_image_tokens=num_image_tokens or cfg.num_vq_tokens,
        max_text_len=max_text_len,
        reuse_text_prefix=reuse_text_prefix,
        share_prefix_graph=share_prefix_graph,
        llm_model_path=cfg.llm_model_path,
    )


class ShowoSettings(Protocol):
    """The fields of the ``model.showo`` config section that :func:`policy_from_config` reads."""

    @property
    def showo_path(self) -> str | None: ...
    @property
    def magvit_path(self) -> str | None: ...
    @property
    def tokenizer_path(self) -> str | None: ...
    @property
    def tiny_random(self) -> bool: ...
    @property
    def resolution_px(self) -> int: ...
    @property
    def max_text_tokens(self) -> int: ...
    @property
    def dtype(self) -> str: ...


def policy_from_config(
    settings: ShowoSettings, device: torch.device | str | None = None
) -> ShowoPolicy:
    """The Show-o policy a ``model.showo`` config section describes.

    ``tiny_random`` builds :func:`build_tiny_random_policy` (seed 0 in every process; the paths
    and ``resolution_px`` are ignored). Otherwise :func:`load_showo_policy` with
    ``L = (resolution_px / 16)^2`` image tokens; ``magvit_path`` defaults to
    ``showlab/magvitv2`` and ``tokenizer_path`` to the checkpoint's ``llm_model_path`` (both
    looked up in the HF cache when not local folders).
    """
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[settings.dtype]
    device = torch.device(device or "cpu")
    if settings.tiny_random:
        policy = build_tiny_random_policy(seed=0, max_text_len=settings.max_text_tokens)
        return policy.to(device=device, dtype=dtype)
    if not settings.showo_path:
        raise ValueError("model.showo.showo_path is required unless model.showo.tiny_random")
    side = settings.resolution_px // MAGVIT_DOWNSAMPLE
    policy = load_showo_policy(
        settings.showo_path,
        settings.magvit_path or DEFAULT_MAGVIT,
        settings.tokenizer_path,
        dtype=dtype,
        device=device,
        num_image_tokens=side * side,
        max_text_len=settings.max_text_tokens,
    )
    return policy


def _build(model: ModelConfig, device: torch.device) -> ShowoPolicy:
    return policy_from_config(model.showo, device=device)


def _check(cfg: Config) -> None:
    s = cfg.model.showo
    if not (s.tiny_random or s.showo_path):
        raise ValueError(
            "model.kind='showo' needs model.showo.showo_path (a local folder or HF cache id) "
            "or model.showo.tiny_random=true"
        )


register_model(
    "showo",
    ModelEntry(
        _build, ShowoModelConfig, _check, check_files=check_model_files, hub_fields=HUB_FIELDS
    ),
)
