"""CLIP reward through open_clip: ``r_i = exp(logit_scale) * cos(image_i, prompt_i)``.

This is what the official Mask-GRPO code scores with (HF ``CLIPModel`` of
``laion/CLIP-ViT-H-14-laion2B-s32B-b79K``, ``logits_per_image`` per image and its own prompt, about
100 x cosine); the same weights are open_clip's ``ViT-H-14`` / ``laion2b_s32b_b79k``, the default
here. Differences from the official code, all on purpose:

- prompts longer than the text tower's context (77 tokens) are truncated and counted in
  :meth:`ClipReward.stats` (the official processor does not truncate and would fail on them);
- images are preprocessed as one batch of tensors on the model's device
  (:mod:`maskgrpo_ray.rewards.preprocess`), equal to open_clip's PIL transform up to 1/255 at a few
  pixels; ``preprocess="pil"`` runs the model's own transform per image instead;
- each distinct prompt is encoded once per call (a group of G images shares one prompt).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

import torch

from maskgrpo_ray.rewards import weights
from maskgrpo_ray.rewards.base import ModelReward, register_reward
from maskgrpo_ray.rewards.preprocess import TENSOR_RESIZE_MODES, ImagePreprocess, pixels_from_uint8
from maskgrpo_ray.weights.hub_field import HubField

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "ViT-H-14"
DEFAULT_PRETRAINED = "laion2b_s32b_b79k"
SCORES = ("logits", "cosine")


def _hf_weight_candidates(hf_hub: str) -> tuple[str, list[str]]:
    """open_clip's ``hf_hub`` entry ``'org/repo/'`` or ``'org/repo/file'`` -> repo, files it tries."""
    from open_clip.pretrained import HF_SAFE_WEIGHTS_NAME, HF_WEIGHTS_NAME

    repo_id, filename = os.path.split(hf_hub)
    if not filename or filename == HF_WEIGHTS_NAME:
        return repo_id, [HF_SAFE_WEIGHTS_NAME, HF_WEIGHTS_NAME]
    if filename.endswith((".bin", ".pth")):
        return repo_id, [filename[:-4] + ".safetensors", filename]
    return repo_id, [filename]


def resolve_clip_weights(
    model_name: str, pretrained: str | None, cache_dir: str | None = None
) -> dict[str, Any]:
    """Check that the weights for ``create_model(model_name, pretrained)`` are here, before building.

    Returns:
        keyword arguments for ``open_clip.create_model``. A tag whose file is in the Hugging Face
        cache becomes that file's path plus the tag's preprocessing and QuickGELU setting, so that
        loading never touches the network.

    Raises:
        RewardWeightsMissingError: naming the missing file, where it was looked for and how to
            provide it.
    """
    import open_clip
    from open_clip.transform import PreprocessCfg

    if model_name.startswith(("local-dir:", "hf-hub:")):
        _check_model_folder(model_name, cache_dir)
        return {}
    if pretrained is None:
        return {"pretrained": None}
    tag_cfg = open_clip.get_pretrained_cfg(model_name, pretrained)
    if not tag_cfg:
        if os.path.isfile(pretrained):
            return {"pretrained": pretrained}
        tags = open_clip.list_pretrained_tags_by_model(model_name)
        raise weights.missing(
            f"CLIP reward {model_name}",
            pretrained,
            [os.path.abspath(pretrained), f"open_clip tags of {model_name}: {tags}"],
            _HOW_FILE + " Or use one of the tags listed.",
        )
    fields = set(PreprocessCfg.__dataclass_fields__)
    from_tag = {
        "force_preprocess_cfg": {k: v for k, v in tag_cfg.items() if k in fields},
        "force_quick_gelu": bool(tag_cfg.get("quick_gelu", False)),
    }
    found, candidates, looked, how = _locate_tag_weights(tag_cfg, cache_dir)
    if found is not None:
        return {"pretrained": found, **from_tag}
    if not weights.downloads_allowed():
        raise weights.missing(
            f"CLIP reward {model_name}/{pretrained}", " or ".join(candidates), looked, how
        )
    return {"pretrained": pretrained}  # not cached, download asked for: open_clip fetches it


_HOW_FILE = "  - Point `pretrained` at a local open_clip checkpoint (.bin/.pt/.safetensors)."


