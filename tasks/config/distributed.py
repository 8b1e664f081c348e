"""The ``distributed`` section: GRPO on several processes with torch.distributed, launched by torchrun.

``nproc_per_node: 1`` (the default) is today's single process: nothing is launched, no process group exists.
With more, the GRPO stage runs ``torchrun --standalone --nproc_per_node=N -m grpoflow.tasks.stages.grpo_worker``
(or, with ``nnodes > 1``, torchrun's rendezvous settings below) and every process trains its share of each
generation round as in TRL, where the world size is ``num_processes`` (docs/distributed.md).

``launcher: trainjob`` runs the same torchrun command on ``nnodes`` Kubernetes pods instead: the stage creates a
Kubeflow Trainer ``TrainJob`` (runtime ``torch-distributed``, which sets the PET_* variables torchrun reads) from
``trainjob.template`` and waits for it (tasks/launch/trainjob.py, tasks/stages/grpo_trainjob.py).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from grpoflow.tasks.config.base import _Section


class TrainJobConfig(_Section):
    """``distributed.trainjob``: the Kubeflow Trainer TrainJob that ``launcher: trainjob`` creates."""

    template: str = Field(
        "infra/kubeflow/trainjob.yaml",
        description="The TrainJob manifest the stage fills in (name, image, command, nodes, GPUs); a path relative "
        "to the working directory (/app in the grpoflow images).",
    )
    namespace: str = Field(
        "grpoflow", min_length=1, description="Namespace of the TrainJob (its Secrets and Services live there)."
    )
    image: str = Field("grpoflow:0.1.0-gpu", min_length=1, description="Image of every node's container.")
    runtime: str = Field(
        "torch-distributed",
        min_length=1,
        description="The ClusterTrainingRuntime (spec.runtimeRef.name) whose torch policy sets PET_NNODES, "
        "PET_NPROC_PER_NODE, PET_NODE_RANK, PET_MASTER_ADDR and PET_MASTER_PORT.",
    )
    python: str = Field(
        "python", min_length=1, description="The Python interpreter in the image that runs torchrun (python -m)."
    )
    gpus_per_node: int | None = Field(
        None,
        ge=0,
        description="nvidia.com/gpu limit of each node's container; default nproc_per_node (one GPU per process); "
        "0 = none (gloo on CPU).",
    )
    timeout_s: float = Field(
        86400.0, gt=0, description="Bound on the whole TrainJob: past it the stage deletes the TrainJob and fails."
    )
    poll_s: float = Field(10.0, gt=0, description="Seconds between two reads of the TrainJob's status.")
    log_lines: int = Field(
        50, ge=0, description="Last lines of a failed node's log shown in the stage error (0: none)."
    )
    delete_on_success: bool = Field(
        False, description="Delete the TrainJob (and its pods) once it completed; a failed one is always kept."
    )


class DistributedConfig(_Section):
    """The ``distributed`` section: GRPO on several processes (torchrun on this node or several, or the nodes of a
    Kubeflow Trainer TrainJob). One process, the default, launches nothing."""

    nproc_per_node: int = Field(
        1,
        ge=1,
        description="Processes (one per GPU, or CPU processes with gloo) on this node; 1 = one process, no torchrun.",
    )
    strategy: Literal["ddp", "fsdp2"] = Field(
        "ddp",
        description="ddp: every process holds the whole model, gradients are averaged (DistributedDataParallel); "
        "fsdp2: parameters, gradients and optimizer state sharded per decoder layer (torch fully_shard); with "
        "model.dtype bfloat16 and full fine-tuning, bf16 compute over float32 shards with float32 gradient reduction "
        "(MixedPrecisionPolicy). Not with model.load_in_4bit or a bitsandbytes grpo.optim (adamw_8bit, "
        "paged_adamw_8bit).",
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
    launcher: Literal["torchrun", "trainjob"] = Field(
        "torchrun",
        description="torchrun: the stage runs torchrun here (nproc_per_node > 1 or nnodes > 1); trainjob: the stage "
        "creates a Kubeflow Trainer TrainJob of nnodes pods that each run the same torchrun command (needs an "
        "s3:// run.output_dir), waits for it and fails with its error.",
    )
    trainjob: TrainJobConfig = Field(
        default_factory=TrainJobConfig, description="The TrainJob of launcher: trainjob (see TrainJobConfig)."
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
        if self.launcher == "torchrun" and self.trainjob != TrainJobConfig():  # defaults: a config round trip
            raise ValueError("distributed.trainjob is set but distributed.launcher is torchrun: set launcher: trainjob")
        if self.launcher == "trainjob":
            set_by_hand = [k for k in ("node_rank", "rdzv_endpoint", "master_addr", "master_port") if getattr(self, k)]
            if set_by_hand:
                raise ValueError(
                    f"distributed.{', '.join(set_by_hand)} with launcher: trainjob: the torch-distributed runtime sets "
                    "each pod's PET_NODE_RANK, PET_MASTER_ADDR and PET_MASTER_PORT; leave them unset"
                )
        return self

    @property
    def gpus_per_node(self) -> int:
        """nvidia.com/gpu of each TrainJob node: ``trainjob.gpus_per_node``, default one per process."""
        g = self.trainjob.gpus_per_node
        return self.nproc_per_node if g is None else g

    @property
    def world_size(self) -> int:
        """Processes in all: nproc_per_node * nnodes (TRL's num_processes)."""
        return self.nproc_per_node * self.nnodes

    @property
    def row_seeded(self) -> bool:
        """Whether completions are sampled with per-row generators (``seed_by_row``, resolved)."""
        return self.world_size > 1 if self.seed_by_row is None else self.seed_by_row
