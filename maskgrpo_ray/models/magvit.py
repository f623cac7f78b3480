"""MAGVIT-v2 image tokenizer (Show-o's ``showlab/magvitv2``): LFQ codes <-> pixels.

A clean-room implementation of showlab/Show-o's ``models/modeling_magvitv2.py`` and
``models/common_modules.py``. The module names
match the reference state dict (``encoder.down.1.block.0.nin_shortcut.weight``,
``decoder.up.3.block.0.conv1.weight``, ``quantize.embedding``, ...), so a checkpoint loads with
``strict=True``.

* Lookup-free quantisation (LFQ): a latent of ``D`` channels is quantised per channel to
  ``sign(z)`` (``z > 0 -> +1``, else ``-1``); the code index is ``sum_c 2^(D-1-c) [z_c > 0]``,
  channel 0 the most significant bit. ``D = 13`` gives the ``V = 8192`` codes.
* The decoder maps a ``[N, D, h, w]`` grid of +-1 vectors to pixels in ``[-1, 1]``; Show-o turns
  them into bytes with ``clamp((x + 1) / 2, 0, 1) * 255`` and a truncating cast.
* The encoder (optional: not needed for text-to-image) maps pixels in ``[-1, 1]`` to latents.

GroupNorm is 32 groups with eps 1e-6 everywhere, so channel counts are multiples of 32.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class CoderConfig:
    """Constructor arguments of one side (encoder or decoder), as in the reference."""

    ch: int = 128
    ch_mult: tuple[int, ...] = (1, 2, 2, 4, 4)
    num_res_blocks: tuple[int, ...] = (4, 3, 4, 3, 4)
    attn_resolutions: tuple[int, ...] = (5,)
    resolution: int = 256
    z_channels: int = 13
    in_ch: int = 3
    out_ch: int = 3

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CoderConfig:
        mult = tuple(int(m) for m in d["ch_mult"])
        blocks = d["num_res_blocks"]
        blocks = (int(blocks),) * len(mult) if isinstance(blocks, int) else tuple(blocks)
        if d.get("double_z", False):
            raise ValueError("double_z=True is a VAE layout; MAGVIT-v2 (LFQ) uses double_z=False")
        return cls(
            ch=int(d["ch"]),
            ch_mult=mult,
            num_res_blocks=tuple(int(b) for b in blocks),
            attn_resolutions=tuple(int(r) for r in d.get("attn_resolutions", ())),
            resolution=int(d["resolution"]),
            z_channels=int(d["z_channels"]),
            in_ch=int(d.get("in_ch", 3)),
            out_ch=int(d.get("out_ch", 3)),
        )


@dataclass(frozen=True)
class MagvitConfig:
    """Whole tokenizer. The defaults are the full-size ``showlab/magvitv2`` (16x downsampling)."""

    encoder: CoderConfig = field(default_factory=CoderConfig)
    decoder: CoderConfig = field(
        default_factory=lambda: CoderConfig(ch_mult=(1, 1, 2, 2, 4), num_res_blocks=(4, 4, 3, 4, 3))
    )
    codebook_dim: int = 13  # D; codebook size V = 2^D
    num_groups: int = 32
    eps: float = 1e-6

    @property
    def codebook_size(self) -> int:
        return 2**self.codebook_dim

    @property
    def downsample_factor(self) -> int:
        return 2 ** (len(self.decoder.ch_mult) - 1)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MagvitConfig:
        """Reads ``{"encoder": {...}, "decoder": {...}, "quantizer": {"codebook_dim": D}}``.

        A config without these sections (the official ``config.json`` holds only class metadata)
        gives the full-size defaults.
        """
        default = cls()
        gn = d.get("groupnorm", {})
        return cls(
            encoder=CoderConfig.from_dict(d["encoder"]) if "encoder" in d else default.encoder,
            decoder=CoderConfig.from_dict(d["decoder"]) if "decoder" in d else default.decoder,
            codebook_dim=int(d.get("quantizer", {}).get("codebook_dim", default.codebook_dim)),
            num_groups=int(gn.get("num_groups", default.num_groups)),
            eps=float(gn.get("eps", default.eps)),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "_class_name": "MAGVITv2",
            "encoder": {**asdict(self.encoder), "double_z": False, "dropout": 0.0},
            "decoder": {**asdict(self.decoder), "double_z": False, "dropout": 0.0},
            "quantizer": {"codebook_dim": self.codebook_dim, "codebook_size": self.codebook_size},
            "groupnorm": {"num_groups": self.num_groups, "eps": self.eps},
        }


def _norm(channels: int, cfg: MagvitConfig) -> nn.GroupNorm:
    return nn.GroupNorm(cfg.num_groups, channels, eps=cfg.eps, affine=True)


class ResnetBlock(nn.Module):
    """norm -> swish -> conv3x3, twice, plus a skip (1x1 ``nin_shortcut`` when widths differ)."""

    def __init__(self, c_in: int, c_out: int, cfg: MagvitConfig):
        super().__init__()
        self.norm1 = _norm(c_in, cfg)
        self.conv1 = nn.Conv2d(c_in, c_out, 3, padding=1)
        self.norm2 = _norm(c_out, cfg)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1)
        self.nin_shortcut = nn.Conv2d(c_in, c_out, 1) if c_in != c_out else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        skip = x if self.nin_shortcut is None else self.nin_shortcut(x)
        return skip + h


class AttnBlock(nn.Module):
    """Single-head self-attention over the ``h*w`` positions, ``softmax(q^T k / sqrt(c)) v``."""

    def __init__(self, c: int, cfg: MagvitConfig):
        super().__init__()
        self.norm = _norm(c, cfg)
        self.q = nn.Conv2d(c, c, 1)
        self.k = nn.Conv2d(c, c, 1)
        self.v = nn.Conv2d(c, c, 1)
        self.proj_out = nn.Conv2d(c, c, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, c, h, w = x.shape
        y = self.norm(x)

        def seq(t: torch.Tensor) -> torch.Tensor:  # [n, c, h, w] -> [n, 1, h*w, c]
            return t.reshape(n, c, h * w).transpose(1, 2).unsqueeze(1)

        out = F.scaled_dot_product_attention(seq(self.q(y)), seq(self.k(y)), seq(self.v(y)))
        out = out.squeeze(1).transpose(1, 2).reshape(n, c, h, w)
        return x + self.proj_out(out)


class Downsample(nn.Module):
    """Zero-pad right and bottom by one, then a stride-2 3x3 conv without padding."""

    def __init__(self, c: int):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, stride=2, padding=0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.pad(x, (0, 1, 0, 1)))


class Upsample(nn.Module):
    """Nearest-neighbour x2, then a 3x3 conv."""

    def __init__(self, c: int):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


class _Level(nn.Module):
    """One resolution level: ``block`` (ResnetBlocks), ``attn`` and an optional resampler."""

    downsample: nn.Module | None
    upsample: nn.Module | None

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.ModuleList()
        self.attn = nn.ModuleList()
        self.downsample = None  # becomes a submodule when assigned one
        self.upsample = None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.block):
            h = block(h)
            if len(self.attn) > 0:
                h = self.attn[i](h)
        if self.downsample is not None:
            h = self.downsample(h)
        if self.upsample is not None:
            h = self.upsample(h)
        return h


class _Mid(nn.Module):
    def __init__(self, c: int, cfg: MagvitConfig):
        super().__init__()
        self.block_1 = ResnetBlock(c, c, cfg)
        self.attn_1 = AttnBlock(c, cfg)
        self.block_2 = ResnetBlock(c, c, cfg)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.block_2(self.attn_1(self.block_1(h)))


class Encoder(nn.Module):
    """Pixels ``[N, 3, H, W]`` in [-1, 1] -> latents ``[N, D, H/f, W/f]`` (after ``quant_conv``)."""

    def __init__(self, cfg: MagvitConfig):
        super().__init__()
        c = cfg.encoder
        self.conv_in = nn.Conv2d(c.in_ch, c.ch, 3, padding=1)
        in_mult = (1, *c.ch_mult)
        res = c.resolution
        self.down = nn.ModuleList()
        block_in = c.ch
        for i, mult in enumerate(c.ch_mult):
            level = _Level()
            block_in, block_out = c.ch * in_mult[i], c.ch * mult
            for _ in range(c.num_res_blocks[i]):
                level.block.append(ResnetBlock(block_in, block_out, cfg))
                block_in = block_out
                if res in c.attn_resolutions:
                    level.attn.append(AttnBlock(block_in, cfg))
            if i != len(c.ch_mult) - 1:
                level.downsample = Downsample(block_in)
                res //= 2
            self.down.append(level)
        self.mid = _Mid(block_in, cfg)
        self.norm_out = _norm(block_in, cfg)
        self.conv_out = nn.Conv2d(block_in, c.z_channels, 3, padding=1)
        self.quant_conv = nn.Conv2d(c.z_channels, c.z_channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv_in(x)
        for level in self.down:
            h = level(h)
        h = self.mid(h)
        h = self.conv_out(F.silu(self.norm_out(h)))
        return self.quant_conv(h)


class Decoder(nn.Module):
    """Latents ``[N, D, h, w]`` -> pixels ``[N, 3, h*f, w*f]`` (unclamped, nominally [-1, 1])."""

    def __init__(self, cfg: MagvitConfig):
        super().__init__()
        c = cfg.decoder
        block_in = c.ch * c.ch_mult[-1]
        res = c.resolution // 2 ** (len(c.ch_mult) - 1)
        self.post_quant_conv = nn.Conv2d(c.z_channels, c.z_channels, 1)
        self.conv_in = nn.Conv2d(c.z_channels, block_in, 3, padding=1)
        self.mid = _Mid(block_in, cfg)
        levels: list[_Level] = []
        for i in reversed(range(len(c.ch_mult))):  # stored as up.{i}, run from the highest i
            level = _Level()
            block_out = c.ch * c.ch_mult[i]
            for _ in range(c.num_res_blocks[i]):
                level.block.append(ResnetBlock(block_in, block_out, cfg))
                block_in = block_out
                if res in c.attn_resolutions:
                    level.attn.append(AttnBlock(block_in, cfg))
            if i != 0:
                level.upsample = Upsample(block_in)
                res *= 2
            levels.insert(0, level)
        self.up = nn.ModuleList(levels)
        self.norm_out = _norm(block_in, cfg)
        self.conv_out = nn.Conv2d(block_in, c.out_ch, 3, padding=1)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        h = self.mid(self.conv_in(self.post_quant_conv(z)))
        for level in reversed(self.up):
            h = level(h)
        return self.conv_out(F.silu(self.norm_out(h)))


def lfq_codebook(codebook_dim: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The LFQ code vectors ``[2^D, D]``: entry ``[i, c] = 2 * bit_(D-1-c)(i) - 1`` (channel 0 = MSB)."""
    idx = torch.arange(2**codebook_dim, device=device)
    shifts = torch.arange(codebook_dim - 1, -1, -1, device=device)
    bits = (idx[:, None] >> shifts[None, :]) & 1
    return (2 * bits - 1).float()


