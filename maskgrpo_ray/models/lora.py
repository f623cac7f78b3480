"""LoRA adapters (peft) on any masked image policy: ``model.lora``.

:func:`apply_lora` injects peft's LoRA layers into the policy in place (the policy keeps its
class and methods, so nothing else in the system knows whether it trains an adapter): the base
weights are frozen, ``B`` starts at zero (the adapted policy equals the base at the start) and
``A`` is drawn from ``model.lora.init_seed`` so that every process (the learner ranks, each
rollout actor) builds the same adapter. What trains is then exactly the adapter's tensors
(``requires_grad``), which is what the optimizer holds, what the weight sync moves and what
``final_policy.safetensors`` keeps.

Formats: our tensors are named as the policy's ``named_parameters`` (``...qkv.lora_A.default
.weight``); peft's saved adapters drop the adapter name and prefix ``base_model.model.``
(:func:`to_peft_names` / :func:`from_peft_names`). :func:`save_adapter` writes a folder that
``peft.PeftModel.from_pretrained(base_policy, folder)`` loads.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from maskgrpo_ray.errors import UserError

if TYPE_CHECKING:
    from maskgrpo_ray.config import LoraConfig
    from maskgrpo_ray.models.base import MaskedImagePolicy

log = logging.getLogger(__name__)

ADAPTER = "default"  # peft's adapter name
PEFT_PREFIX = "base_model.model."
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_OURS = re.compile(r"\.(lora_[A-Za-z_]+)\." + ADAPTER + r"(\.|$)")
_PEFT = re.compile(r"\.(lora_A|lora_B|lora_embedding_A|lora_embedding_B|lora_magnitude_vector)\.")


def peft_config(lora: LoraConfig, exclude: list[str] | None = None) -> Any:
    """peft's ``LoraConfig`` for ours; ``exclude``: module names that get no adapter."""
    from peft import LoraConfig as PeftLoraConfig

    targets = lora.target_modules
    return PeftLoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,  # type: ignore[arg-type]  # peft takes a float too
        target_modules=targets if isinstance(targets, str) else list(targets),
        exclude_modules=exclude or None,
        lora_dropout=lora.dropout,
        bias="none",
    )


def no_adapter_layers(policy: torch.nn.Module) -> list[str]:
    """Linear layers that get no adapter whatever ``target_modules`` says:

    * those whose weights the model itself keeps frozen (e.g. aMUSEd's text encoder and VQ
      model): an adapter there would never get a gradient;
    * subclasses of ``nn.Linear`` with a forward of their own (e.g. Show-o's ``lm_head``, which
      computes only some vocabulary columns): peft's adapter adds ``x A^T B^T`` to the layer's
      output and assumes the plain ``x W^T + b`` shape.
    """
    return [
        n
        for n, m in policy.named_modules()
        if n
        and _is_linear(m)
        and (not m.weight.requires_grad or type(m).forward is not torch.nn.Linear.forward)
    ]


def apply_lora(policy: MaskedImagePolicy, lora: LoraConfig, kind: str) -> MaskedImagePolicy:
    """Inject the adapter into ``policy`` (in place; returned for chaining). Raises a
    :class:`UserError` naming ``model.lora.target_modules`` when no layer matches."""
    from peft import inject_adapter_in_model

    try:
        with torch.random.fork_rng(devices=[]):  # A's init: the same in every process
            torch.manual_seed(lora.init_seed)
            config = peft_config(lora, no_adapter_layers(policy))
            inject_adapter_in_model(config, policy, adapter_name=ADAPTER)
    except ValueError as err:
        linear = sorted(
            {n.rsplit(".", 1)[-1] for n, m in policy.named_modules() if _is_linear(m) and n}
        )
        raise UserError(
            f"model.lora.target_modules={lora.target_modules!r}: {err} (model kind {kind!r} "
            f"has the linear layers {linear[:12]}); name some of them, or use 'all-linear'"
        ) from None
    trained = [p for p in policy.parameters() if p.requires_grad]
    frozen = sum(p.numel() for p in policy.parameters() if not p.requires_grad)
    log.info(
        "LoRA (rank %d, alpha %g) on %s: %d adapter tensors, %d trained parameters; %d frozen",
        lora.rank,
        lora.alpha,
        lora.target_modules,
        len(trained),
        sum(p.numel() for p in trained),
        frozen,
    )
    return policy


def _is_linear(module: torch.nn.Module) -> bool:
    return isinstance(module, torch.nn.Linear)


def has_adapter(policy: torch.nn.Module) -> bool:
    """Whether peft's layers were injected into ``policy``."""
    return bool(getattr(policy, "peft_config", None))