def _check_model_folder(model_name: str, cache_dir: str | None) -> None:
    """``local-dir:FOLDER`` / ``hf-hub:REPO`` models: their open_clip config must be here."""
    how_file = _HOW_FILE
    if model_name.startswith("local-dir:"):
        folder = model_name.split(":", 1)[1]
        config = os.path.join(folder, "open_clip_config.json")
        if not os.path.isfile(config):
            raise weights.missing("CLIP reward", "open_clip_config.json", [folder], how_file)
        return
    if model_name.startswith("hf-hub:"):
        repo_id = model_name.split(":", 1)[1]
        weights.hf_cached_file(
            "CLIP reward",
            repo_id,
            "open_clip_config.json",
            cache_dir,
            f"  - Fill the cache: `hf download {repo_id}` where there is internet, then "
            "copy the cache folder (HF_HOME / HF_HUB_CACHE) here.",
        )


def _locate_tag_weights(
    tag_cfg: dict[str, Any], cache_dir: str | None
) -> tuple[str | None, list[str], list[str], str]:
    """Where an open_clip tag's weights would be: (found path or None, candidates, places
    looked, how to provide them)."""
    how_file = _HOW_FILE
    if tag_cfg.get("file"):
        candidates = [tag_cfg["file"]]
        found = tag_cfg["file"] if os.path.isfile(tag_cfg["file"]) else None
        looked, how = candidates, how_file
    elif tag_cfg.get("hf_hub"):
        repo_id, files = _hf_weight_candidates(tag_cfg["hf_hub"])
        found = next(
            (p for f in files if (p := weights.find_in_hf_cache(repo_id, f, cache_dir))), None
        )
        candidates = [f"{repo_id}/{f}" for f in files]
        looked = [weights.hf_cache_place(cache_dir)]
        how = (
            f"  - Fill the cache: `hf download {repo_id} {files[-1]}` where there is internet, "
            "then copy the cache folder (HF_HOME / HF_HUB_CACHE) here.\n" + how_file
        )
    else:
        url = tag_cfg["url"]
        folder = cache_dir or os.path.expanduser("~/.cache/clip")
        path = os.path.join(folder, os.path.basename(url))
        found = path if os.path.isfile(path) else None
        candidates, looked = [path], [folder]
        how = f"  - Download {url} to {folder}.\n" + how_file
    return found, candidates, looked, how


def _token_count(tokenizer: Any, text: str) -> int:
    """Tokens of ``text`` including start and end tokens, before any truncation."""
    from open_clip.tokenizer import SimpleTokenizer

    if isinstance(tokenizer, SimpleTokenizer):
        return len(tokenizer.encode(text)) + 2
    inner = getattr(tokenizer, "tokenizer", None)  # open_clip's HF-backed tokenizers
    return len(inner(text)["input_ids"]) if callable(inner) else 0


def check_files(
    model_name: str = DEFAULT_MODEL,
    pretrained: str | None = DEFAULT_PRETRAINED,
    cache_dir: str | None = None,
    **_: Any,
) -> None:
    """The weights :class:`ClipReward` with these arguments would load are here (or a
    download was asked for); nothing is built."""
    resolve_clip_weights(model_name, pretrained, cache_dir)


HUB_MODEL = HubField(
    "model_name",
    local_prefix="local-dir:",
    allow_patterns=("open_clip_*", "*.json", "*.txt", "*.model"),  # not transformers' weights
)
"""``model_name: hf://org/name[@revision]`` (an open_clip repo) is fetched by the driver and
becomes ``local-dir:<snapshot>``; open_clip's ``hf-hub:org/name`` keeps its old meaning (the
HF cache, or a download when ``MASKGRPO_ALLOW_DOWNLOADS=1``)."""