class LFQuantizer(nn.Module):
    """Lookup-free quantiser. Its two buffers are persistent, as in the reference checkpoint."""

    embedding: torch.Tensor
    power_vals: torch.Tensor

    def __init__(self, codebook_dim: int):
        super().__init__()
        self.codebook_dim = codebook_dim
        self.register_buffer("embedding", lfq_codebook(codebook_dim))  # [V, D] float32
        powers = 2 ** torch.arange(codebook_dim - 1, -1, -1)
        self.register_buffer("power_vals", powers)  # [D] int64: 2^(D-1) .. 1

    def codes_to_latent(self, ids: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        """Code indices ``long [N, h*w]`` (row-major) -> +-1 latents ``[N, D, h, w]``."""
        n = ids.shape[0]
        vectors = self.embedding[ids]  # [N, h*w, D]
        return vectors.reshape(n, grid[0], grid[1], self.codebook_dim).permute(0, 3, 1, 2)

    def quantize(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Latents ``[N, D, h, w]`` -> (+-1 latents ``[N, D, h, w]``, indices ``long [N, h*w]``)."""
        positive = z > 0
        z_q = torch.where(positive, 1.0, -1.0).to(z.dtype)
        ids = (positive.long() * self.power_vals[None, :, None, None]).sum(1)  # [N, h, w]
        return z_q, ids.flatten(1)


class MAGVITv2(nn.Module):
    """Encoder (optional), decoder and LFQ quantiser under the reference module names."""

    def __init__(self, cfg: MagvitConfig | None = None, *, with_encoder: bool = True):
        super().__init__()
        self.config = cfg or MagvitConfig()
        if with_encoder:
            self.encoder = Encoder(self.config)
        self.decoder = Decoder(self.config)
        self.quantize = LFQuantizer(self.config.codebook_dim)

    @property
    def has_encoder(self) -> bool:
        return hasattr(self, "encoder")

    def decode_code(self, ids: torch.Tensor, grid: tuple[int, int] | None = None) -> torch.Tensor:
        """Codes ``long [N, L]`` -> decoded pixels ``float [N, 3, H, W]`` (before clamping).

        ``grid`` defaults to a square ``sqrt(L) x sqrt(L)``.
        """
        if grid is None:
            side = int(round(ids.shape[1] ** 0.5))
            grid = (side, side)
        z = self.quantize.codes_to_latent(ids, grid).to(self.decoder.conv_in.weight.dtype)
        return self.decoder(z)

    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        """Pixels ``[N, 3, H, W]`` in [-1, 1] -> latents ``[N, D, H/f, W/f]`` before quantising."""
        if not self.has_encoder:
            raise RuntimeError("this MAGVITv2 was built without its encoder (with_encoder=False)")
        return self.encoder(pixels)

    def get_code(self, pixels: torch.Tensor) -> torch.Tensor:
        """Pixels ``[N, 3, H, W]`` in [-1, 1] -> code indices ``long [N, L]`` (row-major)."""
        return self.quantize.quantize(self.encode(pixels))[1]


def pixels_to_uint8(x: torch.Tensor) -> torch.Tensor:
    """Decoded ``[N, 3, H, W]`` -> ``uint8 [N, H, W, 3]``: ``clamp((x+1)/2, 0, 1) * 255``, truncated."""
    scaled = ((x.float() + 1.0) / 2.0).clamp(0.0, 1.0) * 255.0
    return scaled.permute(0, 2, 3, 1).to(torch.uint8)
