"""Which weights an evaluation runs: the base model, a run's final policy, a checkpoint, a file.

A finished run writes ``RUN_DIR/final_policy.safetensors`` (the learner's trained tensors,
:func:`save_final_policy`). A run stopped before its end has checkpoints instead: the newest
valid one is read (``policy.pt`` of the single-process backend, or the DeepSpeed model states
of learner rank 0, whose ``module`` is the policy).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path

import torch

from maskgrpo_ray.config import Config
from maskgrpo_ray.errors import UserError

log = logging.getLogger(__name__)

FINAL_POLICY = "final_policy.safetensors"
BASE = "base"


class WeightsError(UserError, FileNotFoundError):
    """Weights an evaluation was pointed at that cannot be read."""


def save_final_policy(
    run_dir: Path, state: Mapping[str, torch.Tensor], info: dict, name: str = FINAL_POLICY
) -> Path:
    """``RUN_DIR/final_policy.safetensors`` (or ``name``) with ``info`` (step, version, model
    kind) in its metadata; written to a temporary name, then renamed."""
    from safetensors.torch import save_file

    path = run_dir / name
    tmp = path.with_suffix(".tmp")
    tensors = {k: v.detach().cpu().contiguous() for k, v in state.items()}
    save_file(tensors, str(tmp), metadata={k: json.dumps(v) for k, v in info.items()})
    tmp.replace(path)
    return path


FINAL_ADAPTER = "final_adapter"
FINAL_MERGED = "final_policy_merged.safetensors"


def export_final_policy(
    run_dir: Path, cfg: Config, state: Mapping[str, torch.Tensor], info: dict
) -> list[Path]:
    """The run's end: ``final_policy.safetensors`` (the trained tensors); with ``model.lora``
    also ``final_adapter/`` in peft's format (``PeftModel.from_pretrained`` loads it) and, with
    ``model.lora.save_merged``, ``final_policy_merged.safetensors`` (the base with the adapter
    merged in, under the base model's names: a policy built without LoRA loads it)."""
    paths = [save_final_policy(run_dir, state, info)]
    lora = cfg.model.lora
    if lora is None:
        return paths
    from maskgrpo_ray.models.lora import merged_state, save_adapter

    paths.append(save_adapter(run_dir / FINAL_ADAPTER, state, lora, base=cfg.model.kind))
    if lora.save_merged:
        from maskgrpo_ray.pipeline.build import build_policy

        policy = build_policy(cfg.model)  # the base, on this machine's CPU
        policy.load_state_dict(dict(state), strict=False)
        merged = merged_state(policy)
        paths.append(save_final_policy(run_dir, merged, info, name=FINAL_MERGED))
    return paths


def _from_file(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    from maskgrpo_ray.weights.safe_files import deepspeed_globals, load_torch_file

    # weights_only: a .pt a user passes never runs code (DeepSpeed's own classes allowed)
    state = load_torch_file(path, "weights", allow=deepspeed_globals())
    if isinstance(state, Mapping) and "module" in state:  # DeepSpeed model states
        state = state["module"]
    if not isinstance(state, Mapping) or not all(
        isinstance(v, torch.Tensor) for v in state.values()
    ):
        raise WeightsError(f"{path}: not a state dict of tensors (nor DeepSpeed model states)")
    empty = [k for k, v in state.items() if v.numel() == 0]
    if empty:
        raise WeightsError(
            f"{path}: {len(empty)} tensors are empty (e.g. {empty[0]!r}): a ZeRO stage 3 "
            "checkpoint keeps the weights in partitions; evaluate the run's "
            f"{FINAL_POLICY} instead (written when the run finishes)"
        )
    return dict(state)


def _from_checkpoint(folder: Path) -> dict[str, torch.Tensor]:
    if (folder / "policy.pt").is_file():
        return _from_file(folder / "policy.pt")
    states = sorted((folder / "learner").rglob("mp_rank_00_model_states.pt"))
    if states:
        return _from_file(states[0])
    raise WeightsError(
        f"{folder}: a checkpoint without policy.pt or learner/**/mp_rank_00_model_states.pt"
    )


def resolve_weights(
    source: str, cfg: Config, scratch: Path
) -> tuple[dict[str, torch.Tensor] | None, str]:
    """``(state dict or None for the base model, a description)`` for ``source``: ``"base"``,
    a ``.safetensors``/``.pt`` file, a run directory (its final policy, else its newest valid
    checkpoint) or a checkpoint folder. Raises :class:`WeightsError` naming what was looked
    for and the fix."""
    from maskgrpo_ray.checkpoints.run_store import run_store

    if source == BASE:
        return None, "base model (the config's model section)"
    path = Path(source)
    if path.is_file():
        return _from_file(path), str(path)
    if not path.is_dir():
        raise WeightsError(
            f"--weights {source!r}: no such file or folder; pass 'base', a run directory, a "
            "checkpoint folder or a .safetensors/.pt file"
        )
    from maskgrpo_ray.models.lora import is_adapter_folder, load_adapter

    if is_adapter_folder(path):  # a peft adapter folder (ours: RUN_DIR/final_adapter)
        if cfg.model.lora is None:
            raise WeightsError(
                f"--weights {source}: a LoRA adapter folder, but the config has no model.lora; "
                "evaluate it with its run's config, or set model.lora to its adapter_config.json"
            )
        return load_adapter(path)[0], f"{path} (LoRA adapter)"
    if (path / FINAL_POLICY).is_file():
        return _from_file(path / FINAL_POLICY), str(path / FINAL_POLICY)
    if (path / "executor.pt").is_file():  # a checkpoint folder
        return _from_checkpoint(path), str(path)
    store = run_store(cfg.run, path)
    folder = store.fetch_valid(scratch)
    if folder is None:
        raise WeightsError(
            f"--weights {source}: no {FINAL_POLICY} (the run has not finished) and no valid "
            f"checkpoint at {store.location}; finish the run, or set "
            "run.checkpoint_every_steps > 0"
        )
    log.info("evaluating %s: checkpoint %s (the run has no %s)", path, folder.name, FINAL_POLICY)
    return _from_checkpoint(folder), f"{path} checkpoint {folder.name}"
