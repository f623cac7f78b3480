"""Import ImageReward 1.5's model classes under transformers 5.x, without its training extras.

The ``image-reward`` package (2023) is installed ``--no-deps`` (its pins clash with ours, see
``docs/dependencies.md``). Importing it as is fails on today's stack, so this module:

1. imports only the modules the reward model needs (``ImageReward.ImageReward`` and
   ``ImageReward.models.BLIP``), registering bare parents for ``ImageReward`` and
   ``ImageReward.models``: their ``__init__`` files import ReFL (diffusers, accelerate, datasets)
   and CLIP/Aesthetic scorers (the ``clip`` package, hence ``pkg_resources`` and setuptools<81),
   none of which the reward needs;
2. gives ``transformers.modeling_utils`` the three helpers BLIP's ``med.py`` imports from it
   (transformers 5 moved two to ``pytorch_utils`` and removed ``find_pruneable_heads_and_indices``);
3. gives BLIP's ``BertPreTrainedModel`` what transformers 5 dropped from ``PreTrainedModel``:
   ``invert_attention_mask``, ``get_head_mask``, and an ``init_weights`` that runs ``post_init``
   (which now records ``all_tied_weights_keys`` before weights can be initialised).

Each patch is applied only where the name is missing, and logged as a warning. Importing BLIP also
silences transformers' logging and all Python warnings process-wide; both are restored.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import logging
import os
import sys
import types
import warnings
from typing import Any

import torch

from maskgrpo_ray.extras import NODEPS_INSTALL

logger = logging.getLogger(__name__)

_INSTALL_HINT = (
    f"ImageReward is not installed: {NODEPS_INSTALL} (--no-deps: image-reward's old pins clash "
    "with open_clip's, and what it needs is installed already; docs/rewards.md)"
)


def _find_pruneable_heads_and_indices(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError("head pruning is not supported for ImageReward's BLIP here")


def _invert_attention_mask(self: Any, mask: torch.Tensor) -> torch.Tensor:
    """transformers 4.x ``ModuleUtilsMixin.invert_attention_mask``: 1 keep / 0 drop -> additive."""
    extended = mask[:, None, :, :] if mask.dim() == 3 else mask[:, None, None, :]
    extended = extended.to(dtype=self.dtype)
    return (1.0 - extended) * torch.finfo(self.dtype).min


def _get_head_mask(
    self: Any, head_mask: Any, num_hidden_layers: int, is_attention_chunked: bool = False
) -> list[None]:
    """transformers 4.x ``get_head_mask`` for the only case ImageReward uses: no head mask."""
    if head_mask is not None:
        raise NotImplementedError("head masks are not supported for ImageReward's BLIP here")
    return [None] * num_hidden_layers


def _patch_transformers_helpers() -> list[str]:
    import transformers.modeling_utils as modeling_utils
    import transformers.pytorch_utils as pytorch_utils

    patched = []
    wanted = {
        "apply_chunking_to_forward": getattr(pytorch_utils, "apply_chunking_to_forward", None),
        "prune_linear_layer": getattr(pytorch_utils, "prune_linear_layer", None),
        "find_pruneable_heads_and_indices": _find_pruneable_heads_and_indices,
    }
    for name, value in wanted.items():
        if not hasattr(modeling_utils, name) and value is not None:
            setattr(modeling_utils, name, value)
            patched.append(f"transformers.modeling_utils.{name}")
    return patched


def _patch_bert(med: types.ModuleType) -> list[str]:
    from transformers.modeling_utils import PreTrainedModel

    cls = med.BertPreTrainedModel
    patched = []
    for name, fn in (
        ("invert_attention_mask", _invert_attention_mask),
        ("get_head_mask", _get_head_mask),
    ):
        if not hasattr(cls, name):
            setattr(cls, name, fn)
            patched.append(f"BertPreTrainedModel.{name}")
    if hasattr(PreTrainedModel, "get_expanded_tied_weights_keys"):  # transformers >= 5

        def init_weights(self: Any) -> None:
            if "all_tied_weights_keys" not in self.__dict__:
                self.post_init()  # records the tied keys, then calls init_weights again
            else:
                PreTrainedModel.init_weights(self)

        cls.init_weights = init_weights
        patched.append("BertPreTrainedModel.init_weights (runs post_init)")
    return patched


def _bare_package(name: str, path: str) -> None:
    spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
    spec.submodule_search_locations = [path]
    sys.modules[name] = importlib.util.module_from_spec(spec)


_MODULES: types.SimpleNamespace | None = None


def installed_spec() -> Any:
    """The installed ``ImageReward`` package's import spec; ImportError with the install
    command when it is not there (nothing is imported)."""
    spec = importlib.util.find_spec("ImageReward")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(_INSTALL_HINT)
    if importlib.util.find_spec("fairscale") is None:  # BLIP's vit.py imports it
        raise ImportError(f"ImageReward is installed but fairscale is not: {_INSTALL_HINT}")
    return spec


def import_imagereward() -> types.SimpleNamespace:
    """The ImageReward modules the reward uses, patched to run on transformers 5.x.

    Returns:
        namespace with ``ImageReward`` (the model class), ``blip_pretrain``, ``med`` and ``vit``.

    Raises:
        ImportError: with the install command, when the package is missing.
    """
    global _MODULES
    if _MODULES is not None:
        return _MODULES
    spec = installed_spec()
    patched = _patch_transformers_helpers()
    if "ImageReward" not in sys.modules:
        root = list(spec.submodule_search_locations)[0]
        _bare_package("ImageReward", root)
        _bare_package("ImageReward.models", os.path.join(root, "models"))
        patched.append("ImageReward package __init__ skipped (ReFL, CLIP/Aesthetic scorers)")
    import transformers

    verbosity = transformers.logging.get_verbosity()
    with warnings.catch_warnings():  # blip.py calls warnings.filterwarnings("ignore")
        model_module = importlib.import_module("ImageReward.ImageReward")
        blip_pretrain = importlib.import_module("ImageReward.models.BLIP.blip_pretrain")
        med = importlib.import_module("ImageReward.models.BLIP.med")
        vit = importlib.import_module("ImageReward.models.BLIP.vit")
    transformers.logging.set_verbosity(verbosity)  # blip_pretrain sets it to ERROR
    patched += _patch_bert(med)
    if patched:
        logger.warning("ImageReward compatibility shim patched: %s", "; ".join(patched))
    _MODULES = types.SimpleNamespace(
        ImageReward=model_module.ImageReward, blip_pretrain=blip_pretrain, med=med, vit=vit
    )
    return _MODULES
