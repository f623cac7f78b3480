"""Show-o's transformer: Phi-1.5 with per-head q/k LayerNorm, built at its final vocabulary size.

A clean-room implementation of showlab/Show-o's ``models/phi.py`` and ``models/modeling_showo.py``
(``Showo``); module names
follow the reference state dict (``showo.model.layers.{i}.self_attn.q_layernorm.weight``, ...),
so a Show-o checkpoint loads with ``strict=True``. What differs from stock Phi-1.5:

* ``q_layernorm`` / ``k_layernorm`` (LayerNorm over ``head_dim``) act per head on q and k after the
  projections and *before* the partial rotary embedding;
* the vocabulary is built at ``vocab_size`` directly (58498 for Show-o), never resized;
* attention takes Show-o's omni-attention mask as a boolean ``allow`` tensor (True = may attend),
  through SDPA, and no row may be fully blocked;
* logits come back in float32.

A layer is the parallel residual ``x + dense(attn(h)) + fc2(gelu_new(fc1(h)))`` with
``h = input_layernorm(x)``. RoPE is rotate-half style on the first ``rotary_dim`` dims of each
head, position ids ``0 .. S-1`` in every row (left padding needs no adjustment: pads are masked
and RoPE is relative).

Text-prefix reuse: text rows never attend to image rows, so :meth:`ShowoTransformer.text_kv`
runs the text part once and returns every layer's keys and values; :meth:`image_logits` then runs
only the image rows against ``cat(text K/V, image K/V)``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

# per layer (keys, values), each [N, H, P, D]
LayerKV = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class PhiConfig:
    """Transformer dimensions. Defaults: Phi-1.5 at Show-o's vocabulary (58498)."""

    vocab_size: int = 58498
    hidden_size: int = 2048
    intermediate_size: int = 8192
    num_hidden_layers: int = 24
    num_attention_heads: int = 32
    partial_rotary_factor: float = 0.5
    rope_theta: float = 10000.0
    layer_norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} must be divisible by num_attention_heads "
                f"{self.num_attention_heads} (head_dim = hidden_size / heads)"
            )
        if self.rotary_dim % 2:
            raise ValueError(f"rotary_dim {self.rotary_dim} must be even (rotate-half RoPE)")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def rotary_dim(self) -> int:
        return int(self.partial_rotary_factor * self.head_dim)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PhiConfig:
        """From a transformers ``PhiConfig``-style dict; unknown keys are ignored.

        Rejects the settings this module does not implement (GQA, other activations, RoPE
        scaling) instead of silently computing something else.
        """
        kv_heads = d.get("num_key_value_heads")
        if kv_heads not in (None, d.get("num_attention_heads")):
            raise ValueError(
                f"num_key_value_heads={kv_heads}: grouped-query attention is not Phi-1.5"
            )
        if d.get("hidden_act", "gelu_new") != "gelu_new":
            raise ValueError(f"hidden_act={d['hidden_act']!r}: Phi-1.5 uses gelu_new")
        if d.get("rope_scaling"):
            raise ValueError("rope_scaling is not supported (Phi-1.5 has none)")
        names = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in d.items() if k in names and v is not None})

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "hidden_act": "gelu_new", "qk_layernorm": True}


def rope_cos_sin(
    positions: torch.Tensor, cfg: PhiConfig, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin ``[S, rotary_dim]`` of ``cat(freqs, freqs)`` with ``freqs = pos * theta^(-j/rot)``."""
    rot = cfg.rotary_dim
    exponents = torch.arange(0, rot, 2, dtype=torch.int64, device=positions.device).float() / rot
    inv_freq = 1.0 / (cfg.rope_theta**exponents)  # [rot/2]
    freqs = torch.outer(positions.float(), inv_freq)  # [S, rot/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [S, rot]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on the first ``rot`` dims of ``x [N, H, S, D]``; the rest pass through."""
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    x1, x2 = x_rot[..., : rot // 2], x_rot[..., rot // 2 :]
    rotated = torch.cat((-x2, x1), dim=-1)
    return torch.cat((x_rot * cos + rotated * sin, x_pass), dim=-1)


class PhiAttention(nn.Module):
    def __init__(self, cfg: PhiConfig):
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_attention_heads, cfg.head_dim
        hidden = cfg.hidden_size
        self.q_proj = nn.Linear(hidden, hidden)
        self.k_proj = nn.Linear(hidden, hidden)
        self.v_proj = nn.Linear(hidden, hidden)
        self.dense = nn.Linear(hidden, hidden)
        self.q_layernorm = nn.LayerNorm(cfg.head_dim, eps=cfg.layer_norm_eps)
        self.k_layernorm = nn.LayerNorm(cfg.head_dim, eps=cfg.layer_norm_eps)

    def forward(
        self,
        h: torch.Tensor,  # [N, S, hidden]
        cos: torch.Tensor,  # [S, rot]
        sin: torch.Tensor,
        allow: torch.Tensor,  # bool, broadcastable to [N, H, S, P + S]
        prefix: LayerKV | None = None,  # keys/values of earlier positions, [N, H, P, D]
    ) -> tuple[torch.Tensor, LayerKV]:
        n, s, _ = h.shape

        def heads(t: torch.Tensor) -> torch.Tensor:  # [N, S, hidden] -> [N, H, S, D]
            return t.view(n, s, self.num_heads, self.head_dim).transpose(1, 2)

        q = apply_partial_rope(self.q_layernorm(heads(self.q_proj(h))), cos, sin)
        k = apply_partial_rope(self.k_layernorm(heads(self.k_proj(h))), cos, sin)
        v = heads(self.v_proj(h))
        k_all, v_all = k, v
        if prefix is not None:
            k_all = torch.cat((prefix[0], k), dim=2)
            v_all = torch.cat((prefix[1], v), dim=2)
        out = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=allow)  # [N, H, S, D]
        out = out.transpose(1, 2).reshape(n, s, self.num_heads * self.head_dim)
        return self.dense(out), (k, v)


class PhiMLP(nn.Module):
    def __init__(self, cfg: PhiConfig):
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(h), approximate="tanh"))  # gelu_new == tanh GELU


