"""Loading and exporting Show-o and MAGVIT-v2 folders (local or in the Hugging Face cache).

A model folder holds ``config.json`` plus one weights file, looked for in this order:
``pytorch_model.safetensors`` (the official loader's name), ``model.safetensors``,
``pytorch_model.bin`` (read with ``weights_only=True``), or a sharded
``*.safetensors.index.json``. A name that is not a local folder is looked up in the Hugging Face
cache (``local_files_only``: nothing is downloaded).

Keys must match exactly: a missing, unexpected or misshaped key fails with the keys named and the
likely cause. Models are built on the meta device and the weights assigned, so a 1.4B model does
not first allocate random weights.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from maskgrpo_ray.errors import UserError
from maskgrpo_ray.models.magvit import MagvitConfig, MAGVITv2, lfq_codebook
from maskgrpo_ray.models.showo_phi import PhiConfig, ShowoTransformer
from maskgrpo_ray.models.showo_prompting import ShowoVocab
from maskgrpo_ray.weights.hub_field import HubField

BUILTIN_TOKENIZERS = ("builtin:hashing", "builtin:integer-ids")  # stand-ins (tiny test models)
DEFAULT_MAGVIT = "showlab/magvitv2"
WEIGHT_FILES = ("pytorch_model.safetensors", "model.safetensors", "pytorch_model.bin")
SHARD_INDEXES = ("pytorch_model.safetensors.index.json", "model.safetensors.index.json")
EXPORT_WEIGHTS = "pytorch_model.safetensors"
_LIST_AT_MOST = 20
HUB_FIELDS = (  # the fields that take a hub id (maskgrpo_ray.weights.hub), the tokenizer's files only
    HubField("showo.showo_path"),
    HubField("showo.magvit_path"),
    HubField("showo.tokenizer_path", allow_patterns=("*.json", "*.txt", "*.model")),
)


class ModelFilesMissing(UserError, FileNotFoundError):
    """A model folder, its config or its weights are not where the config points."""


class CheckpointMismatchError(UserError, ValueError):
    """The weights do not fit the model: ``missing``, ``unexpected`` and ``misshaped`` keys."""

    def __init__(
        self, message: str, missing: list[str], unexpected: list[str], misshaped: list[str]
    ):
        super().__init__(message)
        self.missing, self.unexpected, self.misshaped = missing, unexpected, misshaped


@dataclass(frozen=True)
class ShowoFolderConfig:
    """What a Show-o ``config.json`` fixes: the transformer dimensions and the id layout."""

    phi: PhiConfig = field(default_factory=PhiConfig)
    llm_vocab_size: int = 50295
    codebook_size: int = 8192
    num_vq_tokens: int = 256
    num_new_special_tokens: int = 10
    w_clip_vit: bool = False
    llm_model_path: str = "microsoft/phi-1_5"
    bos_id: int | None = None  # from the tokenizer; only our exports record it
    eos_id: int | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any], folder: Path | None = None) -> ShowoFolderConfig:
        """Parse the official (diffusers-style) config, or ours (which adds ``phi_config``).

        The official file has no transformer dimensions (they come from ``llm_model_path``,
        i.e. phi-1_5): they are read from ``phi_config`` if present, else from
        ``llm_model_path/config.json`` if that is a local folder, else Phi-1.5's.
        """
        llm = int(d.get("llm_vocab_size", 50295))
        codebook = int(d.get("codebook_size", 8192))
        new = int(d.get("num_new_special_tokens", 10))
        vocab_size = llm + new + codebook + 1
        if int(d.get("vocab_size", vocab_size)) != vocab_size:
            raise ValueError(
                f"config.json: vocab_size {d['vocab_size']} != llm_vocab_size + "
                f"num_new_special_tokens + codebook_size + 1 = {vocab_size}"
            )
        phi_dict: dict[str, Any] = {}
        llm_path = str(d.get("llm_model_path", "microsoft/phi-1_5"))
        if "phi_config" in d:
            phi_dict = dict(d["phi_config"])
        elif Path(llm_path).is_dir() and (Path(llm_path) / "config.json").is_file():
            phi_dict = json.loads((Path(llm_path) / "config.json").read_text())
        phi = PhiConfig.from_dict({**phi_dict, "vocab_size": vocab_size})
        return cls(
            phi=phi,
            llm_vocab_size=llm,
            codebook_size=codebook,
            num_vq_tokens=int(d.get("num_vq_tokens", 256)),
            num_new_special_tokens=new,
            w_clip_vit=bool(d.get("w_clip_vit", False)),
            llm_model_path=llm_path,
            bos_id=d.get("bos_id"),
            eos_id=d.get("eos_id"),
        )

    def to_dict(self) -> dict[str, Any]:
        vocab_size = self.llm_vocab_size + self.num_new_special_tokens + self.codebook_size + 1
        out: dict[str, Any] = {
            "_class_name": "Showo",
            "_diffusers_version": "0.30.1",
            "w_clip_vit": False,
            "vocab_size": vocab_size,
            "llm_vocab_size": self.llm_vocab_size,
            "llm_model_path": self.llm_model_path,
            "codebook_size": self.codebook_size,
            "num_vq_tokens": self.num_vq_tokens,
            "num_new_special_tokens": self.num_new_special_tokens,
            "mask_token_id": vocab_size - 1,
            "phi_config": self.phi.to_dict(),
        }
        if self.bos_id is not None:
            out["bos_id"], out["eos_id"] = self.bos_id, self.eos_id
        return out

    def vocab(self, bos_id: int | None = None, eos_id: int | None = None) -> ShowoVocab:
        bos = bos_id if bos_id is not None else self.bos_id
        eos = eos_id if eos_id is not None else self.eos_id
        default = 50256 if self.llm_vocab_size == 50295 else self.llm_vocab_size - 10
        return ShowoVocab(
            llm_vocab_size=self.llm_vocab_size,
            codebook_size=self.codebook_size,
            bos_id=default if bos is None else int(bos),
            eos_id=default if eos is None else int(eos),
            num_new_special_tokens=self.num_new_special_tokens,
        )


def resolve_pretrained_folder(
    name_or_path: str | Path, *, cache_dir: str | Path | None = None, revision: str | None = None
) -> Path:
    """A local folder as is; otherwise the snapshot of a repo id in the Hugging Face cache."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise ModelFilesMissing(
            f"{path} is a file: give the folder that holds config.json and the weights"
        )
    try:
        from huggingface_hub import snapshot_download

        found = snapshot_download(
            str(name_or_path), cache_dir=cache_dir, revision=revision, local_files_only=True
        )
    except Exception as err:  # not a repo id, or not in the cache
        raise ModelFilesMissing(
            f"{str(name_or_path)!r} is neither a local folder nor a model in the Hugging Face "
            f"cache ({cache_dir or 'default HF_HUB_CACHE'}); nothing is downloaded here. Point "
            "the config at a folder, or fill the cache first (huggingface-cli download <repo>)."
        ) from err
    return Path(found)


