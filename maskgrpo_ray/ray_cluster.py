"""Joining a Ray cluster, or starting a local one bound to loopback only.

``RAY_ADDRESS`` (set by ``ray job submit``) or ``run.ray_address`` -> join that cluster.
Otherwise a new single-node cluster is started whose every listening socket is on 127.0.0.1:
Ray listens on all interfaces by default, and on Ray 2.60 only
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` (read when ``ray`` is imported, inherited by the
raylet and every worker) makes it bind to loopback. Token authentication stays as Ray sets it
(on by default since 2.59 for local clusters); we never turn it off.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def cache_root() -> Path:
    """``$MASKGRPO_CACHE_DIR`` or ``~/.cache/maskgrpo-ray`` (shared with the toy model cache)."""
    return Path(os.environ.get("MASKGRPO_CACHE_DIR", Path.home() / ".cache" / "maskgrpo-ray"))


def process_env_defaults() -> dict[str, str]:
    """Environment every maskgrpo process should have (set with ``setdefault`` semantics).

    ``TORCH_EXTENSIONS_DIR`` keeps DeepSpeed's one-off g++ build (30-35 s) in our cache so
    every later learner start reuses it. Actors apply these themselves in ``__init__`` (a
    ``runtime_env`` would clash with the one ``ray job submit`` gives the job).
    """
    return {
        "TORCH_EXTENSIONS_DIR": str(cache_root() / "torch_extensions"),
        "TOKENIZERS_PARALLELISM": "false",
    }


def apply_env_defaults() -> None:
    for k, v in process_env_defaults().items():
        os.environ.setdefault(k, v)


def force_loopback() -> None:
    """Make a local cluster bind to 127.0.0.1 (also when ``ray`` is already imported)."""
    os.environ[LOOPBACK_ENV] = "0"
    import ray._private.ray_constants as rc

    rc.ENABLE_RAY_CLUSTER = False  # the module constant is read at import time


@dataclass(frozen=True)
class ClusterHandle:
    address: str | None  # None: a local cluster this process started
    started_local: bool


def resolve_address(cfg_address: str | None) -> str | None:
    """The cluster to join: ``RAY_ADDRESS`` wins (``ray job submit`` sets it), then the config."""
    return os.environ.get("RAY_ADDRESS") or cfg_address or None


def connect(
    cfg_address: str | None,
    num_cpus: int | None = None,
    include_dashboard: bool | None = None,
    num_gpus: int | None = None,
) -> ClusterHandle:
    """Join a running cluster or start a local loopback-only one; idempotent.

    Args:
        cfg_address: ``run.ray_address`` (``"auto"``, ``"127.0.0.1:6379"``, ...), or None.
        num_cpus: logical CPUs of a new local cluster (None: Ray counts the machine's).
        num_gpus: GPUs of a new local cluster (None: Ray counts the machine's; logical ones
            on a machine without them, for the simulated accelerator).
        include_dashboard: for a new local cluster (None: Ray's default, on if installed);
            the dashboard binds to 127.0.0.1 as well.
    """
    apply_env_defaults()
    import ray

    if ray.is_initialized():
        return ClusterHandle(address=None, started_local=False)
    address = resolve_address(cfg_address)
    if address:
        log.info("joining the Ray cluster at %s", address)
        ray.init(address=address)
        return ClusterHandle(address=address, started_local=False)
    force_loopback()
    log.info(
        "starting a local Ray cluster bound to 127.0.0.1 (num_cpus=%s, num_gpus=%s)",
        num_cpus,
        num_gpus,
    )
    ray.init(
        num_cpus=num_cpus,
        num_gpus=num_gpus,
        include_dashboard=include_dashboard,
        dashboard_host="127.0.0.1",
    )
    return ClusterHandle(address=None, started_local=True)


def disconnect(handle: ClusterHandle) -> None:
    """Shut down what ``connect`` started (a joined cluster keeps running)."""
    import ray

    if ray.is_initialized() and handle.started_local:
        ray.shutdown()