class PhiDecoderLayer(nn.Module):
    def __init__(self, cfg: PhiConfig):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.self_attn = PhiAttention(cfg)
        self.mlp = PhiMLP(cfg)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        allow: torch.Tensor,
        prefix: LayerKV | None,
    ) -> tuple[torch.Tensor, LayerKV]:
        h = self.input_layernorm(x)
        attn, kv = self.self_attn(h, cos, sin, allow, prefix)
        return attn + self.mlp(h) + x, kv  # parallel residual


class PhiModel(nn.Module):
    def __init__(self, cfg: PhiConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(PhiDecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.final_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.gradient_checkpointing = False  # recompute each layer in backward (saves memory)

    def forward(
        self,
        input_ids: torch.Tensor,  # [N, S]
        allow: torch.Tensor,  # bool [N, 1, S, P + S]
        *,
        position_offset: int = 0,
        prefix: list[LayerKV] | None = None,
        final_norm: bool = True,
    ) -> tuple[torch.Tensor, list[LayerKV]]:
        """Hidden states ``[N, S, hidden]`` and each layer's own keys/values ``[N, H, S, D]``."""
        x = self.embed_tokens(input_ids)
        positions = torch.arange(
            position_offset, position_offset + input_ids.shape[1], device=input_ids.device
        )
        cos, sin = rope_cos_sin(positions, self.config, x.dtype)
        kvs: list[LayerKV] = []
        checkpointed = self.gradient_checkpointing and torch.is_grad_enabled()
        for i, layer in enumerate(self.layers):
            args = (x, cos, sin, allow, None if prefix is None else prefix[i])
            if checkpointed:
                x, kv = checkpoint(layer, *args, use_reentrant=False)
            else:
                x, kv = layer(*args)
            kvs.append(kv)
        return (self.final_layernorm(x) if final_norm else x), kvs


class LMHead(nn.Linear):
    """``lm_head`` (with bias) that can restrict itself to a range of vocabulary columns.

    The slice happens inside the module's own forward, so hooks that gather parameters around
    a module call (DeepSpeed ZeRO-3) see it.
    """

    def forward(self, hidden: torch.Tensor, columns: slice | None = None) -> torch.Tensor:
        if columns is None:
            return super().forward(hidden).float()
        return F.linear(hidden, self.weight[columns], self.bias[columns]).float()


class PhiForCausalLM(nn.Module):
    def __init__(self, cfg: PhiConfig):
        super().__init__()
        self.model = PhiModel(cfg)
        self.lm_head = LMHead(cfg.hidden_size, cfg.vocab_size, bias=True)


class ShowoTransformer(nn.Module):
    """The ``Showo`` module without the CLIP projector: state-dict keys ``showo.*``."""

    def __init__(self, cfg: PhiConfig):
        super().__init__()
        self.config = cfg
        self.showo = PhiForCausalLM(cfg)

    def head(self, hidden: torch.Tensor, columns: slice | None = None) -> torch.Tensor:
        """``lm_head`` over all ids, or only the vocabulary ``columns``; float32 ``[..., C]``."""
        return self.showo.lm_head(hidden, columns)

    def forward(
        self,
        input_ids: torch.Tensor,  # [N, S]
        allow: torch.Tensor,  # bool [N, 1, S, S], True = may attend
        *,
        rows: slice | None = None,
        columns: slice | None = None,
    ) -> torch.Tensor:
        """Full recomputation: logits float32 ``[N, S, vocab]`` (or the ``rows`` x ``columns`` cut)."""
        hidden, _ = self.showo.model(input_ids, allow)
        if rows is not None:
            hidden = hidden[:, rows]
        return self.head(hidden, columns)

    def text_kv(self, text_ids: torch.Tensor, allow: torch.Tensor) -> list[LayerKV]:
        """Every layer's keys/values ``[N, H, P, D]`` for the text prefix ``text_ids [N, P]``.

        Exact for the image rows that follow because text rows never attend to image rows.
        The last layer's hidden states are not needed, so the final norm is skipped.
        """
        _, kvs = self.showo.model(text_ids, allow, final_norm=False)
        return kvs

    def image_logits(
        self,
        image_ids: torch.Tensor,  # [N, S_img]: soi, image tokens, eoi
        prefix: list[LayerKV],  # text keys/values per layer, [N, H, P, D]
        allow: torch.Tensor,  # bool [N, 1, 1 or S_img, P + S_img]
        *,
        rows: slice | None = None,
        columns: slice | None = None,
    ) -> torch.Tensor:
        """Logits float32 for the image part, reusing the text prefix's keys and values."""
        p = prefix[0][0].shape[2]
        hidden, _ = self.showo.model(image_ids, allow, position_offset=p, prefix=prefix)
        if rows is not None:
            hidden = hidden[:, rows]
        return self.head(hidden, columns)