def weights_file(folder: Path) -> Path:
    """The weights file (or shard index) of a model folder; :class:`ModelFilesMissing` names
    what was looked for and what the folder holds."""
    for name in WEIGHT_FILES + SHARD_INDEXES:
        if (folder / name).is_file():
            return folder / name
    present = sorted(p.name for p in folder.iterdir())
    raise ModelFilesMissing(
        f"no weights in {folder}: looked for {', '.join(WEIGHT_FILES + SHARD_INDEXES)}; "
        f"the folder holds {present}; point the config at the folder that has them"
    )


def read_weights(folder: Path) -> dict[str, torch.Tensor]:
    """The state dict of a model folder (see the module docstring for the file names)."""
    from safetensors.torch import load_file

    from maskgrpo_ray.weights.safe_files import load_torch_file

    file = weights_file(folder)
    if file.name.endswith(".bin"):
        return load_torch_file(file, "model weights")
    if file.name in WEIGHT_FILES:
        return load_file(str(file))
    shards = sorted(set(json.loads(file.read_text())["weight_map"].values()))
    state: dict[str, torch.Tensor] = {}
    for shard in shards:
        state.update(load_file(str(folder / shard)))
    return state


def read_config(folder: Path) -> dict[str, Any]:
    file = folder / "config.json"
    return json.loads(file.read_text()) if file.is_file() else {}


