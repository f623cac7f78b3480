"""LearnerWorker: one rank of the learner, a DeepSpeed engine in a Ray actor.

The ranks form a ``torch.distributed`` group (gloo on the CPU, nccl on GPUs, chosen by
DeepSpeed's accelerator) and train on whole groups of the update's batch
(``TrainBatch.shard``). Gradient averaging really happens:

* each rank's loss is the sum of its pairs' terms divided by ``M / W`` (``M`` pairs in the
  whole update, ``W`` ranks), so DeepSpeed's mean over ranks is the gradient of the global
  mean loss, exactly what the single-process trainer computes on the whole batch;
* DeepSpeed runs with ``managed_gradient_accumulation: false`` and
  ``gradient_accumulation_steps: 1``: ``engine.backward`` only accumulates the micro-batches'
  gradients locally (no 1/GAS scaling), and ``engine.step`` is the one boundary that reduces
  across ranks, clips (``train.grad_clip_norm``) and steps the optimizer;
* every rank calls ``engine.backward`` the same number of times (ranks with fewer micro-batches
  add zero-loss backwards), since ZeRO stage 2/3 reduce inside every backward;
* ZeRO stage 2/3 (:class:`DeepSpeedOptimizing`): the reduction buckets are filled in the order
  the gradient hooks fire, so a zero-loss backward replays a real micro-batch's graph (a
  different graph would pair different parameters' gradients in the reduction), and before
  each backward the ZeRO optimizer is told a new micro-step begins (what ``engine.forward``
  does; the policy's forward is called directly), else ZeRO-3 overwrites the accumulated
  gradient partitions instead of adding to them (docs/ray_system.md, "Learner gradients").
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import ray
import torch

from maskgrpo_ray.actors.base import ActorProcess, outlive_sigterm
from maskgrpo_ray.cluster.attach import apply_env_defaults
from maskgrpo_ray.cluster.weight_transfer import (
    Channel,
    TensorMeta,
    is_loopback,
    open_store,
    tensor_metas,
)
from maskgrpo_ray.config import ModelConfig
from maskgrpo_ray.errors import UserError
from maskgrpo_ray.learner.ema_rank import EmaRank
from maskgrpo_ray.loop.step_signal_probe import rng_kept, step_grams
from maskgrpo_ray.models.base import MaskedImagePolicy
from maskgrpo_ray.pipeline.build import build_policy, resolve_device
from maskgrpo_ray.pipeline.data_plane import ShardPlan, fetch_shard
from maskgrpo_ray.pipeline.learner_core import (
    UpdatePlan,
    apply_activation_checkpointing,
    apply_update,
    build_optimizer,
    grad_norm_and_clip,
    reference_policy,
    set_learning_rate,
)
from maskgrpo_ray.pipeline.messages import TrainBatch
from maskgrpo_ray.pipeline.settings import LearnerSettings, UpdateSettings
from maskgrpo_ray.weights.safe_files import deepspeed_accelerator

log = logging.getLogger(__name__)

CHECKPOINT_CHUNK = 64 << 20  # bytes per object-store chunk of a checkpoint file


def skip_shm_comm_build() -> None:
    """Tell DeepSpeed not to JIT-build its shared-memory all-reduce op (``deepspeed_shm_comm``).

    On the CPU accelerator ``deepspeed.initialize`` g++-builds that op at every first start (30 s
    idle, minutes on loaded cores) under a ``torch.utils.file_baton`` lock; a rank killed while
    it holds the lock leaves the file behind, and every later learner start on the machine waits
    on it forever. The op serves only ``inference_all_reduce``: training reduces through
    ``torch.distributed`` (gloo here, nccl on GPUs), so nothing this learner computes changes.
    DeepSpeed keeps the probed table in its module so that edits persist; on a GPU accelerator
    the builder does not exist and this changes nothing.
    """
    import deepspeed.ops

    table = deepspeed.ops.__compatible_ops__
    if table.get("deepspeed_shm_comm"):
        table["deepspeed_shm_comm"] = False
        log.info("DeepSpeed's shm_comm op (inference all-reduce only) is not built: not used")


def clips_in_hook(learner: LearnerSettings) -> bool:
    """Plain fp32 data parallel (ZeRO stage 0): we clip in an optimizer pre-step hook, where
    the gradients are already averaged, so the pre-clip norm can be reported as DeepSpeed does
    for ZeRO (``engine.get_global_grad_norm``) and the single-process trainer does."""
    return learner.zero_stage == 0 and not learner.bf16


def deepspeed_config(update: UpdateSettings, learner: LearnerSettings) -> dict[str, Any]:
    """The DeepSpeed config of the learner (ZeRO stage, bf16, clipping from our settings)."""
    clip = 0.0 if clips_in_hook(learner) else update.grad_clip_norm
    return {
        "train_micro_batch_size_per_gpu": update.micro_batch_pairs,
        "gradient_accumulation_steps": 1,
        "managed_gradient_accumulation": False,
        "gradient_clipping": clip,
        "zero_optimization": {"stage": learner.zero_stage},
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": learner.bf16},
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


def auto_threads(learner: LearnerSettings, world_size: int, cores: int, device: str) -> int:
    """A rank's torch threads (0: leave torch's default). ``torch_threads_per_worker`` when
    set; on GPU torch's default. On CPU in the synchronous loop the rollout actors wait while
    the learner works, so the ranks share the node's cores; with asynchronous rollouts
    (``rollout.max_policy_lag`` > 0) they generate during the update on the same cores, so a
    rank keeps to the CPUs Ray reserved for it (``learner.num_cpus_per_worker``, at least 1)
    instead of oversubscribing them (docs/ray_system.md, "Benchmark")."""
    if learner.torch_threads_per_worker > 0:
        return learner.torch_threads_per_worker
    if device != "cpu":
        return 0
    if learner.overlapped:
        return max(1, int(learner.num_cpus_per_worker))
    return max(1, cores // world_size)


class DeepSpeedOptimizing:
    """The learner-rank backend of ``learner_core.apply_update``: a DeepSpeed engine.

    ``engine.backward`` only accumulates locally; ``engine.step`` reduces across ranks, clips
    and steps (ZeRO stage 0 fp32: clipping happens in an optimizer pre-step hook, after the
    reduction, which records the pre-clip norm).
    """

    def __init__(self, engine: Any, worker: LearnerWorker) -> None:
        self.engine, self.worker = engine, worker
        self.module: MaskedImagePolicy = engine.module
        self.reduces_in_backward = worker.learner.zero_stage >= 2
        # ZeRO-3 gathers each layer's parameters inside its forward: a collective
        self.collective_forward = worker.learner.zero_stage == 3

    def set_learning_rate(self, lr: float) -> None:
        set_learning_rate(self.engine.optimizer, lr)

    def zero_grad(self) -> None:
        pass  # engine.step zeroes the gradients it reduced

    def backward(self, loss: torch.Tensor) -> None:
        self._begin_micro_step()
        self.engine.backward(loss)

    def pad_backward(self, replay: Callable[[], torch.Tensor | None]) -> None:
        """A zero-loss backward. ZeRO-2/3 reduce in it, bucketing gradients in hook order: it
        replays a real micro-batch's graph (``replay``), so every rank fills its buckets in the
        same order. Stage 0/1 reduce once in ``engine.step``: a sum over the trained parameters
        does (no forward)."""
        loss = replay() if self.reduces_in_backward else None
        if loss is None:
            if self.reduces_in_backward:
                log.warning(
                    "learner rank %d: an empty shard pads ZeRO-%d backwards without a real "
                    "graph; the update may pair gradients of different parameters",
                    self.worker.rank,
                    self.worker.learner.zero_stage,
                )
            params = [p for p in self.module.parameters() if p.requires_grad]
            loss = sum((p * 0).sum() for p in params)  # type: ignore[assignment]
        self._begin_micro_step()
        self.engine.backward(loss)

    def _begin_micro_step(self) -> None:
        """ZeRO-2/3: what ``engine.forward`` does first (the policy's forward is called
        directly): the ZeRO optimizer's per-backward state is reset and ZeRO-3 counts a new
        micro-step, so this backward's gradient partitions add to the earlier ones."""
        if self.reduces_in_backward:
            self.engine.optimizer.clear_backward_seen_flag()

    def step(self) -> float | None:
        self.engine.step()
        if clips_in_hook(self.worker.learner):
            return self.worker.hook_norm
        norm = self.engine.get_global_grad_norm()
        return None if norm is None else float(norm)


