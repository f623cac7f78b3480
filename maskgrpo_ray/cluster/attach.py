"""Joining a Ray cluster, or starting a local one bound to loopback only.

``RAY_ADDRESS`` (set by ``ray job submit``) or ``run.ray_address`` -> join that cluster (a GCS
address, or the job API's URL ``http://HOST:8265``: :func:`head_of_url` finds its GCS).
Otherwise a new single-node cluster is started whose every listening socket is on 127.0.0.1:
Ray listens on all interfaces by default, and on Ray 2.60 only
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` (read when ``ray`` is imported, inherited by the
raylet and every worker) makes it bind to loopback. Token authentication is on: for a local
cluster we choose it ourselves (:func:`choose_token_auth`, what Ray's default would pick), and we
never turn it off; an explicit ``RAY_AUTH_MODE`` is Ray's to obey.

A local cluster belongs to the run that started it, so a SIGTERM meant for the run (``timeout``,
``kill -TERM -PGID``, SLURM's ``scancel``: every process of the job at once) is the driver's to
handle: the cluster's processes (GCS, raylet, and through the raylet every worker) start with
SIGTERM blocked, as Ray already starts them with SIGINT blocked, so they keep serving while the
driver writes its checkpoint (:func:`sigterm_blocked`); the driver ends them when it shuts the
cluster down, or the kernel does when the driver dies (Ray's fate sharing, ``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from maskgrpo_ray.errors import UserError, one_line

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


def choose_token_auth() -> str:
    """Token authentication for the local cluster this process starts, chosen here: with
    ``RAY_AUTH_MODE`` unset, Ray 2.59+ turns it on by itself and warns on every start "Token
    authentication is enabled for this Ray cluster. Set RAY_AUTH_MODE=disabled to opt out",
    which tells a user of the embedded default nothing to do (the cluster listens on 127.0.0.1
    only, and we keep the token on). Setting the mode to ``token`` is the same choice made
    explicitly, so Ray has nothing to announce; the connect log line says it in our words. As
    Ray does when it chooses, the setting is read again (``Config.initialize``: Ray caches its
    config when imported). An explicit ``RAY_AUTH_MODE`` is left alone. Returns what the log
    line says of it."""
    mode = os.environ.get("RAY_AUTH_MODE")
    if mode is not None:
        return f"RAY_AUTH_MODE={mode}"
    from ray._raylet import Config  # type: ignore[attr-defined]  # not in its stubs

    os.environ["RAY_AUTH_MODE"] = "token"
    Config.initialize("")
    return "on"


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
    if address and address.startswith(("http://", "https://")):  # the job API's URL
        source = "RAY_ADDRESS" if os.environ.get("RAY_ADDRESS") else "run.ray_address"
        head = head_of_url(address, source)
        log.info("joining the Ray cluster at %s", head.where)
        check_dashboard(ray.init(address=head.gcs), head)
        return ClusterHandle(address=head.gcs, started_local=False)
    if address:
        log.info("joining the Ray cluster at %s", address)
        ray.init(address=address)
        return ClusterHandle(address=address, started_local=False)
    force_loopback()
    auth = choose_token_auth()
    log.info(
        "starting a local Ray cluster bound to 127.0.0.1 (token authentication: %s; "
        "num_cpus=%s, num_gpus=%s)",
        auth,
        num_cpus,
        num_gpus,
    )
    with sigterm_blocked():  # the cluster's processes inherit the mask (module docstring)
        ray.init(
            num_cpus=num_cpus,
            num_gpus=num_gpus,
            include_dashboard=include_dashboard,
            dashboard_host="127.0.0.1",
        )
    _end_without_sigterm()
    return ClusterHandle(address=None, started_local=True)


@contextlib.contextmanager
def sigterm_blocked() -> Iterator[None]:
    """SIGTERM blocked in this thread for the block: processes started in it inherit the
    blocked mask across ``exec`` (a C++ raylet's own handler never runs, the workers it starts
    inherit it too); this process's mask is restored after, and a SIGTERM that came meanwhile
    is delivered then."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _end_without_sigterm() -> None:
    """``ray.shutdown`` ends a local cluster's processes with SIGTERM, waits a second for each,
    then SIGKILLs it; with SIGTERM blocked in them that is 1 s per process for nothing (3.5 s
    measured), so they are killed at once. Our actors have ended before (the executor's
    shutdown); the raylet's idle workers follow it. Skipped (Ray's slow path) should Ray's
    node object change shape."""
    import ray._private.worker as ray_worker

    node = getattr(ray_worker, "_global_node", None)
    for infos in getattr(node, "all_processes", {}).values():
        for info in infos:
            proc = getattr(info, "process", None)
            if proc is not None and hasattr(proc, "kill"):
                proc.terminate = proc.kill


