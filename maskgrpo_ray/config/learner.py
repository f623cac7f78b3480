"""The learner group's config section (``learner``): DeepSpeed ranks, ZeRO stage, precision.

Part of the one config tree (:mod:`maskgrpo_ray.config`, the import point); plain pydantic.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from maskgrpo_ray.config.base import Strict


class LearnerConfig(Strict):
    """The learner group: DeepSpeed ranks that compute the update."""

    num_workers: int = Field(1, ge=1, description="learner ranks (torch.distributed world size)")
    zero_stage: Literal[0, 1, 2, 3] = Field(0, description="DeepSpeed ZeRO stage")
    bf16: bool = Field(False, description="DeepSpeed bf16 mixed precision")
    num_cpus_per_worker: float = Field(0.5, ge=0, description="Ray CPUs reserved per learner rank")
    num_gpus_per_worker: float = Field(0.0, ge=0, description="Ray GPUs reserved per learner rank")
    custom_resources: dict[str, float] = Field(
        default_factory=dict,
        description="custom Ray resources each learner rank asks for besides CPUs and GPUs, e.g. "
        "{learner_node: 0.01}: it is then placed only on nodes that advertise them (ray_cluster.yaml's "
        "learner_gpu node type does); empty: any node",
    )
    torch_threads_per_worker: int = Field(
        0,
        ge=0,
        description=(
            "torch threads per rank; 0: on GPU torch's default; on CPU the node's cores / "
            "num_workers in the synchronous loop, and num_cpus_per_worker (at least 1) with "
            "rollout.max_policy_lag > 0, where rollouts run on the same cores during the update"
        ),
    )
    activation_checkpointing: bool = Field(
        False,
        description=(
            "recompute each transformer layer's activations in the backward pass (less memory "
            "per micro-batch, about one more forward of compute; the same gradients); a model "
            "kind without it says so in a warning"
        ),
    )
    autocast: Literal["off", "bf16"] = Field(
        "off",
        description="'bf16': the learner's forward passes under torch.autocast in bfloat16 "
        "(float32 weights, gradients, optimizer and loss; the standard mixed precision). "
        "learner.bf16 is DeepSpeed's bf16 mode instead (bf16 weights, float32 master copy)",
    )
    weight_sync: Literal["auto", "object_store", "collective"] = Field(
        "auto",
        description=(
            "learner -> rollout weights: 'object_store' (one ray.put, fetched per node), "
            "'collective' (learner rank 0 broadcasts packed buckets in a torch.distributed "
            "group with the rollout actors: NCCL on GPUs, gloo on CPUs; NCCL needs whole GPUs, "
            "one per member), 'auto': collective when the learner ranks and the rollout actors "
            "hold whole GPUs (>= 1 each) and zero_stage < 3, else the object store"
        ),
    )
    weight_sync_bucket_mb: float = Field(
        256.0, gt=0, description="collective weight sync: bytes per broadcast bucket, in MiB"
    )
