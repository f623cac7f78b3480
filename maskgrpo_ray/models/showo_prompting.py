"""Show-o's universal prompting for text-to-image: vocabulary, text prefix, omni-attention mask.

After showlab/Show-o's ``training/prompting_utils.py`` (``UniversalPrompting``,
``create_attention_mask_predict_next``). The t2i sequence is

    [PAD]*k  <|t2i|>  BOS  text  EOS  |  <|soi|>  L image tokens  <|eoi|>
    `------------ P = max_text_len + 1 -----------'   `--------- L + 2 ---------'

with left padding to ``P`` (129 for Show-o) and truncation to ``P - 1`` tokens plus EOS. The
unconditional prompt for guidance is the same builder on ``''``: ``[PAD]*(P-3) <|t2i|> BOS EOS``.

Omni-attention (``allow[q, k]``, True = may attend): text rows are causal and, after the last pad,
blind to pads; pad rows are causal over the pads; the image segment (soi .. eoi) sees every
non-pad position. Text rows never see image rows, which is what makes the text prefix reusable.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

SPECIAL_TOKENS = (
    "<|soi|>",
    "<|eoi|>",
    "<|sov|>",
    "<|eov|>",
    "<|t2i|>",
    "<|mmu|>",
    "<|t2v|>",
    "<|v2v|>",
    "<|lvg|>",
)
PAD_TOKEN = "[PAD]"


@dataclass(frozen=True)
class ShowoVocab:
    """Id layout: text ``0 .. llm-1``, ``[PAD]`` = llm, the 9 special tokens, codebook, mask.

    Show-o: ``llm_vocab_size`` 50295, BOS = EOS = 50256 (phi-1_5 ``<|endoftext|>``), codebook
    8192, giving pad 50295, soi 50296, eoi 50297, t2i 50300, image offset 50305, mask 58497,
    vocabulary 58498.
    """

    llm_vocab_size: int = 50295
    codebook_size: int = 8192
    bos_id: int = 50256
    eos_id: int = 50256
    num_new_special_tokens: int = 10

    def __post_init__(self) -> None:
        if self.num_new_special_tokens != 1 + len(SPECIAL_TOKENS):
            raise ValueError(
                f"num_new_special_tokens={self.num_new_special_tokens}, but Show-o adds [PAD] and "
                f"{len(SPECIAL_TOKENS)} special tokens ({1 + len(SPECIAL_TOKENS)})"
            )
        for name in ("bos_id", "eos_id"):
            if not 0 <= getattr(self, name) < self.llm_vocab_size:
                raise ValueError(f"{name} must be a text id below llm_vocab_size")

    def special(self, token: str) -> int:
        """Id of ``[PAD]`` or one of the 9 special tokens (added in this order after the text)."""
        if token in (PAD_TOKEN, "<|pad|>"):
            return self.llm_vocab_size
        return self.llm_vocab_size + 1 + SPECIAL_TOKENS.index(token)

    @property
    def pad_id(self) -> int:
        return self.special(PAD_TOKEN)

    @property
    def soi_id(self) -> int:
        return self.special("<|soi|>")

    @property
    def eoi_id(self) -> int:
        return self.special("<|eoi|>")

    @property
    def t2i_id(self) -> int:
        return self.special("<|t2i|>")

    @property
    def image_offset(self) -> int:
        return self.llm_vocab_size + self.num_new_special_tokens

    @property
    def mask_id(self) -> int:
        return self.image_offset + self.codebook_size

    @property
    def vocab_size(self) -> int:
        return self.mask_id + 1

    @property
    def codebook_columns(self) -> slice:
        """Logit columns of the codebook entries (the mask id excluded)."""
        return slice(self.image_offset, self.image_offset + self.codebook_size)


class TextTokenizer(Protocol):
    """What the prompt builder needs: text -> text ids (no BOS/EOS added)."""

    def encode(self, text: str) -> list[int]: ...


class IntegerIdTokenizer:
    """Prompts written as space-separated integer ids (``"17 4 61"``), as the fixtures were made."""

    def __init__(self, llm_vocab_size: int):
        self.llm_vocab_size = llm_vocab_size

    def encode(self, text: str) -> list[int]:
        ids = [int(t) for t in text.split()]
        if any(not 0 <= i < self.llm_vocab_size for i in ids):
            raise ValueError(f"text ids must lie in [0, {self.llm_vocab_size}): {text!r}")
        return ids


class HashingWordTokenizer:
    """Stand-in for tiny random models: lower-cased words hashed (CRC32) onto text ids.

    Deterministic across processes (no Python ``hash``); ids ``0 .. num_ids - 1`` with
    ``num_ids = min(bos_id, eos_id)`` so BOS/EOS are never produced. Not a language tokenizer:
    different words may share an id.
    """

    def __init__(self, vocab: ShowoVocab):
        self.num_ids = min(vocab.bos_id, vocab.eos_id)

    def encode(self, text: str) -> list[int]:
        words = re.findall(r"[a-z0-9]+", text.lower())
        return [zlib.crc32(w.encode()) % self.num_ids for w in words]


class PhiTokenizer:
    """The phi-1_5 BPE tokenizer (transformers) with Show-o's ``[PAD]`` and 9 special tokens."""

    def __init__(self, hf_tokenizer: Any):
        self.hf = hf_tokenizer

    def encode(self, text: str) -> list[int]:
        return list(self.hf(text)["input_ids"])


