"""ImageReward (Xu et al., 2023) as a Mask-GRPO reward: the paper's ablation reward.

The model is the ``image-reward`` package's own ``ImageReward`` class (BLIP ViT-L/16 image tower,
BERT-base text encoder cross-attending to it, an MLP head), imported through
:mod:`maskgrpo_ray.rewards._imagereward_compat` so that it runs on transformers 5.x. Its score is the
package's ``score_gard`` run on a batch: ``r = (MLP(text_cls) - 0.16717) / 1.03334`` with the prompt
cut to 35 BERT tokens (the package's limit; cut prompts are counted in :meth:`stats`).

What is loaded from where (all checked when the reward is built):

- weights ``ImageReward.pt``: a path, or ``"ImageReward-v1.0"`` looked up in the package's own
  download folder (``~/.cache/ImageReward``) and the Hugging Face cache (``THUDM/ImageReward``);
- the BERT tokenizer the package fetches as ``bert-base-uncased``: a local folder with
  ``vocab.txt`` or a hub id found in the Hugging Face cache (the package would download it);
- the text encoder config: BLIP's ``med_config.json``, shipped here as :data:`MED_CONFIG`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from maskgrpo_ray.rewards import weights
from maskgrpo_ray.rewards._imagereward_compat import import_imagereward, installed_spec
from maskgrpo_ray.rewards.base import ModelReward, register_reward
from maskgrpo_ray.rewards.preprocess import ImagePreprocess, pixels_from_uint8
from maskgrpo_ray.weights.hub_field import HubField

logger = logging.getLogger(__name__)

RELEASED = "ImageReward-v1.0"
HF_REPO = "THUDM/ImageReward"
CHECKPOINT_FILE = "ImageReward.pt"
TOKENIZER = "bert-base-uncased"
MAX_PROMPT_TOKENS = 35  # ImageReward.score: truncation=True, max_length=35

# BLIP's configs/med_config.json, which THUDM/ImageReward ships as med_config.json: BERT-base with
# cross-attention; 30524 = bert-base-uncased's 30522 tokens + [DEC] + [ENC].
MED_CONFIG: dict[str, Any] = {
    "architectures": ["BertModel"],
    "attention_probs_dropout_prob": 0.1,
    "hidden_act": "gelu",
    "hidden_dropout_prob": 0.1,
    "hidden_size": 768,
    "initializer_range": 0.02,
    "intermediate_size": 3072,
    "layer_norm_eps": 1e-12,
    "max_position_embeddings": 512,
    "model_type": "bert",
    "num_attention_heads": 12,
    "num_hidden_layers": 12,
    "pad_token_id": 0,
    "type_vocab_size": 2,
    "vocab_size": 30524,
    "encoder_width": 768,
    "add_cross_attention": True,
}


@dataclass(frozen=True)
class BlipVisionSpec:
    """Size of BLIP's ViT image tower; the defaults are ImageReward's (``create_vit('large')``).

    A smaller one (tests) builds the same ``VisionTransformer`` class with fewer, narrower layers.
    """

    embed_dim: int = 1024
    depth: int = 24
    num_heads: int = 16
    patch_size: int = 16


def resolve_checkpoint(
    checkpoint: str, download_root: str | None = None, cache_dir: str | None = None
) -> str:
    """Local path of the ImageReward weights; downloads only when asked
    (``weights.downloads_allowed``).

    Raises:
        RewardWeightsMissingError: naming ``ImageReward.pt``, the places searched and the fixes.
    """
    if checkpoint != RELEASED:
        if os.path.isfile(checkpoint):
            return checkpoint
        looked = [os.path.abspath(checkpoint)]
    else:
        root = download_root or os.path.expanduser("~/.cache/ImageReward")
        local = os.path.join(root, CHECKPOINT_FILE)
        if os.path.isfile(local):
            return local
        cached = weights.find_in_hf_cache(HF_REPO, CHECKPOINT_FILE, cache_dir)
        if cached is not None:
            return cached
        if weights.downloads_allowed():
            from huggingface_hub import hf_hub_download

            try:
                return hf_hub_download(HF_REPO, CHECKPOINT_FILE, cache_dir=cache_dir)
            except Exception as err:  # no network, hub down: say what to do instead
                logger.warning("ImageReward download failed: %s", err)
        looked = [local, f"{weights.hf_cache_place(cache_dir)} ({HF_REPO})"]
    how = (
        f"  - Pass `checkpoint` = the path of {CHECKPOINT_FILE}, or\n"
        f"  - fill the cache: `hf download {HF_REPO} {CHECKPOINT_FILE}` where there is internet, "
        "then copy the cache folder (HF_HOME / HF_HUB_CACHE) here."
    )
    raise weights.missing("ImageReward reward", CHECKPOINT_FILE, looked, how)


def locate_tokenizer(tokenizer: str, cache_dir: str | None = None) -> str | None:
    """Where the tokenizer's ``vocab.txt`` is: the folder's, or the Hugging Face cache's (None:
    not cached, a download was asked for).

    Raises:
        RewardWeightsMissingError: naming ``vocab.txt`` when the tokenizer is not here.
    """
    if os.path.isdir(tokenizer):
        vocab = os.path.join(tokenizer, "vocab.txt")
        if not os.path.isfile(vocab):
            raise weights.missing(
                "ImageReward tokenizer",
                "vocab.txt",
                [tokenizer],
                "  - Point `tokenizer` at a folder with bert-base-uncased's vocab.txt.",
            )
        return vocab
    return weights.hf_cached_file(
        "ImageReward tokenizer",
        tokenizer,
        "vocab.txt",
        cache_dir,
        f"  - Point `tokenizer` at a folder holding {tokenizer}'s vocab.txt, or\n"
        f"  - fill the cache: `hf download {tokenizer} vocab.txt tokenizer_config.json`"
        " where there is internet, then copy the cache folder here.",
    )


def check_files(
    checkpoint: str | None = RELEASED,
    tokenizer: str = TOKENIZER,
    download_root: str | None = None,
    cache_dir: str | None = None,
    **_: Any,
) -> None:
    """The package is installed, and the checkpoint and tokenizer :class:`ImageRewardReward`
    with these arguments would load are here (or a download was asked for); nothing is built."""
    from maskgrpo_ray.rewards.base import RewardDependencyMissing

    try:
        installed_spec()
    except ImportError as err:
        raise RewardDependencyMissing(f"reward kind 'imagereward': {err}") from None
    if checkpoint is not None:
        resolve_checkpoint(checkpoint, download_root, cache_dir)
    locate_tokenizer(tokenizer, cache_dir)


def load_tokenizer(tokenizer: str, cache_dir: str | None = None) -> Any:
    """BLIP's BERT tokenizer (``init_tokenizer``) from a local folder or the Hugging Face cache.

    Adds ``[DEC]`` (as BOS) and ``[ENC]`` after the vocabulary, as BLIP does, so that ids match.

    Raises:
        RewardWeightsMissingError: naming ``vocab.txt`` when the tokenizer is not here.
    """
    from transformers import BertTokenizer

    if os.path.isdir(tokenizer):
        locate_tokenizer(tokenizer, cache_dir)
        tok = BertTokenizer.from_pretrained(tokenizer)
    else:
        cached = locate_tokenizer(tokenizer, cache_dir)
        tok = BertTokenizer.from_pretrained(
            tokenizer, cache_dir=cache_dir, local_files_only=cached is not None
        )
    tok.add_special_tokens({"bos_token": "[DEC]"})
    tok.add_tokens(["[ENC]"], special_tokens=True)
    return tok


@contextlib.contextmanager
def _blip_builders(
    blip_pretrain: Any, vit: Any, tokenizer: Any, vision: BlipVisionSpec | None
) -> Iterator[None]:
    """While ImageReward's constructor runs, hand BLIP our tokenizer (and a smaller ViT)."""
    saved = blip_pretrain.init_tokenizer, blip_pretrain.create_vit

    def create_vit(
        name: str, image_size: int, use_grad_checkpointing: bool = False, *args: Any
    ) -> tuple[Any, int]:
        assert vision is not None
        tower = vit.VisionTransformer(
            img_size=image_size,
            patch_size=vision.patch_size,
            embed_dim=vision.embed_dim,
            depth=vision.depth,
            num_heads=vision.num_heads,
        )
        return tower, vision.embed_dim

    blip_pretrain.init_tokenizer = lambda: tokenizer
    if vision is not None and vision != BlipVisionSpec():
        blip_pretrain.create_vit = create_vit
    try:
        yield
    finally:
        blip_pretrain.init_tokenizer, blip_pretrain.create_vit = saved


