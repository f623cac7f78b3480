"""LearnerGroup: creates the learner world (placement group, ranks, rendezvous) and fans
updates out to it. The driver talks to the learner only through this class."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import statistics
import time
from pathlib import Path
from typing import Any

import ray
import torch
from ray.exceptions import GetTimeoutError, ObjectLostError, RayActorError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from maskgrpo_ray.actors.base import wait_ready
from maskgrpo_ray.actors.pool import wait_placement
from maskgrpo_ray.learner.worker import RemoteLearnerWorker
from maskgrpo_ray.pipeline.data_plane import REF_BYTES, Traffic, TrainRefs, wire_bytes
from maskgrpo_ray.pipeline.learner_core import LearnerLost, UpdatePlanner, backward_calls
from maskgrpo_ray.pipeline.messages import TrainBatch, shard_bounds
from maskgrpo_ray.pipeline.settings import RunSettings

log = logging.getLogger(__name__)
ERROR_GRACE_S = 30.0  # after one rank's error, how long the others may take to report theirs


def reduce_rank_metrics(outs: list[dict[str, float]]) -> dict[str, float]:
    """Combine the ranks' metrics: ``*_max`` by max, ``abs_log_ratio_worst_step`` from the rank
    holding that max, the rest by mean (each rank's share; ``abs_log_ratio_p90`` becomes the
    mean of the ranks' 90th percentiles, an approximation), over the ranks that report the
    key (a figure a rank did not measure, such as the on-policy check under trajectory
    shrinkage without a block start in its shard, is absent there, not 0)."""
    keys = set().union(*outs)
    out = {k: statistics.fmean(o[k] for o in outs if k in o) for k in keys}
    for k in keys:
        if k.endswith("_max"):
            out[k] = max(o[k] for o in outs if k in o)
    worst = "abs_log_ratio_worst_step"
    if worst in keys:
        top = max((o for o in outs if worst in o), key=lambda o: o["abs_log_ratio_max"])
        out[worst] = top[worst]
    return out


class LearnerGroup:
    """``learner.num_workers`` DeepSpeed ranks, packed into one placement group.

    Args:
        settings: the run's settings (the ranks get ``model``, ``update`` and ``learner``).
        timeout_s: longest wait for any learner call.
    """

    def __init__(
        self, settings: RunSettings, timeout_s: float = 600.0, initial: Any = None
    ) -> None:
        """``initial``: an object reference to the weights every rank starts from (None: the
        model config's)."""
        self.settings, self.timeout_s = settings, timeout_s
        lc = settings.learner
        self.world_size = lc.num_workers
        bundle = {
            k: v
            for k, v in (("CPU", lc.num_cpus_per_worker), ("GPU", lc.num_gpus_per_worker))
            if v > 0
        }
        bundle.update(lc.custom_resources)
        self.pg = None
        opts: list[dict[str, Any]] = [{} for _ in range(self.world_size)]
        if bundle:
            self.pg = placement_group(
                [dict(bundle) for _ in range(self.world_size)], strategy="PACK"
            )
            what = f"the learner group ({self.world_size} ranks)"
            wait_placement(self.pg, what, [dict(bundle)] * self.world_size, timeout_s)
            opts = [
                {"scheduling_strategy": PlacementGroupSchedulingStrategy(self.pg, i)}
                for i in range(self.world_size)
            ]
        self.workers = [
            RemoteLearnerWorker.options(
                num_cpus=lc.num_cpus_per_worker,
                num_gpus=lc.num_gpus_per_worker,
                resources=dict(lc.custom_resources) or None,
                **opts[i],
            ).remote(settings.model, settings.update, lc, i, self.world_size)
            for i in range(self.world_size)
        ]
        wait_ready(self.workers, timeout_s)  # a user's mistake a rank found: its one line
        addr, port = ray.get(self.workers[0].address.remote(), timeout=timeout_s)
        counts = ray.get(
            [w.setup.remote(addr, port, initial) for w in self.workers], timeout=timeout_s
        )
        log.info("learner: %d ranks, %d trained parameters each", self.world_size, counts[0])
        self.planner = UpdatePlanner(settings.update)
        self.version = 0

    def update(
        self, batch: TrainBatch | TrainRefs, traffic: Traffic | None = None
    ) -> dict[str, float]:
        """One update on all ranks (``learner_core.apply_update`` each), planned once here.

        A ``TrainBatch`` is cut into the ranks' shards here, before ``ray.put``. A
        ``TrainRefs`` (the rollouts in the object store) becomes one ``ShardPlan`` per rank
        with the references of the chunks holding its groups: each rank fetches them itself
        (``data_plane.fetch_shard``), so no rollout tensor passes through this process. Both
        give every rank the same shard. ``traffic`` counts the bytes this process moves."""
        plan = self.planner.plan(self.version, batch.num_samples, batch.group_size)
        k = plan.units_per_pass
        pairs = batch.num_samples * k
        w = self.world_size
        if isinstance(batch, TrainRefs):
            plans = [batch.shard(r, w) for r in range(w)]
            sizes = [p.num_samples for p, _ in plans]
            args: list[tuple[Any, list[Any] | None]] = [(p, refs) for p, refs in plans]
            if traffic is not None:
                for p, refs in plans:
                    traffic.sent += wire_bytes(p) + REF_BYTES * len(refs)
                    traffic.learner_fetch += p.fetch_bytes
        else:  # each rank is sent only its own groups: the shards are cut before ray.put
            shards = [batch.shard(r, w) for r in range(w)]
            sizes = [s.num_samples for s in shards]
            args = [(ray.put(shard), None) for shard in shards]
        up = self.settings.update
        rows = plan.rows_per_sample(up.shrinkage, up.num_steps)
        per_rank = [backward_calls(up, n, rows) for n in sizes]
        calls = max(max(per_rank), 1)
        n = batch.num_samples
        outs = self.gather(
            [
                wk.update.remote(shard, plan.rows(*shard_bounds(n, r, w)), pairs / w, calls, refs)
                for r, (wk, (shard, refs)) in enumerate(zip(self.workers, args, strict=True))
            ],
            "update",
        )
        if traffic is not None:
            traffic.received += sum(wire_bytes(o) for o in outs)
        self.version += 1
        return reduce_rank_metrics(outs)

    def step_signal(
        self, real: list[TrainBatch], shuffled: list[TrainBatch]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The step-signal probe's Gram matrices ``[S, K, K]`` (real and shuffled advantages):
        every rank measures its shard of each probe batch (``LearnerWorker.step_signal``), the
        ranks' gradients summed before the Gram; rank 0's answer (they all hold the same)."""
        w = self.world_size
        per_rank = [
            (ray.put([b.shard(r, w) for b in real]), ray.put([b.shard(r, w) for b in shuffled]))
            for r in range(w)
        ]
        norms = [[b.num_samples for b in real], [b.num_samples for b in shuffled]]
        outs = self.gather(
            [
                wk.step_signal.remote(rs, ss, norms)
                for wk, (rs, ss) in zip(self.workers, per_rank, strict=True)
            ],
            "the step-signal probe",
        )
        return outs[0]

    def trained_bytes(self) -> int:
        """Bytes of the tensors a weight sync sends (counted on rank 0, nothing copied)."""
        return int(self.gather([self.workers[0].trained_nbytes.remote()], "a size query")[0])

    def weights_ref(self) -> ray.ObjectRef:
        """An object-store reference to the trained tensors (rank 0's; all ranks under ZeRO-3)."""
        if self.settings.learner.zero_stage == 3:
            refs = [w.trained_state.remote() for w in self.workers]
            return refs[0]
        return self.workers[0].trained_state.remote()

    def ema_ref(self) -> ray.ObjectRef:
        """An object-store reference to rank 0's EMA of the trained tensors (``train.ema_decay``;
        ``learner.ema_rank``): what evaluation and the exported policy use."""
        return self.workers[0].ema_state.remote()

    def all_ranks_state(self) -> list[dict[str, torch.Tensor]]:
        """Every rank's trained tensors (tests: ranks must hold identical weights)."""
        return ray.get([w.trained_state.remote() for w in self.workers], timeout=self.timeout_s)

    def save(self, folder: str) -> None:
        """Every rank's DeepSpeed checkpoint files under ``folder`` on the driver's machine:
        :meth:`snapshot`, then :meth:`write_snapshot`."""
        self.write_snapshot(folder, self.snapshot())

    def snapshot(self) -> list[dict[str, list[ray.ObjectRef]]]:
        """Each rank's DeepSpeed checkpoint files as object-store chunks (``LearnerWorker.save``:
        written on the rank's node, read back into the object store): host memory that the
        training no longer touches, which :meth:`write_snapshot` may write later."""
        return self.gather([w.save.remote() for w in self.workers], "a checkpoint save")

    def write_snapshot(self, folder: str, per_rank: list[dict[str, list[ray.ObjectRef]]]) -> None:
        """:meth:`snapshot`'s files under ``folder``, one chunk at a time (the driver holds at
        most one chunk in memory); a file two ranks both wrote must be identical. Safe on a
        background thread (``ray.get`` only)."""
        root = Path(folder)
        digests: dict[str, str] = {}
        for rank, files in enumerate(per_rank):
            for rel, chunks in files.items():
                h = hashlib.sha256()
                if rel in digests:
                    for c in chunks:
                        h.update(ray.get(c, timeout=self.timeout_s))
                    if h.hexdigest() != digests[rel]:
                        raise RuntimeError(
                            f"learner checkpoint: rank {rank} wrote a different {rel} than an "
                            "earlier rank"
                        )
                    continue
                dest = root / rel
                dest.parent.mkdir(parents=True, exist_ok=True)
                with dest.open("wb") as fh:
                    for c in chunks:
                        data = ray.get(c, timeout=self.timeout_s)
                        h.update(data)
                        fh.write(data)
                digests[rel] = h.hexdigest()

    def load(self, folder: str, version: int, step_generator_state: torch.Tensor) -> None:
        """Load :meth:`save`'s files from ``folder`` on the driver's machine into every rank
        (sent through the object store in chunks; each rank rebuilds them on its own node)."""
        from maskgrpo_ray.learner.worker import CHECKPOINT_CHUNK

        root = Path(folder)
        files: dict[str, list[ray.ObjectRef]] = {}
        for f in sorted(p for p in root.rglob("*") if p.is_file()):
            with f.open("rb") as fh:
                files[f.relative_to(root).as_posix()] = [
                    ray.put(chunk) for chunk in iter(lambda: fh.read(CHECKPOINT_CHUNK), b"")
                ]
        if not files:
            raise FileNotFoundError(f"learner checkpoint: no files under {root}")
        self.gather([w.load.remote(files) for w in self.workers], "a checkpoint load")
        self.version = version
        self.planner.load_state(step_generator_state)

    def gather(self, refs: list[ray.ObjectRef], during: str) -> list[Any]:
        """The results of one call per rank (``refs[r]`` from rank ``r``, or from rank 0 alone).

        Raises :class:`LearnerLost` as soon as one rank is found dead (the others may be
        blocked in a collective with it, so they are not waited for), or when the call outlives
        ``timeout_s`` (hung), or when a rank could not fetch its inputs because their objects
        are lost (a node's object store gone with it: the others wait in a collective for that
        rank, so the group is rebuilt and the run rolled back, which regenerates them). Another
        error (a bug in the update) is raised as it is.
        """
        index = {ref: rank for rank, ref in enumerate(refs)}
        pending, error = list(refs), None
        deadline = time.monotonic() + self.timeout_s
        while pending:
            left = deadline - time.monotonic()
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(left, 0.0))
            if not ready and error is not None:
                break  # one rank failed, the others hang in a collective with it: its error
            if not ready:
                raise LearnerLost(index[pending[0]], "hung", during, TimeoutError(self.timeout_s))
            try:
                ray.get(ready[0], timeout=self.timeout_s)
            except RayActorError as err:
                raise LearnerLost(index[ready[0]], "died", during, err) from err
            except GetTimeoutError as err:
                raise LearnerLost(index[ready[0]], "hung", during, err) from err
            except ObjectLostError as err:  # (a task error whose cause it is matches too)
                raise LearnerLost(index[ready[0]], "lost its inputs", during, err) from err
            except Exception as err:  # noqa: BLE001 - a rank's own error: wait for a dead peer
                error = error or err  # a peer's collective error; give the others a moment
                deadline = min(deadline, time.monotonic() + ERROR_GRACE_S)
        if error is not None:
            raise error
        return ray.get(list(refs), timeout=self.timeout_s)

    def dead_ranks(self, timeout_s: float = 30.0) -> list[int]:
        """Ranks that do not answer a ping within ``timeout_s`` (dead or hung)."""
        refs = [w.ping.remote() for w in self.workers]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        dead = []
        for rank, ref in enumerate(refs):
            try:
                if ref not in ready:
                    raise GetTimeoutError(f"rank {rank} did not answer within {timeout_s} s")
                ray.get(ref)
            except (RayActorError, GetTimeoutError):
                dead.append(rank)
        return dead

    def pids(self) -> list[int]:
        """Each rank's process id (what an operator or a fault drill signals)."""
        return [int(p) for p in self.gather([w.pid.remote() for w in self.workers], "pid")]

    def shutdown(self, graceful: bool = True) -> None:
        """Leave the process group and end the ranks; ``graceful=False`` (a rank is lost: the
        others may be stuck in a collective) only kills them."""
        if graceful:
            with contextlib.suppress(Exception):  # best effort on the way out
                ray.get([w.shutdown.remote() for w in self.workers], timeout=60)
        for w in self.workers:
            ray.kill(w)
        if self.pg is not None:
            remove_placement_group(self.pg)