def _likely_causes(missing: list[str], unexpected: list[str], misshaped: list[str]) -> list[str]:
    causes = []
    if missing and all("q_layernorm" in k or "k_layernorm" in k for k in missing):
        causes.append(
            "the q/k LayerNorm weights are absent: a stock Phi checkpoint (qk_layernorm=False), "
            "not Show-o, whose attention normalises q and k per head"
        )
    if any(k.startswith("mm_projector.") for k in unexpected):
        causes.append("mm_projector.* belongs to a show-o-w-clip-vit checkpoint: set w_clip_vit")
    if missing and any(k.startswith("showo.") for k in missing):
        if any(k.startswith(("model.", "lm_head.")) for k in unexpected):
            causes.append("keys lack the 'showo.' prefix: saved from the inner Phi model")
        if any(k.startswith(("encoder.", "decoder.", "quantize.")) for k in unexpected):
            causes.append("these are MAGVIT-v2 weights: the Show-o and MAGVIT paths are swapped")
    if any(k.startswith(("encoder.", "decoder.", "quantize.")) for k in missing) and any(
        k.startswith("showo.") for k in unexpected
    ):
        causes.append("these are Show-o weights: the Show-o and MAGVIT paths are swapped")
    if any("embed_tokens" in k or "lm_head" in k for k in misshaped):
        causes.append(
            "the vocabulary differs: Show-o is built at llm_vocab_size + 10 + codebook_size + 1 "
            "(58498), not Phi's 51200; check config.json"
        )
    if misshaped and not causes:
        causes.append(
            "config.json (or phi_config / llm_model_path) describes other dimensions than the weights"
        )
    if not causes:
        causes.append("the weights come from another model or version than config.json describes")
    return causes


def check_state_dict(model: nn.Module, state: Mapping[str, torch.Tensor], source: str) -> None:
    """Raise :class:`CheckpointMismatchError` unless ``state`` has exactly the model's keys/shapes."""
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    missing = sorted(k for k in expected if k not in state)
    unexpected = sorted(k for k in state if k not in expected)
    misshaped = sorted(
        f"{k}: checkpoint {tuple(state[k].shape)}, model {expected[k]}"
        for k in expected
        if k in state and tuple(state[k].shape) != expected[k]
    )
    if not (missing or unexpected or misshaped):
        return

    def listing(title: str, keys: list[str]) -> str:
        if not keys:
            return ""
        more = (
            f"\n    ... and {len(keys) - _LIST_AT_MOST} more" if len(keys) > _LIST_AT_MOST else ""
        )
        body = "\n    ".join(keys[:_LIST_AT_MOST])
        return f"\n  {title} ({len(keys)}):\n    {body}{more}"

    causes = _likely_causes(missing, unexpected, [m.split(":")[0] for m in misshaped])
    raise CheckpointMismatchError(
        f"weights in {source} do not match {type(model).__name__}:"
        + listing("missing keys", missing)
        + listing("unexpected keys", unexpected)
        + listing("misshaped keys", misshaped)
        + "\n  likely cause: "
        + "; ".join(causes),
        missing,
        unexpected,
        [m.split(":")[0] for m in misshaped],
    )


def _assign(model: nn.Module, state: dict[str, torch.Tensor], dtype: torch.dtype, source: str):
    check_state_dict(model, state, source)
    cast = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    model.load_state_dict(cast, strict=True, assign=True)