@contextlib.contextmanager
def adapter_disabled(policy: torch.nn.Module) -> Iterator[None]:
    """The base model: every LoRA layer of ``policy`` off inside the block (restored after)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in policy.modules() if isinstance(m, BaseTunerLayer)]
    for m in layers:
        m.enable_adapters(False)
    try:
        yield
    finally:
        for m in layers:
            m.enable_adapters(True)


class AdapterDisabled:
    """The KL reference of a LoRA policy: the same module with the adapter disabled (no second
    copy of the weights). It offers what the loss reads of a reference: ``conditioned``,
    ``codebook_size``, ``parameters``; the returned logits function disables the adapter while
    it runs too (a model may bind work in ``conditioned`` and use it later)."""

    def __init__(self, policy: MaskedImagePolicy) -> None:
        self.policy = policy

    def conditioned(self, cond_ids: torch.Tensor, guidance_scale: float = 0.0) -> Any:
        with adapter_disabled(self.policy):
            fn = self.policy.conditioned(cond_ids, guidance_scale)

        def logits(tokens: torch.Tensor) -> torch.Tensor:
            with adapter_disabled(self.policy):
                return fn(tokens)

        return logits

    def __getattr__(self, name: str) -> Any:
        return getattr(self.policy, name)


# ----------------------------------------------------------------------------- formats


def to_peft_names(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our adapter tensors (``named_parameters`` names) -> peft's saved names."""
    out = {}
    for k, v in state.items():
        if not _OURS.search(k):
            raise ValueError(f"{k!r} is not a LoRA adapter tensor of adapter {ADAPTER!r}")
        out[PEFT_PREFIX + _OURS.sub(r".\1\2", k)] = v
    return out


def from_peft_names(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """peft's saved adapter names -> ours (the inverse of :func:`to_peft_names`)."""
    out = {}
    for k, v in state.items():
        name = k[len(PEFT_PREFIX) :] if k.startswith(PEFT_PREFIX) else k
        if name.endswith(".weight") and _PEFT.search(name):
            name = _PEFT.sub(lambda m: f".{m.group(1)}.{ADAPTER}.", name)
        out[name] = v
    return out


def save_adapter(
    folder: Path, state: Mapping[str, torch.Tensor], lora: LoraConfig, base: str = ""
) -> Path:
    """``folder/adapter_config.json`` + ``adapter_model.safetensors`` in peft's format, from
    our adapter tensors ``state``; ``base`` names the base model (``base_model_name_or_path``)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    cfg = peft_config(lora)
    # the layers that have an adapter, by full name: exact for any model (the config's names
    # and 'all-linear' were resolved against the model, frozen layers left out)
    cfg.target_modules = sorted({k.split(".lora_", 1)[0] for k in state})
    cfg.base_model_name_or_path = base or None
    cfg.save_pretrained(str(folder))
    tensors = {k: v.detach().cpu().contiguous() for k, v in to_peft_names(state).items()}
    save_file(tensors, str(folder / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    return folder


def is_adapter_folder(path: Path) -> bool:
    return path.is_dir() and (path / ADAPTER_CONFIG).is_file()


def load_adapter(folder: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``(our adapter tensors, the lora settings)`` from a peft adapter folder (ours or any
    peft-saved one for the same model)."""
    from safetensors.torch import load_file

    raw = json.loads((folder / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    weights = folder / ADAPTER_WEIGHTS
    if not weights.is_file():
        raise UserError(
            f"{folder}: an adapter folder without {ADAPTER_WEIGHTS} (only safetensors adapters "
            "are read: no pickle); save the adapter with safe_serialization=True"
        )
    targets = raw.get("target_modules")
    settings = {
        "rank": int(raw.get("r", 8)),
        "alpha": float(raw.get("lora_alpha", 8)),
        "target_modules": targets if isinstance(targets, str) else sorted(targets or []),
        "dropout": float(raw.get("lora_dropout", 0.0)),
    }
    return from_peft_names(load_file(str(weights))), settings


def merged_state(policy: MaskedImagePolicy) -> dict[str, torch.Tensor]:
    """The base weights with the adapter merged in (``W + scale * B A``, peft's
    ``get_delta_weight``), under the base model's own names (what a policy built without
    ``model.lora`` loads). ``policy`` is not changed (an in-place merge and unmerge would not
    give its weights back bit for bit)."""
    from peft.tuners.lora import LoraLayer

    with torch.no_grad():
        state = {
            k.replace(".base_layer.", "."): v.detach().cpu().clone()
            for k, v in policy.state_dict().items()
            if ".lora_" not in k
        }
        for name, m in policy.named_modules():
            if isinstance(m, LoraLayer) and ADAPTER in m.lora_A:
                key = f"{name}.weight"
                delta = m.get_delta_weight(ADAPTER).detach().cpu()  # type: ignore[attr-defined]
                state[key] = (state[key] + delta).to(state[key].dtype)
    return state
