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
  add zero-loss backwards), since ZeRO stage 2/3 reduce inside every backward.
"""

from __future__ import annotations

import copy
import logging
import os
from typing import Any

import ray
import torch

from maskgrpo_ray.build import build_optimizer, build_policy, loss_guards, resolve_device
from maskgrpo_ray.config import Config
from maskgrpo_ray.phases import accumulate_gradients
from maskgrpo_ray.ray_cluster import apply_env_defaults
from maskgrpo_ray.types import TrainBatch

log = logging.getLogger(__name__)


def clips_in_hook(cfg: Config) -> bool:
    """Plain fp32 data parallel (ZeRO stage 0): we clip in an optimizer pre-step hook, where
    the gradients are already averaged, so the pre-clip norm can be reported as DeepSpeed does
    for ZeRO (``engine.get_global_grad_norm``) and the single-process trainer does."""
    return cfg.learner.zero_stage == 0 and not cfg.learner.bf16


def deepspeed_config(cfg: Config) -> dict[str, Any]:
    """The DeepSpeed config of the learner (ZeRO stage, bf16, clipping from our config)."""
    clip = 0.0 if clips_in_hook(cfg) else cfg.train.grad_clip_norm
    return {
        "train_micro_batch_size_per_gpu": cfg.train.micro_batch_pairs_per_gpu,
        "gradient_accumulation_steps": 1,
        "managed_gradient_accumulation": False,
        "gradient_clipping": clip,
        "zero_optimization": {"stage": cfg.learner.zero_stage},
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": cfg.learner.bf16},
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


def is_loopback(host: str) -> bool:
    return host.startswith("127.") or host in ("::1", "localhost")


class LearnerWorker:
    """Rank ``rank`` of ``world_size``. ``setup`` joins the process group and builds DeepSpeed."""

    def __init__(self, cfg: Config, rank: int, world_size: int) -> None:
        apply_env_defaults()
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.device = resolve_device(cfg.learner.num_gpus_per_worker)
        threads = cfg.learner.torch_threads_per_worker
        if threads == 0 and self.device.type == "cpu":
            # the step loop is synchronous: while the learner works, rollouts wait
            threads = max(1, (os.cpu_count() or 1) // world_size)
        if threads > 0:
            torch.set_num_threads(threads)
        self.policy = build_policy(cfg, self.device)
        self.ref_policy = None
        if cfg.train.kl_coef > 0:
            self.ref_policy = copy.deepcopy(self.policy).eval().requires_grad_(False)
        self.engine: Any = None

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
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=store, rank=self.rank, world_size=self.world_size)

    def setup(self, master_addr: str, master_port: int) -> int:
        """Join the group and build the engine; returns the number of trained parameters."""
        import deepspeed

        env = {
            "RANK": self.rank,
            "WORLD_SIZE": self.world_size,
            "LOCAL_RANK": 0,
            "MASTER_ADDR": master_addr,
            "MASTER_PORT": master_port,
        }
        os.environ.update({k: str(v) for k, v in env.items()})  # LOCAL_RANK 0: Ray gives
        self._init_process_group(master_addr, master_port)  # each worker its own GPU
        optimizer = build_optimizer(self.cfg, self.policy)
        self._hook_norm: float | None = None
        if clips_in_hook(self.cfg):
            optimizer.register_step_pre_hook(self._clip_hook)
        self.engine, _, _, _ = deepspeed.initialize(
            model=self.policy, optimizer=optimizer, config=deepspeed_config(self.cfg)
        )
        return sum(p.numel() for p in self.policy.parameters() if p.requires_grad)

    def _clip_hook(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Before the optimizer step (gradients averaged over ranks): record the norm, clip."""
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        c = self.cfg.train.grad_clip_norm
        if c > 0:
            self._hook_norm = float(torch.nn.utils.clip_grad_norm_(params, c))
        else:
            self._hook_norm = float(torch.nn.utils.get_total_norm([p.grad for p in params]))

    def _zero_backward(self) -> None:
        params = [p for p in self.engine.module.parameters() if p.requires_grad]
        self.engine.backward(sum((p * 0).sum() for p in params))

    def update(
        self,
        batch: TrainBatch,
        train_steps: torch.Tensor,
        normalizer: float,
        num_backward: int,
        learning_rate: float,
    ) -> dict[str, float]:
        """``train.updates_per_batch`` optimizer steps on this rank's shard of ``batch``.

        Args:
            batch: the whole update's batch (every rank takes its own groups).
            train_steps: long ``[K]`` unmasking steps trained (same on every rank).
            normalizer: ``M / W``, pairs of the whole update per rank.
            num_backward: backward calls per optimizer step on every rank (the most any rank
                needs); this rank pads with zero-loss backwards.
        """
        shard = batch.shard(self.rank, self.world_size)
        for group in self.engine.optimizer.param_groups:
            group["lr"] = learning_rate
        t = self.cfg.train
        self.engine.module.train()
        metrics: dict[str, float] = {}
        calls = [0]

        def backward(loss: torch.Tensor) -> None:
            calls[0] += 1
            self.engine.backward(loss)

        first: dict[str, float] = {}
        for i in range(t.updates_per_batch):
            calls[0] = 0
            metrics = accumulate_gradients(
                self.engine.module,
                shard,
                train_steps=train_steps,
                micro_batch=t.micro_batch_pairs_per_gpu,
                clip_low=t.clip_low,
                clip_high=t.clip_high,
                kl_coef=t.kl_coef,
                ref_policy=self.ref_policy,
                backward=backward,
                normalizer=normalizer,
                guards=loss_guards(self.cfg),
            )
            if i == 0:  # the spread of |log-ratio| before this batch's first optimizer step
                first = {k: v for k, v in metrics.items() if k.startswith("abs_log_ratio")}
            for _ in range(num_backward - calls[0]):
                self._zero_backward()
            self.engine.step()
            norm = (
                self._hook_norm if clips_in_hook(self.cfg) else self.engine.get_global_grad_norm()
            )
            if norm is not None:
                metrics["grad_norm"] = float(norm)
        self.engine.module.eval()
        return {**metrics, **first}

    def save(self, folder: str) -> None:
        """DeepSpeed checkpoint (weights, optimizer, ZeRO partitions); every rank calls it."""
        self.engine.save_checkpoint(folder, tag="learner")

    def load(self, folder: str) -> None:
        self.engine.load_checkpoint(folder, tag="learner")
        self.engine.module.eval()

    def trained_state(self) -> dict[str, torch.Tensor]:
        """The tensors rollout actors need (parameters that train), on the CPU, detached.

        ZeRO stage 3 partitions parameters: every rank must call this (it gathers).
        """
        module = self.engine.module
        params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if self.cfg.learner.zero_stage == 3:
            import deepspeed

            with deepspeed.zero.GatheredParameters([p for _, p in params]):
                return {n: p.detach().float().cpu().clone() for n, p in params}
        return {n: p.detach().cpu().clone() for n, p in params}

    def shutdown(self) -> None:
        """Leave the process group cleanly (a barrier first, or gloo may abort)."""
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


RemoteLearnerWorker = ray.remote(LearnerWorker)