ATTACH_TIMEOUT_S = 20.0


class NoCluster(UserError, ConnectionError):
    """No running Ray cluster where a command that attaches to one looked."""


def _local_head_address() -> str | None:
    """The GCS address the newest head started on this machine wrote (``ray start`` and a
    local ``ray.init`` both write it), or None."""
    from ray._private.utils import read_ray_address

    return read_ray_address() or None


def use_token_if_present() -> None:
    """``RAY_AUTH_MODE=token`` for this process when it is unset and a token is here
    (``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH`` or ``~/.ray/auth_token``), as
    ``deploy/submit.sh`` does; Ray reads it when imported, so call this before ``import ray``."""
    token_file = Path.home() / ".ray" / "auth_token"
    if "RAY_AUTH_MODE" not in os.environ and (
        os.environ.get("RAY_AUTH_TOKEN")
        or os.environ.get("RAY_AUTH_TOKEN_PATH")
        or token_file.exists()
    ):
        os.environ["RAY_AUTH_MODE"] = "token"


GCS_DEFAULT_PORT = 6379


@dataclass(frozen=True)
class HeadAddress:
    """Where ``status`` / ``scale`` look for the job's head."""

    gcs: str  # HOST:PORT of the GCS, joined with ray.init
    where: str  # for messages: the value and where it came from
    dashboard: str | None = None  # HOST:PORT the joined head's dashboard must be at


def find_head(address: str | None) -> HeadAddress:
    """The GCS to join, found as ``ray job submit`` finds its head: ``address`` (``--address``),
    then ``RAY_ADDRESS``, then the local head's own address file. The job API's URL
    (``http://HOST:8265``, the value ``ray job submit`` takes) names the dashboard, not the GCS:
    on this machine the GCS comes from the local head's address file (and the joined head's
    dashboard must be that URL's); on another host, Ray's default GCS port there, announced
    with a warning. Raises :class:`NoCluster` when there is nothing to try."""

    candidates = (
        ("--address", address),
        ("RAY_ADDRESS", os.environ.get("RAY_ADDRESS")),
        ("the local head's address file", _local_head_address()),
    )
    source, found = next(((s, a) for s, a in candidates if a and a != "auto"), ("", None))
    if found is None:
        raise NoCluster(
            "no running Ray cluster found (no --address, no RAY_ADDRESS, no head started on "
            "this machine); start the job first, or pass --address HOST:PORT of its head"
        )
    if not found.startswith(("http://", "https://")):
        return HeadAddress(found, f"{found} (from {source})")
    return head_of_url(found, source)


def head_of_url(found: str, source: str) -> HeadAddress:
    """The GCS behind the job API's URL ``found`` (``http://HOST:8265``) that ``source`` gave:
    on this machine, the local head's address file (its dashboard must be ``found``'s); on
    another host, Ray's default GCS port there, announced with a warning."""
    from urllib.parse import urlsplit

    url = urlsplit(found)
    host, dash = url.hostname or "", f"{url.hostname}:{url.port or 8265}"
    what = f"{source}={found}, the Ray dashboard's (job API's) URL"
    if is_loopback_host(host):
        local = _local_head_address()
        if not local:
            raise NoCluster(
                f"{what}: no head was started on this machine (no address file); start the "
                "job's head, or pass --address HOST:PORT of its GCS (ray start --port)"
            )
        return HeadAddress(local, f"{local} (the local head's address file, for {what})", dash)
    gcs = f"{host}:{GCS_DEFAULT_PORT}"
    log.warning(
        "%s: joining the GCS at %s (Ray's default port on that host; pass --address HOST:PORT "
        "if the head was started with another --port)",
        what,
        gcs,
    )
    return HeadAddress(gcs, f"{gcs} (Ray's default GCS port, for {what})", dash)


def check_dashboard(context: Any, head: HeadAddress) -> None:
    """NoCluster (after leaving it) when the joined cluster's dashboard is not the one the
    job API's URL named: the address file belonged to another head."""
    import ray

    joined = str(getattr(context, "dashboard_url", "") or "").removeprefix("http://")
    if head.dashboard is not None and not _same_endpoint(joined, head.dashboard):
        ray.shutdown()
        raise NoCluster(
            f"the head at {head.where} has its dashboard at {joined or 'no address'}, not "
            f"{head.dashboard}: another head; pass --address HOST:PORT of the job's GCS"
        )