def load_phi_tokenizer(folder: str | Path) -> tuple[PhiTokenizer, int, int, int]:
    """Load a local phi-1_5 tokenizer folder and add Show-o's tokens in the reference order.

    Returns ``(tokenizer, llm_vocab_size, bos_id, eos_id)``; ``llm_vocab_size`` is the length
    before the additions (50295 for phi-1_5). Raises if the added ids are not consecutive after
    it (e.g. the folder already carried some of the tokens), since the model's ids depend on it.
    """
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder), padding_side="left")
    llm_vocab_size = len(tok)
    tok.add_special_tokens({"pad_token": PAD_TOKEN})
    tok.add_tokens(list(SPECIAL_TOKENS))
    got = [tok.convert_tokens_to_ids(t) for t in (PAD_TOKEN, *SPECIAL_TOKENS)]
    want = list(range(llm_vocab_size, llm_vocab_size + 1 + len(SPECIAL_TOKENS)))
    if got != want:
        raise ValueError(
            f"tokenizer in {folder}: [PAD] and the special tokens got ids {got}, expected {want}. "
            "Use the plain phi-1_5 tokenizer folder (without Show-o's tokens already added)."
        )
    bos, eos = tok.bos_token_id, tok.eos_token_id
    if bos is None or eos is None:
        raise ValueError(f"tokenizer in {folder} has no BOS/EOS token (phi-1_5: <|endoftext|>)")
    return PhiTokenizer(tok), llm_vocab_size, int(bos), int(eos)


def t2i_text_prefix(text_ids: list[int], vocab: ShowoVocab, max_text_len: int) -> list[int]:
    """``[PAD]*k <|t2i|> BOS text EOS`` of length ``max_text_len + 1`` (reference truncation)."""
    ids = list(text_ids)
    if not ids or ids[0] != vocab.bos_id:
        ids = [vocab.bos_id, *ids]
    seq = [vocab.t2i_id, *ids, vocab.eos_id]
    width = max_text_len + 1
    if len(seq) <= width:
        return [vocab.pad_id] * (width - len(seq)) + seq
    return seq[: width - 1] + [vocab.eos_id]


def t2i_text_prefixes(
    prompts: Sequence[str], tokenizer: TextTokenizer, vocab: ShowoVocab, max_text_len: int
) -> torch.Tensor:
    """Prompts -> text prefixes ``long [B, max_text_len + 1]``."""
    rows = [t2i_text_prefix(tokenizer.encode(p), vocab, max_text_len) for p in prompts]
    return torch.tensor(rows, dtype=torch.long).reshape(len(rows), max_text_len + 1)


def image_segment(image_tokens: torch.Tensor, vocab: ShowoVocab) -> torch.Tensor:
    """Codebook-space tokens ``[N, L]`` (masked = V) -> ``<|soi|> ids <|eoi|>`` ``[N, L + 2]``."""
    v = vocab.codebook_size
    ids = torch.where(image_tokens >= v, vocab.mask_id, image_tokens + vocab.image_offset)
    n = image_tokens.shape[0]
    soi = torch.full((n, 1), vocab.soi_id, dtype=torch.long, device=image_tokens.device)
    eoi = torch.full((n, 1), vocab.eoi_id, dtype=torch.long, device=image_tokens.device)
    return torch.cat((soi, ids.long(), eoi), dim=1)


def omni_attention_allow(input_ids: torch.Tensor, vocab: ShowoVocab) -> torch.Tensor:
    """Show-o's t2i omni-attention mask ``bool [N, 1, S, S]`` (True = may attend).

    The reference's ``create_attention_mask_predict_next(..., rm_pad_in_image=True)``, as a
    boolean: causal everywhere; rows of the image segment (soi through eoi) see all columns; rows
    after the last pad see no column up to it; image rows see no pad column.
    """
    n, s = input_ids.shape
    dev = input_ids.device
    is_soi, is_eoi = input_ids == vocab.soi_id, input_ids == vocab.eoi_id
    in_image = (is_soi.cumsum(1) > is_eoi.cumsum(1)) | is_soi | is_eoi  # [N, S]
    causal = torch.ones(s, s, dtype=torch.bool, device=dev).tril()
    allow = causal[None] | in_image[:, :, None]  # [N, S, S]
    is_pad = input_ids == vocab.pad_id
    idx = torch.arange(s, device=dev)
    last_pad = torch.where(is_pad, idx, -1).amax(1)  # [N], -1 without pads
    after_pads = idx[None, :, None] > last_pad[:, None, None]  # rows  [N, S, 1]
    upto_pads = idx[None, None, :] <= last_pad[:, None, None]  # cols  [N, 1, S]
    allow = allow & ~(after_pads & upto_pads) & ~(in_image[:, :, None] & is_pad[:, None, :])
    return allow[:, None]


def additive_mask(allow: torch.Tensor) -> torch.Tensor:
    """The reference's float32 form: 0 where allowed, ``float(iinfo(int64).min)`` where blocked."""
    blocked = float(torch.iinfo(torch.int64).min)
    return torch.zeros(allow.shape, dtype=torch.float32, device=allow.device).masked_fill(
        ~allow, blocked
    )


def image_rows_allow(text_ids: torch.Tensor, num_image_positions: int, pad_id: int) -> torch.Tensor:
    """Key mask of the image rows ``bool [N, 1, 1, P + S_img]``: every non-pad column."""
    n = text_ids.shape[0]
    image_cols = torch.ones(n, num_image_positions, dtype=torch.bool, device=text_ids.device)
    return torch.cat((text_ids != pad_id, image_cols), dim=1)[:, None, None, :]
