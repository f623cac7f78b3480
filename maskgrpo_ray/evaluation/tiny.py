"""Random-weights stand-ins for tests and benchmarks (no download): an Inception file of
torch-fidelity's shapes."""

from __future__ import annotations

from pathlib import Path
from unittest import mock

import torch


def random_inception_file(path: Path, seed: int = 0) -> str:
    """Write a random Inception state dict of torch-fidelity's shapes to ``path``: the module is
    built with its weight loading skipped, its convolutions re-initialised He-normal (the default
    init shrinks activations about 6x in variance per layer, so features would come out near
    1e-7 and FID near 1e-12). Returns the path."""
    from torch_fidelity import feature_extractor_inceptionv3 as fe

    with (
        mock.patch.object(fe.torch, "load", lambda *a, **k: None),
        mock.patch.object(fe.FeatureExtractorInceptionV3, "load_state_dict", lambda s, d: None),
    ):
        torch.manual_seed(seed)
        model = fe.FeatureExtractorInceptionV3("inception-v3-compat", ["2048"], "unused")
    for m in model.modules():
        if isinstance(m, torch.nn.Conv2d):
            torch.nn.init.kaiming_normal_(m.weight, nonlinearity="relu")
    torch.save(model.state_dict(), path)
    return str(path)
