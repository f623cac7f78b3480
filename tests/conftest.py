"""Shared fixtures: the Show-o reference fixture folder, a module-scoped local Ray cluster."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# One DeepSpeed g++ build (shm_comm) for the whole session: tests that isolate the model cache
# (MASKGRPO_CACHE_DIR in a tmp folder) would otherwise rebuild it each, minutes on 2 loaded
# cores. Ray workers of the clusters the tests start inherit it (ray_cluster.apply_env_defaults
# only fills what is unset).
os.environ.setdefault(
    "TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "maskgrpo-ray" / "torch_extensions")
)


@pytest.fixture(scope="session")
def showo_fixtures() -> Path:
    """The Show-o reference fixture folder (``showo_helpers.fixture_dir``: fails if missing)."""
    from showo_helpers import fixture_dir

    return fixture_dir()


@pytest.fixture
def one_torch_thread():
    """Run a test with one torch thread (as the reference fixtures were made)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def ray_cluster():
    """A real local Ray cluster (no local mode), bound to loopback, for one test module."""
    import ray

    from maskgrpo_ray.cluster.attach import connect

    os.environ.pop("RAY_ADDRESS", None)
    if ray.is_initialized():
        ray.shutdown()
    connect(None, num_cpus=4, include_dashboard=False)
    yield
    ray.shutdown()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
