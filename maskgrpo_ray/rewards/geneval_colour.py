"""GenEval's colour classifier in-process: open_clip zero-shot over the evaluator's ten colours.

As ``evaluation/evaluate_images.py`` of djghosh13/geneval does it:

- the classifier of a class (built once per class): for each colour ``c`` of :data:`COLORS`,
  the three :data:`TEMPLATES` filled with ``c`` and the class, encoded, each normalised, their
  mean normalised again (clip_benchmark's ``zero_shot_classifier``);
- an object's crop (``ImageCrops``): the image composited over a ``#999`` grey blank through
  the object's mask (``Image.composite``), cropped to its box (``Image.crop``, which rounds the
  box), then the model's own PIL transform (ViT-L-14/openai: resize the short side to 224
  bicubic, centre crop, normalise);
- its colour: the argmax of ``100 * normalise(encode_image(crop)) @ classifier``
  (``run_classification``; the scale does not change the argmax).

The crops are built with PIL exactly as the evaluator builds them; the encodings run batched on
the model's device. On CUDA everything clip_benchmark runs inside its float16 autocast (``amp``,
on by default in the versions whose ``run_classification`` returns ``(logits, target)``, the
evaluator's) runs inside ours too: the classifier's normalise, mean and renormalise, and the
image side's encode, normalise and ``100 * features @ classifier`` (so a near tie between two
colours is broken by the same float16 matmul). On the CPU clip_benchmark's
``torch.cuda.amp.autocast`` changes nothing, and neither do we: float32 throughout. The weights are open_clip's ``ViT-L-14`` / ``openai`` tag, looked up as the CLIP reward
looks its weights up (:func:`maskgrpo_ray.rewards.clip.resolve_clip_weights`: local files or the
Hugging Face cache, a download only with ``MASKGRPO_ALLOW_DOWNLOADS=1``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

COLORS = ("red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white")
TEMPLATES = ("a photo of a {c} {cls}", "a photo of a {c}-colored {cls}", "a photo of a {c} object")
BACKGROUND = "#999"  # the evaluator's default bgcolor


def colour_prompts(classname: str) -> list[list[str]]:
    """Per colour of :data:`COLORS`, the evaluator's three texts for ``classname``."""
    return [[t.format(c=c, cls=classname) for t in TEMPLATES] for c in COLORS]


def object_crop(image: Any, box: Sequence[float], mask: Any) -> Any:
    """The evaluator's crop of one object (``ImageCrops.__getitem__``): the RGB PIL ``image``
    through the bool ``mask`` ``[H, W]`` over a :data:`BACKGROUND` blank, cropped to ``box[:4]``
    (pixels). A None mask keeps the whole image."""
    import numpy as np
    from PIL import Image

    image = image.convert("RGB")
    if mask is not None:
        blank = Image.new("RGB", image.size, color=BACKGROUND)
        image = Image.composite(image, blank, Image.fromarray(np.asarray(mask, dtype=bool)))
    return image.crop(tuple(float(v) for v in box[:4]))


class ColourClassifier:
    """Zero-shot colour of detected objects (GenEval's ``color_classification``).

    Args:
        model_name: open_clip architecture (``ViT-L-14``, the evaluator's) or
            ``local-dir:FOLDER``.
        pretrained: open_clip tag (``openai``, the evaluator's), a local checkpoint, or None.
        device: where it runs.
        batch_size: crops per forward pass.
        cache_dir: Hugging Face cache folder (default: the usual one).
    """

    def __init__(
        self,
        model_name: str = "ViT-L-14",
        pretrained: str | None = "openai",
        device: torch.device | None = None,
        batch_size: int = 16,
        cache_dir: str | None = None,
    ) -> None:
        import open_clip

        from maskgrpo_ray.rewards.base import default_device
        from maskgrpo_ray.rewards.clip import resolve_clip_weights

        self.device = default_device(device)
        kwargs = resolve_clip_weights(model_name, pretrained, cache_dir)
        model = open_clip.create_model(model_name, cache_dir=cache_dir, **kwargs)
        self.model = model.eval().requires_grad_(False).to(self.device, torch.float32)
        self.tokenizer = open_clip.get_tokenizer(model_name, cache_dir=cache_dir)
        pcfg = open_clip.get_model_preprocess_cfg(model)
        self.transform = open_clip.image_transform(
            pcfg.get("size", 224),
            is_train=False,
            mean=pcfg.get("mean"),
            std=pcfg.get("std"),
            resize_mode=pcfg.get("resize_mode"),
            interpolation=pcfg.get("interpolation"),
            fill_color=pcfg.get("fill_color", 0),
        )
        self.batch_size = batch_size
        self._classifiers: dict[str, torch.Tensor] = {}

    def _amp(self) -> Any:
        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.float16)
        return nullcontext()

    @torch.inference_mode()
    def classifier(self, classname: str) -> torch.Tensor:
        """float ``[D, 10]``: the zero-shot weights of ``classname``'s colours (cached)."""
        if classname not in self._classifiers:
            texts = colour_prompts(classname)  # [10][3]
            flat = [t for per_colour in texts for t in per_colour]
            with self._amp():  # clip_benchmark's zero_shot_classifier, all inside its autocast
                emb = self.model.encode_text(self.tokenizer(flat).to(self.device))
                emb = F.normalize(emb, dim=-1).view(len(COLORS), len(TEMPLATES), -1)
                mean = emb.mean(dim=1)  # [10, D]
                self._classifiers[classname] = (mean / mean.norm(dim=-1, keepdim=True)).T
        return self._classifiers[classname]

    @torch.inference_mode()
    def logits(self, crops: Sequence[Any], classname: str) -> torch.Tensor:
        """float ``[n, 10]``: ``100 * cos(crop, colour)`` of each PIL crop (:func:`object_crop`)
        of a ``classname`` object, over :data:`COLORS`."""
        clf = self.classifier(classname)
        out = [torch.zeros(0, len(COLORS))]
        for s in range(0, len(crops), self.batch_size):
            pixels = torch.stack([self.transform(c) for c in crops[s : s + self.batch_size]])
            with self._amp():  # clip_benchmark's run_classification: similarity inside too
                feats = F.normalize(self.model.encode_image(pixels.to(self.device)), dim=-1)
                logits = 100.0 * feats @ clf
            out.append(logits.float().cpu())
        return torch.cat(out)

    def classify(self, crops: Sequence[Any], classname: str) -> list[str]:
        """The colour name of each PIL crop of a ``classname`` object (the argmax of
        :meth:`logits`)."""
        if not crops:
            return []
        return [COLORS[int(i)] for i in self.logits(crops, classname).argmax(dim=1)]


def save_tiny_clip_folder(folder: str | Path, seed: int = 0) -> str:
    """A tiny random open_clip model as an open_clip folder (``open_clip_config.json`` and
    ``open_clip_model.safetensors``): ``local-dir:<folder>`` loads it in any process (a Ray
    actor too), no registration needed. Returns the ``local-dir:`` model name."""
    import open_clip
    from safetensors.torch import save_file

    from maskgrpo_ray.rewards.tiny import _TINY_CLIP_CONFIG

    out = Path(str(folder))
    out.mkdir(parents=True, exist_ok=True)
    cfg = {"model_cfg": _TINY_CLIP_CONFIG, "preprocess_cfg": {}}
    (out / "open_clip_config.json").write_text(json.dumps(cfg))
    torch.manual_seed(seed)
    model = open_clip.CLIP(**_TINY_CLIP_CONFIG)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(out / "open_clip_model.safetensors"))
    return f"local-dir:{out}"