def attach(address: str | None, namespace: str, timeout_s: float = ATTACH_TIMEOUT_S) -> str:
    """Join a *running* cluster for ``maskgrpo status`` / ``scale``, or fail in one line.

    The head is found by :func:`find_head` (``--address``, ``RAY_ADDRESS`` (a GCS address or
    the job API's URL), the local head's address file). A head bound to loopback (as
    ``docs/operations.md`` starts it) is joined on loopback. The GCS port is probed first (a
    refused or silent port fails within ``timeout_s``), and the join itself is given
    ``timeout_s`` too. Returns the address joined; raises :class:`NoCluster` naming the
    address tried, where it came from and how to point elsewhere.
    """
    import socket

    import ray

    if ray.is_initialized():
        return "(already connected)"
    head = find_head(address)
    where = head.where
    host, _, port = head.gcs.removeprefix("ray://").rpartition(":")
    if not port.isdigit():
        raise NoCluster(f"{where}: not HOST:PORT of a Ray head's GCS; pass --address HOST:PORT")
    try:
        socket.create_connection((host, int(port)), timeout=min(timeout_s, 5.0)).close()
    except OSError as err:
        raise NoCluster(
            f"no Ray head answers at {where}: {err.strerror or err}; start the job's cluster, "
            "or point --address / RAY_ADDRESS at its head (HOST:6379)"
        ) from None
    kwargs: dict[str, Any] = {"address": head.gcs, "namespace": namespace, "log_to_driver": False}
    if is_loopback_host(host):
        force_loopback()
        kwargs["_node_ip_address"] = "127.0.0.1"  # join the loopback head on loopback
    check_dashboard(_join(kwargs, where, timeout_s), head)
    return head.gcs


def _same_endpoint(a: str, b: str) -> bool:
    """``127.0.0.1:8265`` and ``localhost:8265`` are the same loopback endpoint."""
    (ha, _, pa), (hb, _, pb) = a.rpartition(":"), b.rpartition(":")
    return pa == pb and (ha == hb or (is_loopback_host(ha) and is_loopback_host(hb)))


def _join(kwargs: dict[str, Any], where: str, timeout_s: float) -> Any:
    """``ray.init(**kwargs)`` within ``timeout_s`` (a thread: a join can hang), or NoCluster."""
    import threading

    import ray

    errors: list[BaseException] = []
    contexts: list[Any] = []
    joined = threading.Event()

    def join() -> None:
        try:
            contexts.append(ray.init(**kwargs))
        except BaseException as err:  # noqa: BLE001 - reported below, in the caller
            errors.append(err)
        joined.set()

    threading.Thread(target=join, daemon=True, name="maskgrpo-attach").start()
    if not joined.wait(timeout_s):
        raise NoCluster(
            f"the Ray head at {where} did not let this process join within {timeout_s:.0f} s; "
            "check that it is the job's head and reachable from here (--address / RAY_ADDRESS)"
        )
    if errors:
        raise NoCluster(
            f"could not join the Ray head at {where}: {one_line(str(errors[0]))}; if the "
            "cluster uses token authentication, this process needs RAY_AUTH_MODE=token and "
            "the cluster's token (RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token)"
        )
    return contexts[0]


def is_loopback_host(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


def disconnect(handle: ClusterHandle) -> None:
    """Shut down what ``connect`` started (a joined cluster keeps running). A process of the
    local cluster that outlives ``ray.shutdown`` is killed: the raylet's runtime-env agent
    inherited the blocked SIGTERM, so the signal its fate sharing sends when the raylet dies
    never reaches it (it outlived a group SIGTERM by more than 20 s)."""
    import ray

    if ray.is_initialized() and handle.started_local:
        started = _ray_descendants()
        ray.shutdown()
        _reap(started)


def _ray_descendants() -> list[int]:
    """This process's descendants that are Ray's (their command line names ``ray``), from
    ``/proc`` (empty where there is none)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(stat.parent.name))
    out, todo = [], [os.getpid()]
    while todo:
        for pid in children.get(todo.pop(), []):
            todo.append(pid)
            with contextlib.suppress(OSError):
                cmd = (Path("/proc") / str(pid) / "cmdline").read_bytes()
                if b"ray" in cmd.lower():
                    out.append(pid)
    return out


def _reap(pids: list[int], wait_s: float = 2.0) -> None:
    """SIGKILL those of ``pids`` still running ``wait_s`` after the cluster's shutdown."""
    import time

    def running(pid: int) -> bool:
        try:
            state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return False
        return state != "Z"

    deadline = time.monotonic() + wait_s
    while any(running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [p for p in pids if running(p)]
    for pid in left:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    if left:
        log.debug("killed %d process(es) of the local cluster left after its shutdown", len(left))