def load_showo_transformer(
    name_or_path: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    cache_dir: str | Path | None = None,
) -> tuple[ShowoTransformer, ShowoFolderConfig]:
    """Build the transformer from a Show-o folder with strict key matching."""
    folder = resolve_pretrained_folder(name_or_path, cache_dir=cache_dir)
    cfg = ShowoFolderConfig.from_dict(read_config(folder), folder)
    state = read_weights(folder)
    if cfg.w_clip_vit:  # the understanding projector is not used for text-to-image
        state = {k: v for k, v in state.items() if not k.startswith("mm_projector.")}
    with torch.device("meta"):
        model = ShowoTransformer(cfg.phi)
    _assign(model, state, dtype, str(folder))
    return model.to(device), cfg


def load_magvit(
    name_or_path: str | Path,
    *,
    with_encoder: bool = False,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    cache_dir: str | Path | None = None,
) -> MAGVITv2:
    """Build MAGVIT-v2 from a folder; ``with_encoder=False`` skips the encoder's weights.

    The LFQ buffers are checked against the bit layout (channel 0 = most significant bit).
    """
    folder = resolve_pretrained_folder(name_or_path, cache_dir=cache_dir)
    cfg = MagvitConfig.from_dict(read_config(folder))
    state = read_weights(folder)
    if not with_encoder:
        state = {k: v for k, v in state.items() if not k.startswith("encoder.")}
    with torch.device("meta"):
        model = MAGVITv2(cfg, with_encoder=with_encoder)
    _assign(model, state, dtype, str(folder))
    if not torch.equal(model.quantize.embedding.float(), lfq_codebook(cfg.codebook_dim)):
        raise ValueError(f"{folder}: quantize.embedding is not the LFQ codebook (MSB-first bits)")
    return model.to(device)


def save_showo_folder(
    folder: str | Path, state: Mapping[str, torch.Tensor], config: ShowoFolderConfig
) -> Path:
    """Write ``config.json`` + ``pytorch_model.safetensors`` (the layout the loader reads)."""
    return _save(folder, state, config.to_dict())


def save_magvit_folder(folder: str | Path, model: MAGVITv2) -> Path:
    return _save(folder, model.state_dict(), model.config.to_dict())


def _save(folder: str | Path, state: Mapping[str, torch.Tensor], config: dict[str, Any]) -> Path:
    from safetensors.torch import save_file

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
    save_file(tensors, str(out / EXPORT_WEIGHTS), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def check_files(settings: Any) -> None:
    """Before any actor starts: the Show-o, MAGVIT-v2 and tokenizer folders of ``settings`` (a
    ``model.showo`` section) resolve (local or in the HF cache; nothing is downloaded) and hold
    weights; :class:`ModelFilesMissing` otherwise, naming the field, the path and the fix."""
    if settings.tiny_random:
        return
    places = (
        ("model.showo.showo_path", settings.showo_path),
        ("model.showo.magvit_path", settings.magvit_path or DEFAULT_MAGVIT),
    )
    folders = {}
    for key, spec in places:
        try:
            folders[key] = resolve_pretrained_folder(str(spec))
            weights_file(folders[key])
        except ModelFilesMissing as err:
            raise ModelFilesMissing(f"{key}: {err}") from None
    tokenizer = settings.tokenizer_path
    if tokenizer is None:
        folder = folders["model.showo.showo_path"]
        tokenizer = ShowoFolderConfig.from_dict(read_config(folder), folder).llm_model_path
    if tokenizer not in BUILTIN_TOKENIZERS:
        try:
            resolve_pretrained_folder(tokenizer)
        except ModelFilesMissing as err:
            raise ModelFilesMissing(
                f"model.showo.tokenizer_path (default: the checkpoint's llm_model_path): {err}"
            ) from None


def check_model_files(model: Any) -> None:
    """The registry's ``check_files`` of ``model.kind: showo`` (:func:`check_files` of its
    ``model.showo`` section)."""
    check_files(model.showo)
