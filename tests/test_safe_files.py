"""No code runs from a file a user passes: a malicious pickle (one that creates a file when
unpickled) is refused by every loader with one line, and the file it would create never
appears."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from maskgrpo_ray.weights.safe_files import (
    DEEPSPEED_GLOBALS,
    UnsafeFileError,
    check_pickles,
    load_torch_file,
    unsafe_globals,
)


class Evil:
    """Unpickling this calls ``open(marker, "w")``: a file appears if the pickle runs."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _evil_file(path: Path, marker: Path, wrap=None) -> Path:
    payload = Evil(marker)
    torch.save(wrap(payload) if wrap else payload, path)
    return path


@pytest.fixture
def marker(tmp_path):
    m = tmp_path / "PWNED"
    yield m
    assert not m.exists(), "the pickle ran"


def test_the_payload_really_runs_when_unpickled_freely(tmp_path):
    """The test's premise: an unrestricted load of this file creates the marker."""
    m = tmp_path / "ran"
    path = _evil_file(tmp_path / "x.pt", m)
    torch.load(path, weights_only=False)
    assert m.exists()


def test_load_torch_file_refuses_in_one_line(tmp_path, marker):
    path = _evil_file(tmp_path / "w.pt", marker, lambda p: {"weight": torch.zeros(2), "x": p})
    with pytest.raises(UnsafeFileError) as err:
        load_torch_file(path, "weights")
    text = str(err.value)
    assert "\n" not in text and str(path) in text and "io.open" in text  # pickle's `open`
    assert "safetensors" in text  # the fix
    assert unsafe_globals(path) == ["io.open"]


def test_eval_weights_refuse_a_malicious_pt(tmp_path, marker, capsys):
    """``maskgrpo eval --weights evil.pt``: one line, exit 2, nothing runs."""
    from maskgrpo_ray.cli import main

    path = _evil_file(tmp_path / "tuned.pt", marker, lambda p: {"module": {"w": p}})
    code = main(["eval", "--weights", str(path), "--out", str(tmp_path / "out")])
    lines = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert code == 2 and len(lines) == 1 and "refused" in lines[0] and str(path) in lines[0]


def test_a_checkpoint_folder_with_a_foreign_pickle_is_refused_before_deepspeed(tmp_path, marker):
    """DeepSpeed's ``load_checkpoint`` unpickles freely: the run's restore scans first."""
    folder = tmp_path / "ckpt" / "learner" / "learner"
    folder.mkdir(parents=True)
    torch.save({"module": {"w": torch.zeros(2)}}, folder / "mp_rank_00_model_states.pt")
    assert check_pickles(tmp_path / "ckpt") == 1  # a clean one passes
    _evil_file(folder / "zero_pp_rank_0_mp_rank_00_optim_states.pt", marker, lambda p: [p])
    with pytest.raises(UnsafeFileError, match="optim_states.pt.*io.open"):
        check_pickles(tmp_path / "ckpt")


def test_driver_state_and_model_bin_refuse(tmp_path, marker):
    from maskgrpo_ray.models.showo_loading import read_weights

    folder = tmp_path / "showo"
    folder.mkdir()
    _evil_file(folder / "pytorch_model.bin", marker, lambda p: {"w": p})
    with pytest.raises(UnsafeFileError, match="model weights"):
        read_weights(folder)
    with pytest.raises(UnsafeFileError, match="driver state"):
        load_torch_file(_evil_file(tmp_path / "driver.pt", marker), "a checkpoint's driver state")


def test_restore_refuses_a_tampered_checkpoint(tmp_path, marker):
    """A local run's checkpoint whose executor state was replaced: the restore stops with one
    line before loading anything."""
    from maskgrpo_ray.config import load_config
    from maskgrpo_ray.loop.recovery import Checkpoints

    cfg = load_config(Path(__file__).parents[1] / "configs" / "toy.yaml")
    folder = tmp_path / "step_00000001"
    folder.mkdir()
    torch.save({"next_step": 1, "base": {}, "totals": {}, "source": {}}, folder / "driver.pt")
    _evil_file(folder / "executor.pt", marker, lambda p: {"policy_version": p})

    class NoExecutor:
        def load(self, folder: Path) -> None:
            raise AssertionError("the executor must not load a refused checkpoint")

    ck = Checkpoints(cfg, NoExecutor(), None, tmp_path, None)  # type: ignore[arg-type]
    with pytest.raises(UnsafeFileError, match="executor.pt"):
        ck.restore(folder)


def test_deepspeed_allow_list_is_deepspeed_data_classes_only():
    """What the allow-list lets DeepSpeed's files name: its own data classes, nothing callable
    that could reach other code (no builtins, no torch functions)."""
    import importlib
    import inspect

    for name in DEEPSPEED_GLOBALS:
        module, _, attr = name.rpartition(".")
        assert module.startswith("deepspeed."), name
        assert inspect.isclass(getattr(importlib.import_module(module), attr)), name


@pytest.mark.skipif(shutil.which("true") is None, reason="posix")
def test_a_legacy_pickle_file_is_refused_too(tmp_path, marker):
    """Not a torch zip file: a raw pickle stream (``torch.save(..., _use_new_zipfile_serialization
    =False)``) is refused by the weights-only unpickler as well."""
    path = tmp_path / "legacy.pt"
    torch.save({"w": Evil(marker)}, path, _use_new_zipfile_serialization=False)
    with pytest.raises(UnsafeFileError):
        load_torch_file(path, "weights")
