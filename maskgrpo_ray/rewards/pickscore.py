"""PickScore (Kirstain et al. 2023) as a reward kind, and the one implementation of its score.

PickScore is a Hugging Face ``CLIPModel`` fine-tuned on human preferences
(``yuvalkirstain/PickScore_v1``); its model card scores an image against its prompt as
``exp(logit_scale) * cos(image, text)``, with the processor of
``laion/CLIP-ViT-H-14-laion2B-s32B-b79K`` (resize, centre crop, tokenizer). Flow-GRPO trains on
it as its human-preference reward. :class:`PickScoreModel` computes it (the evaluation metric
``pickscore``, :mod:`maskgrpo_ray.evaluation.metrics`, uses it too, in float32); the reward kind
``pickscore`` (:class:`PickScoreReward`) runs it in bf16 on CUDA, float32 on the CPU. Weights
load from safetensors only (``model.safetensors``), never a pickle.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from maskgrpo_ray.rewards.base import ModelReward, register_reward
from maskgrpo_ray.rewards.weights import missing
from maskgrpo_ray.weights.hub_field import SCHEME, HubField

DEFAULT_MODEL = "hf://yuvalkirstain/PickScore_v1"
DEFAULT_PROCESSOR = "hf://laion/CLIP-ViT-H-14-laion2B-s32B-b79K"
PROCESSOR_FILES = (
    ("preprocessor_config.json", "processor_config.json"),
    ("tokenizer.json", "vocab.json"),
)


def check_folders(model: str, processor: str | None = None) -> None:
    """PickScore's model folder (config.json, model.safetensors) and its processor folder
    (preprocessor and tokenizer files) are here; hub ids are the hub resolution's to check.

    Raises:
        RewardWeightsMissingError: naming the file, the folder and the fix.
    """
    how = (
        "  - Point `model` at a local copy of yuvalkirstain/PickScore_v1 (config.json, "
        "model.safetensors) and `processor` at one of laion/CLIP-ViT-H-14-laion2B-s32B-b79K "
        "(its preprocessor and tokenizer files), or use their hf:// ids."
    )
    if not str(model).startswith(SCHEME):
        folder = Path(model)
        for needed in ("config.json", "model.safetensors"):
            if not (folder / needed).is_file():
                raise missing("PickScore reward", needed, [str(folder)], how)
    proc = processor or model
    if not str(proc).startswith(SCHEME):
        for group in PROCESSOR_FILES:
            if not any((Path(proc) / f).is_file() for f in group):
                raise missing("PickScore processor", " or ".join(group), [str(proc)], how)


class PickScoreModel:
    """``exp(logit_scale) * cos(image, prompt)`` [N] of PickScore (its model card's score).

    Args:
        model: the PickScore_v1 folder; processor: the processor/tokenizer folder (default:
            ``model``); device, dtype: where and in what it runs; batch_size: images (and
            prompts) per forward pass.
    """

    def __init__(
        self,
        model: str,
        processor: str | None,
        device: torch.device,
        dtype: torch.dtype = torch.float32,
        batch_size: int = 32,
    ) -> None:
        from transformers import AutoProcessor, CLIPModel

        self.device, self.dtype, self.batch_size = device, dtype, batch_size
        self.processor = AutoProcessor.from_pretrained(processor or model, local_files_only=True)
        net = CLIPModel.from_pretrained(model, local_files_only=True, use_safetensors=True)
        self.model = net.eval().requires_grad_(False).to(device, dtype)

    def _unit(self, feats: Any) -> torch.Tensor:
        # transformers 5 returns an output object whose pooler_output is the projection
        x = feats if isinstance(feats, torch.Tensor) else feats.pooler_output
        return x.float() / x.float().norm(dim=-1, keepdim=True)

    @torch.inference_mode()
    def __call__(self, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        """uint8 ``[N, H, W, 3]`` (checked by the caller) and N prompts -> float32 ``[N]``."""
        from PIL import Image

        position = {p: i for i, p in enumerate(dict.fromkeys(prompts))}
        unique = list(position)
        index = torch.tensor([position[p] for p in prompts], dtype=torch.long)  # [N]
        text = []
        for s in range(0, len(unique), self.batch_size):
            tokens = self.processor(
                text=unique[s : s + self.batch_size],
                padding=True,
                truncation=True,
                max_length=77,
                return_tensors="pt",
            ).to(self.device)
            text.append(self._unit(self.model.get_text_features(**tokens)))  # [p, D]
        txt = torch.cat(text) if text else torch.zeros(0)  # [P, D]
        out = []
        for s in range(0, images.shape[0], self.batch_size):
            pil = [Image.fromarray(a) for a in images[s : s + self.batch_size].cpu().numpy()]
            px = self.processor(images=pil, return_tensors="pt")["pixel_values"]
            feats = self.model.get_image_features(pixel_values=px.to(self.device, self.dtype))
            img = self._unit(feats)
            out.append((img * txt[index[s : s + self.batch_size].to(self.device)]).sum(-1))
        scale = self.model.logit_scale.float().exp()
        return (scale * torch.cat(out)).cpu() if out else torch.zeros(0)  # [N]


def check_files(model: str = DEFAULT_MODEL, processor: str | None = DEFAULT_PROCESSOR, **_: Any):
    """The files a :class:`PickScoreReward` with these arguments reads are here."""
    check_folders(model, processor)


HUB_MODEL = HubField("model", ignore_patterns=("*.bin", "*.msgpack", "*.h5", "*.onnx*"))
HUB_PROCESSOR = HubField("processor", allow_patterns=("*.json", "*.txt"))


@register_reward(
    "pickscore", takes_device=True, check_files=check_files, hub_fields=(HUB_MODEL, HUB_PROCESSOR)
)
class PickScoreReward(ModelReward):
    """PickScore of each image with its prompt, as a training reward (about 20-23 for good
    matches; Mask-GRPO normalises per group, so only ranks within a group matter alone).

    Args:
        model: the PickScore_v1 folder (or ``hf://yuvalkirstain/PickScore_v1``).
        processor: the processor folder (or ``hf://laion/CLIP-ViT-H-14-laion2B-s32B-b79K``).
        device: where it runs; bf16 on CUDA, float32 on the CPU.
        batch_size: images per forward pass.
        name: key of this reward in the composite report.
    """

    def __init__(
        self,
        model: str = DEFAULT_MODEL,
        processor: str | None = DEFAULT_PROCESSOR,
        *,
        device: str | torch.device | None = None,
        batch_size: int = 32,
        name: str = "pickscore",
    ) -> None:
        self._setup(name, device, batch_size, "pil")
        check_folders(model, processor)
        self.scorer = PickScoreModel(model, processor, self.device, self.dtype, batch_size)
        self.model = self.scorer.model

    def _score(self, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        self._scored += len(prompts)
        return self.scorer(images, prompts)
