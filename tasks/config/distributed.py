"""The ``distributed`` section: GRPO on several processes with torch.distributed, launched by torchrun.

``nproc_per_node: 1`` (the default) is today's single process: nothing is launched, no process group exists.
With more, the GRPO stage runs ``torchrun --standalone --nproc_per_node=N -m grpoflow.tasks.stages.grpo_worker``
(or, with ``nnodes > 1``, torchrun's rendezvous settings below) and every process trains its share of each
generation round as in TRL, where the world size is ``num_processes`` (README "Distributed").
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from grpoflow.tasks.config.base import _Section


class DistributedConfig(_Section):
    nproc_per_node: int = Field(
        1,
        ge=1,
        description="Processes (one per GPU, or CPU processes with gloo) on this node; 1 = one process, no torchrun.",
    )
    strategy: Literal["ddp", "fsdp2"] = Field(
        "ddp",
        description="ddp: every process holds the whole model, gradients are averaged (DistributedDataParallel); "
        "fsdp2: parameters, gradients and optimizer state sharded per decoder layer (torch fully_shard).",
    )
    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="Collective backend: auto = nccl when the processes run on CUDA, else gloo."
    )
    timeout_s: float = Field(
        300.0,
        gt=0,
        description="Bound on one collective (process-group timeout): a rank that dies or hangs fails the stage "
        "after this long instead of blocking the others forever.",
    )
    seed_by_row: bool | None = Field(
        None,
        description="Sample each completion with a generator seeded by (run.seed, round, its row in the round), so "
        "completions do not depend on the world size or on which process drew them. Default: on when the world "
        "size is > 1; set true on one process to reproduce a distributed run's completions.",
    )
    nnodes: int = Field(1, ge=1, description="Nodes (torchrun --nnodes; Kubeflow Trainer sets PET_NNODES).")
    node_rank: int | None = Field(
        None, ge=0, description="This node's rank (torchrun --node_rank; default: torchrun's, e.g. PET_NODE_RANK)."
    )
    rdzv_endpoint: str | None = Field(
        None, description="host:port of the c10d rendezvous for nnodes > 1 (torchrun --rdzv_endpoint)."
    )
    master_addr: str | None = Field(
        None, description="Static rendezvous host for nnodes > 1 (torchrun --master_addr; PET_MASTER_ADDR)."
    )
    master_port: int | None = Field(
        None, ge=1, le=65535, description="Static rendezvous port (torchrun --master_port; PET_MASTER_PORT)."
    )

    @model_validator(mode="after")
    def _nodes(self) -> DistributedConfig:
        if self.node_rank is not None and self.node_rank >= self.nnodes:
            raise ValueError(f"node_rank ({self.node_rank}) must be less than nnodes ({self.nnodes})")
        if self.rdzv_endpoint is not None and self.master_addr is not None:
            raise ValueError("rdzv_endpoint and master_addr are two ways to meet: set one")
        if self.nnodes == 1 and (self.rdzv_endpoint or self.master_addr or self.node_rank):
            raise ValueError(
                "rdzv_endpoint, master_addr and node_rank are for nnodes > 1 (one node runs torchrun --standalone)"
            )
        return self

    @property
    def world_size(self) -> int:
        """Processes in all: nproc_per_node * nnodes (TRL's num_processes)."""
        return self.nproc_per_node * self.nnodes

    @property
    def row_seeded(self) -> bool:
        """Whether completions are sampled with per-row generators (``seed_by_row``, resolved)."""
        return self.world_size > 1 if self.seed_by_row is None else self.seed_by_row