@register_reward(
    "imagereward",
    takes_device=True,
    check_files=check_files,
    hub_fields=(
        HubField(
            "checkpoint",
            allow_patterns=("ImageReward.pt", "med_config.json"),
            file="ImageReward.pt",
        ),
        HubField("tokenizer", allow_patterns=("*.json", "*.txt")),
    ),
)
class ImageRewardReward(ModelReward):
    """ImageReward score of each image with its prompt.

    Args:
        checkpoint: path of ``ImageReward.pt``, ``"ImageReward-v1.0"`` (found in the caches), or
            None for random weights (tests, benchmarks).
        tokenizer: folder with BERT's ``vocab.txt``, or a hub id found in the Hugging Face cache.
        med_config: text encoder config (path or dict); default :data:`MED_CONFIG`.
        vision: image tower size (a spec or its fields as a dict, from YAML); default
            ImageReward's ViT-L/16.
        device: where the model runs; None: CUDA if present, else CPU. bf16 on CUDA.
        batch_size: images per forward pass.
        preprocess: ``"tensor"`` (batched) or ``"pil"`` (the package's transform per image).
        download_root: the package's download folder (default ``~/.cache/ImageReward``).
        cache_dir: Hugging Face cache folder (default: the usual one).
        name: key of this reward in the composite report.

    Raises:
        RewardWeightsMissingError: weights or tokenizer not here (at construction).
    """

    def __init__(
        self,
        checkpoint: str | None = RELEASED,
        *,
        tokenizer: str = TOKENIZER,
        med_config: str | Mapping[str, Any] | None = None,
        vision: BlipVisionSpec | Mapping[str, int] | None = None,
        device: str | torch.device | None = None,
        batch_size: int = 16,
        preprocess: str = "tensor",
        download_root: str | None = None,
        cache_dir: str | None = None,
        name: str = "imagereward",
    ) -> None:
        self._setup(name, device, batch_size, preprocess)
        self.preprocess = preprocess
        path = (
            None if checkpoint is None else resolve_checkpoint(checkpoint, download_root, cache_dir)
        )
        self.tokenizer = load_tokenizer(tokenizer, cache_dir)
        if isinstance(vision, Mapping):
            vision = BlipVisionSpec(**vision)
        self.model = self._build(med_config, vision)
        if path is not None:
            self._load(path)
        self.model = self.model.eval().requires_grad_(False).to(self.device, self.dtype)
        self.model.device = self.device  # score_gard puts its image mask on model.device
        self.tensor_cfg = ImagePreprocess()  # = the package's _transform(224)

    def _build(self, med_config: str | Mapping[str, Any] | None, vision: BlipVisionSpec | None):
        ir = import_imagereward()
        config = dict(MED_CONFIG) if med_config is None else med_config
        with tempfile.TemporaryDirectory() as tmp:
            if not isinstance(config, str):
                config_path = os.path.join(tmp, "med_config.json")
                with open(config_path, "w") as f:
                    json.dump(dict(config), f)
            else:
                config_path = config
            with _blip_builders(ir.blip_pretrain, ir.vit, self.tokenizer, vision):
                return ir.ImageReward(med_config=config_path, device="cpu")

    def _load(self, path: str) -> None:
        from maskgrpo_ray.weights.safe_files import load_torch_file

        state = load_torch_file(path, "ImageReward weights")
        result = self.model.load_state_dict(state, strict=False)
        # what scoring uses must be there; the package itself loads with strict=False
        used = ("blip.visual_encoder.", "blip.text_encoder.", "mlp.")
        missing = [k for k in result.missing_keys if not k.endswith("position_ids")]
        if any(k.startswith(used) for k in missing):
            raise ValueError(f"{path} is not an ImageReward checkpoint: missing {missing[:5]} ...")
        if missing:
            logger.warning("ImageReward checkpoint lacks unused keys %s", missing[:5])
        if result.unexpected_keys:
            logger.warning("ImageReward checkpoint: unused keys %s", result.unexpected_keys[:5])

    def pixels(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 [N, H, W, 3] -> [N, 3, 224, 224] on the model's device and dtype."""
        if self.preprocess == "tensor":
            return pixels_from_uint8(images, self.tensor_cfg, device=self.device, dtype=self.dtype)
        from PIL import Image

        batch = torch.stack(
            [self.model.preprocess(Image.fromarray(a)) for a in images.cpu().numpy()]
        )
        return batch.to(self.device, self.dtype)

    def count_truncated(self, prompts: Sequence[str]) -> int:
        """How many of ``prompts`` exceed ImageReward's 35 tokens (and are cut)."""
        lengths = self.tokenizer(list(prompts), truncation=False)["input_ids"]
        return sum(len(ids) > MAX_PROMPT_TOKENS for ids in lengths)

    def _score(self, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        """``images`` uint8 [N, H, W, 3] (N > 0, checked) against ``prompts`` -> float32 [N]."""
        truncated = self.count_truncated(prompts)
        if truncated and self._truncated == 0:
            logger.warning("ImageReward: prompts over %d tokens are cut", MAX_PROMPT_TOKENS)
        self._truncated += truncated
        scores = []
        for start in range(0, images.shape[0], self.batch_size):
            chunk = list(prompts[start : start + self.batch_size])
            text = self.tokenizer(
                chunk,
                padding="max_length",
                truncation=True,
                max_length=MAX_PROMPT_TOKENS,
                return_tensors="pt",
            ).to(self.device)
            pixels = self.pixels(images[start : start + self.batch_size])  # [n, 3, 224, 224]
            rewards = self.model.score_gard(text.input_ids, text.attention_mask, pixels)  # [n, 1]
            scores.append(rewards.float().reshape(-1))
        self._scored += len(prompts)
        return torch.cat(scores).cpu()  # [N]