class LearnerWorker(ActorProcess, EmaRank):
    """Rank ``rank`` of ``world_size``. ``setup`` joins the process group and builds DeepSpeed."""

    def __init__(
        self,
        model: ModelConfig,
        update: UpdateSettings,
        learner: LearnerSettings,
        rank: int,
        world_size: int,
    ) -> None:
        outlive_sigterm()  # the driver's checkpoint after a SIGTERM needs this rank
        apply_env_defaults()
        self.update_settings, self.learner = update, learner
        self.rank, self.world_size = rank, world_size
        self.device = resolve_device(learner.num_gpus_per_worker)
        threads = auto_threads(learner, world_size, os.cpu_count() or 1, self.device.type)
        if threads > 0:
            torch.set_num_threads(threads)
        try:
            self.policy = build_policy(model, self.device)
        except UserError as err:  # raised from ready(): one line in the driver
            self.init_error = err
            return
        apply_activation_checkpointing(self.policy, learner.activation_checkpointing, model.kind)
        self.ref_policy = reference_policy(update, self.policy)
        self.engine: Any = None
        self.hook_norm: float | None = None
        self._sync_store: Any = None  # collective weight sync (rank 0): the group's store
        self._sync: Any = None

    def address(self) -> tuple[str, int]:
        """(this node's IP, a port): rank 0's is the rendezvous of the group.

        The port's socket stays open and listening: rank 0's ``TCPStore`` takes it over
        (``master_listen_fd``), so on a loopback cluster the store listens on 127.0.0.1 only
        (by default it would bind every interface).
        """
        import socket

        ip = ray.util.get_node_ip_address()
        self._listen = socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET)
        self._listen.bind((ip, 0))
        self._listen.listen(128)
        return ip, int(self._listen.getsockname()[1])

    def _init_process_group(self, master_addr: str, master_port: int) -> None:
        """gloo on the CPU, nccl on GPUs; loopback-only sockets on a loopback cluster."""
        from datetime import timedelta

        import torch.distributed as dist

        if is_loopback(master_addr):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        listen = getattr(self, "_listen", None) if self.rank == 0 else None
        store = dist.TCPStore(
            master_addr,
            master_port,
            self.world_size,
            self.rank == 0,
            timeout=timedelta(seconds=300),
            master_listen_fd=None if listen is None else listen.fileno(),
        )
        cuda = self.device.type == "cuda"
        # on CUDA the rank's device is named: without it NCCL guesses it from the global rank
        # ("can cause a hang if rank to GPU mapping is heterogeneous", seen on an H100)
        dist.init_process_group(
            "nccl" if cuda else "gloo",
            store=store,
            rank=self.rank,
            world_size=self.world_size,
            device_id=self.device if cuda else None,
        )

    def setup(
        self, master_addr: str, master_port: int, initial: dict[str, torch.Tensor] | None = None
    ) -> int:
        """Join the group and build the engine (from ``initial``'s weights when given: a
        learner restarted without a checkpoint; the KL reference stays the base model); returns
        the number of trained parameters."""
        with deepspeed_accelerator(self.device.type):  # DeepSpeed on this rank's device
            import deepspeed

        if initial is not None:
            self.policy.load_state_dict(initial, strict=False)

        skip_shm_comm_build()
        env = {
            "RANK": self.rank,
            "WORLD_SIZE": self.world_size,
            "LOCAL_RANK": 0,
            "MASTER_ADDR": master_addr,
            "MASTER_PORT": master_port,
        }
        os.environ.update({k: str(v) for k, v in env.items()})  # LOCAL_RANK 0: Ray gives
        self._init_process_group(master_addr, master_port)  # each worker its own GPU
        optimizer = build_optimizer(self.update_settings, self.policy)
        if clips_in_hook(self.learner):
            optimizer.register_step_pre_hook(self._clip_hook)
        self.engine, _, _, _ = deepspeed.initialize(
            model=self.policy,
            optimizer=optimizer,
            config=deepspeed_config(self.update_settings, self.learner),
        )
        self.optimizing = DeepSpeedOptimizing(self.engine, self)
        self.start_ema()  # rank 0, train.ema_decay > 0 (learner.ema_rank)
        return sum(p.numel() for p in self.policy.parameters() if p.requires_grad)

    def _clip_hook(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Before the optimizer step (gradients averaged over ranks): record the norm, clip."""
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        self.hook_norm = grad_norm_and_clip(params, self.update_settings.grad_clip_norm)

    def update(
        self,
        shard: TrainBatch | ShardPlan,
        plan: UpdatePlan,
        normalizer: float,
        num_backward: int,
        chunks: list[ray.ObjectRef] | None = None,
    ) -> dict[str, float]:
        """``learner_core.apply_update`` on this rank's shard of the update's batch.

        Args:
            shard: this rank's groups (``TrainBatch.shard(rank, world)``, cut by the group),
                or its ``data_plane.ShardPlan``: the shard is then built here from ``chunks``,
                the references of the rollout chunks holding its groups, fetched by this rank.
            plan: the trained unmasking steps and the learning rate (same on every rank).
            normalizer: ``M / W``, pairs of the whole update per rank.
            num_backward: backward calls per optimizer step on every rank (the most any rank
                needs); this rank pads with zero-loss backwards.
            chunks: with a ``ShardPlan``, the chunk references (not resolved by Ray: a list).
        """
        if isinstance(shard, ShardPlan):
            assert chunks is not None, "a ShardPlan comes with its chunk references"
            shard = fetch_shard(shard, chunks)
        return apply_update(
            self.optimizing,
            shard,
            plan,
            self.update_settings,
            ref_policy=self.ref_policy,
            normalizer=normalizer,
            num_backward=num_backward,
            ema=self.ema,
        )

    def step_signal(
        self, real: list[TrainBatch], shuffled: list[TrainBatch], normalizers: list[list[int]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of the step-signal probe: the per-step gradients of its shards of
        the probe batches (divided by each whole batch's samples, ``normalizers``), summed
        over the ranks (``all_reduce``), as Gram matrices ``[S, K, K]`` (real, shuffled).
        Taken on the engine's module outside the engine (ZeRO stage 0 or 1: the config refuses
        2 and 3), its gradients restored after; every rank calls it."""
        import torch.distributed as dist

        def reduce(v: torch.Tensor) -> None:
            if self.world_size > 1:
                dist.all_reduce(v)

        steps, s = int(real[0].old_logp.shape[1]), self.update_settings
        module = self.engine.module
        with rng_kept(module):
            g_real = step_grams(module, real, steps, s, normalizers=normalizers[0], reduce=reduce)
            g_shuf = step_grams(
                module, shuffled, steps, s, normalizers=normalizers[1], reduce=reduce
            )
        return g_real, g_shuf

    def save(self) -> dict[str, list[ray.ObjectRef]]:
        """DeepSpeed checkpoint (weights, optimizer, ZeRO partitions; rank 0: the EMA) as object
        store chunks: ``{relative path: [chunk refs]}``. Every rank calls it. The files are
        written to a temporary folder on this rank's node and removed; the chunks reach the
        driver through the object store, so no filesystem has to be shared between nodes."""
        import tempfile
        from pathlib import Path

        with tempfile.TemporaryDirectory(prefix="maskgrpo-learner-") as tmp:
            self.engine.save_checkpoint(tmp, tag="learner")
            self.save_ema(Path(tmp))
            out: dict[str, list[ray.ObjectRef]] = {}
            for f in sorted(p for p in Path(tmp).rglob("*") if p.is_file()):
                with f.open("rb") as fh:
                    out[f.relative_to(tmp).as_posix()] = [
                        ray.put(chunk) for chunk in iter(lambda: fh.read(CHECKPOINT_CHUNK), b"")
                    ]
        return out

    def load(self, files: dict[str, list[ray.ObjectRef]]) -> None:
        """Load the checkpoint whose files :meth:`save` (of all ranks) returned, rebuilt in a
        temporary folder on this rank's node; every rank calls it."""
        import tempfile
        from pathlib import Path

        with tempfile.TemporaryDirectory(prefix="maskgrpo-learner-") as tmp:
            for rel, chunks in files.items():
                dest = Path(tmp) / rel
                dest.parent.mkdir(parents=True, exist_ok=True)
                with dest.open("wb") as fh:
                    for ref in chunks:
                        fh.write(ray.get(ref))
            self.engine.load_checkpoint(tmp, tag="learner")
            self.load_ema(Path(tmp))
        self.engine.module.eval()

    def trained_nbytes(self) -> int:
        """Bytes of :meth:`trained_state` (float32 under ZeRO-3, else the parameters' dtype)."""
        params = [p for p in self.engine.module.parameters() if p.requires_grad]
        if self.learner.zero_stage == 3:
            return sum(4 * int(getattr(p, "ds_numel", p.numel())) for p in params)
        return sum(p.numel() * p.element_size() for p in params)

    def trained_state(self) -> dict[str, torch.Tensor]:
        """The tensors rollout actors need (parameters that train), on the CPU, detached.

        ZeRO stage 3 partitions parameters: every rank must call this (it gathers).
        """
        module = self.engine.module
        params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if self.learner.zero_stage == 3:
            import deepspeed

            with deepspeed.zero.GatheredParameters([p for _, p in params]):
                return {n: p.detach().float().cpu().clone() for n, p in params}
        return {n: p.detach().cpu().clone() for n, p in params}

    def _trained_params(self) -> dict[str, torch.Tensor]:
        module = self.engine.module
        return {n: p.detach() for n, p in module.named_parameters() if p.requires_grad}

    def sync_open(self, timeout_s: float) -> tuple[str, int, list[TensorMeta]]:
        """Rank 0: a store for a new weight-sync group, and the trained tensors' metas."""
        ip = ray.util.get_node_ip_address()
        self._sync_store = open_store(ip, timeout_s)
        return ip, int(self._sync_store.port), tensor_metas(self._trained_params())

    def sync_connect(
        self, world: int, metas: list[TensorMeta], bucket_bytes: int, timeout_s: float
    ) -> None:
        """Rank 0 joins the group :meth:`sync_open` started (blocks until every member has);
        an earlier group is closed first."""
        if self._sync is not None:
            self._sync.close()
        self._sync = Channel(
            "", 0, 0, world, self.device, metas, bucket_bytes, timeout_s, store=self._sync_store
        )

    def sync_send(self) -> int:
        """Broadcast the trained tensors to the group's rollout actors; bytes sent."""
        return self._sync.send(self._trained_params())

    def ping(self) -> int:
        return self.rank

    def shutdown(self) -> None:
        """Leave the process group cleanly (a barrier first, or gloo may abort)."""
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


RemoteLearnerWorker = ray.remote(LearnerWorker)
