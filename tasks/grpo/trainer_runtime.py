"""What a :class:`~grpoflow.tasks.grpo.trainer.GRPOTrainer` runs with beside its config section: the runtime
objects (model, tokenizer, prompts, reward functions, generator, tracker, checkpoint folder, process group) and
the optional checkpoint hooks the stage adds for an S3 workspace."""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from grpoflow.tasks.generation.types import Generator
from grpoflow.tasks.launch.dist import Comm

if TYPE_CHECKING:  # the trainer only calls log_metrics/log_table: it runs without mlflow (benchmarks/gpu_check.py)
    from grpoflow.tasks.tracking.tracker import RunLogger


@dataclass(frozen=True)
class CheckpointHooks:
    """Called around checkpoints; all optional (a local single-process run needs none).

    on_checkpoint  after each save, with the checkpoint folder (an S3 workspace queues its upload)
    node_push      nodes with their own disks: each node but the first uploads its shards (dist_checkpoint)
    pinned         names of checkpoints never pruned yet (still queued for their upload to S3)"""

    on_checkpoint: Callable[[Path], None] | None = None
    node_push: Callable[[Path], None] | None = None
    pinned: Callable[[], Collection[str]] | None = None


@dataclass(frozen=True)
class TrainerRuntime:
    """The objects one GRPO run trains with.

    rows / prompt_ids  the training rows (TRL prompts and reward columns) and their tokenized prompts
    reward_funcs       [(name, fn)] as tasks/rewards resolves them
    ref_model          the frozen reference policy of the KL term (None: beta = 0, or the adapter-disabled base)
    autocast_dtype     full fine-tuning in bf16: float32 weights, bf16 forward passes
    comm / root        this process's rank and the module DDP/FSDP2 wrap (default: one process, PolicyLogProbs)"""

    model: Any
    tokenizer: Any
    rows: list[dict]
    prompt_ids: list[list[int]]
    reward_funcs: list
    generator: Generator
    tracker: RunLogger
    checkpoint_dir: Path
    ref_model: Any = None
    autocast_dtype: torch.dtype | None = None
    comm: Comm | None = None
    root: torch.nn.Module | None = None
    hooks: CheckpointHooks = field(default_factory=CheckpointHooks)