@register_reward(
    "clip", takes_device=True, check_files=check_files, hub_fields=(HUB_MODEL,), embeds=True
)
class ClipReward(ModelReward):
    """CLIP score of each image with its prompt, from any open_clip model.

    Args:
        model_name: open_clip architecture (``"ViT-H-14"``), or ``"hf-hub:org/repo"``,
            ``"local-dir:/path"``.
        pretrained: open_clip tag (looked up in the Hugging Face cache), a local checkpoint file,
            or None for random weights.
        score: ``"logits"``: ``exp(logit_scale) * cos`` (+ ``logit_bias`` for SigLIP models), the
            official reward; ``"cosine"``: ``cos`` alone.
        device: where the model runs; None: CUDA if present, else CPU. bf16 on CUDA, fp32 on CPU.
        batch_size: images per forward pass.
        preprocess: ``"tensor"`` (batched, on ``device``) or ``"pil"`` (the model's own transform,
            one PIL image at a time).
        cache_dir: Hugging Face cache folder (default: the usual one, ``HF_HUB_CACHE``).
        name: key of this reward in the composite report.

    Raises:
        RewardWeightsMissingError: when the weights are not here (at construction).
    """

    def __init__(
        self,
        model_name: str = DEFAULT_MODEL,
        pretrained: str | None = DEFAULT_PRETRAINED,
        *,
        score: str = "logits",
        device: str | torch.device | None = None,
        batch_size: int = 32,
        preprocess: str = "tensor",
        cache_dir: str | None = None,
        name: str = "clip",
    ) -> None:
        import open_clip

        if score not in SCORES:
            raise ValueError(f"score must be one of {SCORES}, got {score!r}")
        self._setup(name, device, batch_size, preprocess)
        self.score_kind = score
        create_kwargs = resolve_clip_weights(model_name, pretrained, cache_dir)
        model = open_clip.create_model(model_name, cache_dir=cache_dir, **create_kwargs)
        self.model = model.eval().requires_grad_(False).to(self.device, self.dtype)
        self.tokenizer = open_clip.get_tokenizer(model_name, cache_dir=cache_dir)
        self.context_length = int(getattr(self.tokenizer, "context_length", 77))
        pcfg = open_clip.get_model_preprocess_cfg(model)
        size = pcfg.get("size", 224)
        self.pil_transform = open_clip.image_transform(
            size,
            is_train=False,
            mean=pcfg.get("mean"),
            std=pcfg.get("std"),
            resize_mode=pcfg.get("resize_mode"),
            interpolation=pcfg.get("interpolation"),
            fill_color=pcfg.get("fill_color", 0),
        )
        size = (size, size) if isinstance(size, int) else tuple(size)
        mode = pcfg.get("resize_mode", "shortest")
        tensor_ok = mode in TENSOR_RESIZE_MODES and (mode == "squash" or size[0] == size[1])
        if preprocess == "tensor" and not tensor_ok:
            logger.warning("CLIP resize_mode %r has no tensor path; using PIL per image", mode)
        self.preprocess = preprocess if tensor_ok else "pil"
        self.tensor_cfg = (
            ImagePreprocess(
                size=size,
                mean=tuple(pcfg.get("mean", ImagePreprocess.mean)),
                std=tuple(pcfg.get("std", ImagePreprocess.std)),
                interpolation=pcfg.get("interpolation", "bicubic"),
                resize_mode=mode,
            )
            if tensor_ok
            else None
        )

    def pixels(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 [N, H, W, 3] -> model input [N, 3, S, S] on the model's device and dtype."""
        if self.tensor_cfg is not None and self.preprocess == "tensor":
            return pixels_from_uint8(images, self.tensor_cfg, device=self.device, dtype=self.dtype)
        from PIL import Image

        arrays = images.cpu().numpy()
        batch = torch.stack([self.pil_transform(Image.fromarray(a)) for a in arrays])
        return batch.to(self.device, self.dtype)

    def count_truncated(self, prompts: Sequence[str]) -> int:
        """How many of ``prompts`` exceed the text context (and are cut by the tokenizer)."""
        too_long = {
            p for p in set(prompts) if _token_count(self.tokenizer, p) > self.context_length
        }
        return sum(p in too_long for p in prompts)

    def embed(self, images: torch.Tensor) -> torch.Tensor:
        """The normalised CLIP image features of ``images`` uint8 [N, H, W, 3]: float [N, D] on
        the CPU (the embedding ``maskgrpo_ray.algo.diversity`` measures distances in)."""
        feats = []
        with torch.no_grad():
            for start in range(0, images.shape[0], self.batch_size):
                chunk = images[start : start + self.batch_size]
                feats.append(self.model.encode_image(self.pixels(chunk), normalize=True).float())
        return torch.cat(feats).cpu()

    def _score(self, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        """``images`` uint8 [N, H, W, 3] (N > 0, checked) against ``prompts`` -> float32 [N]."""
        unique = list(dict.fromkeys(prompts))
        position = {p: i for i, p in enumerate(unique)}
        index = torch.tensor([position[p] for p in prompts], device=self.device)  # [N]
        truncated = self.count_truncated(prompts)
        if truncated and self._truncated == 0:
            logger.warning(
                "CLIP reward: prompts over %d tokens are truncated (counted in stats())",
                self.context_length,
            )
        self._truncated += truncated
        tokens = self.tokenizer(unique).to(self.device)  # [P, context]
        text = self.model.encode_text(tokens, normalize=True).float()  # [P, D]
        scores = []
        for start in range(0, images.shape[0], self.batch_size):
            chunk = images[start : start + self.batch_size]
            feats = self.model.encode_image(self.pixels(chunk), normalize=True).float()  # [n, D]
            scores.append((feats * text[index[start : start + self.batch_size]]).sum(-1))
        cosine = torch.cat(scores)  # [N]
        self._scored += len(prompts)
        if self.score_kind == "cosine":
            return cosine.cpu()
        logits = self.model.logit_scale.float().exp() * cosine
        bias = getattr(self.model, "logit_bias", None)
        if bias is not None:
            logits = logits + bias.float()
        return logits.reshape(-1).cpu()
