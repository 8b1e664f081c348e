"""FSDP2 under gradient accumulation, the runs test_fsdp2_accumulation.py compares: a tiny model, full fine-tuning,
4 micro-steps per optimizer step, trained for 2 SGD steps and measured after every micro-step's backward. Run in the
test's process (one process) and on 2 ranks by ONE torchrun launch (gloo):

    python -m torch.distributed.run --standalone --nproc_per_node=2 -m tests.tasks.grpo.fsdp2_accumulation_cases OUT

On 2 ranks it trains twice: with the trainer's gradient_sync ("sharded": a reduce-scatter every micro-step into the
sharded gradient) and with FSDP2's set_requires_gradient_sync(False) on the non-final micro-steps ("no_sync", what
gradient_sync did before), the control that shows the measurement sees the unsharded gradients FSDP2 keeps.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import torch

import grpoflow.tasks.grpo.trainer as trainer_module
from grpoflow.tasks.config import GRPOConfig
from grpoflow.tasks.grpo.batch import PolicyLogProbs
from grpoflow.tasks.grpo.distributed import wrap_root
from grpoflow.tasks.launch.dist import Comm, process_group
from grpoflow.tasks.model.optim import build_scheduler
from tests.tasks.grpo.distributed_cases import record
from tests.tasks.grpo.test_trainer import make, make_trainer

MICRO_STEPS = 4  # per optimizer step
ROWS_PER_ROUND = 16  # per_device_train_batch_size (4 on 1 process, 2 on 2) * processes * MICRO_STEPS


def held_grad_bytes(root: torch.nn.Module) -> int:
    """Bytes of gradient this rank holds for ``root``'s parameters: each parameter's ``.grad`` (FSDP2: the local shard
    of its DTensor gradient), plus what FSDP2 keeps outside ``.grad`` between micro-steps without gradient sync (the
    unsharded gradient, or its upcast copy ``unsharded_accumulated_grad``)."""
    from torch.distributed.fsdp import FSDPModule

    def nbytes(t: torch.Tensor | None) -> int:
        if t is None:
            return 0
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()

    total = sum(nbytes(p.grad) for p in root.parameters())
    for module in root.modules():
        if isinstance(module, FSDPModule):
            for group in module._get_fsdp_state()._fsdp_param_groups:
                for fp in group.fsdp_params:
                    unsharded = getattr(fp, "_unsharded_param", None)
                    total += nbytes(fp.unsharded_accumulated_grad) + nbytes(getattr(unsharded, "grad", None))
    return total


@contextlib.contextmanager
def fsdp2_no_sync_between_micro_steps():
    """Inside: the trainer's gradient_sync as it was, set_requires_gradient_sync(False) on FSDP2's non-final
    micro-steps (the control run)."""

    @contextlib.contextmanager
    def no_sync(root, enabled):
        if not enabled and hasattr(root, "set_requires_gradient_sync"):
            root.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                root.set_requires_gradient_sync(True)
        else:
            yield

    saved = trainer_module.gradient_sync
    trainer_module.gradient_sync = no_sync
    try:
        yield
    finally:
        trainer_module.gradient_sync = saved


def run(comm: Comm, strategy: str = "fsdp2") -> dict:
    """Two SGD steps of 4 micro-steps each over one round; the weights after each step and, per micro-step, the
    gradient bytes this rank holds after its backward, with the model's total (unsharded) parameter bytes."""
    torch.manual_seed(0)
    tok, model = make(lora=False)
    total_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    cfg = GRPOConfig.model_validate(
        dict(
            max_steps=2,
            per_device_train_batch_size=ROWS_PER_ROUND // MICRO_STEPS // comm.world,
            steps_per_generation=MICRO_STEPS,
            gradient_accumulation_steps=MICRO_STEPS,
            num_iterations=2,
            num_generations=4,
            max_completion_length=8,
            learning_rate=0.5,
            max_grad_norm=None,
            save_steps=100,
        ),
        context={"num_processes": comm.world},
    )
    root = wrap_root(PolicyLogProbs(model), comm, strategy)
    trainer = make_trainer(cfg, tok, model, Path("/nonexistent-checkpoints"), n_rows=8, comm=comm, root=root)
    trainer.row_seeded = True
    trainer.save_checkpoint = lambda: None  # the last step would save one: not what is measured
    trainer.optimizer = torch.optim.SGD([p for p in root.parameters() if p.requires_grad], lr=cfg.learning_rate)
    trainer.scheduler = build_scheduler(trainer.optimizer, cfg, cfg.max_steps)
    snapshots, _ = record(trainer, model)
    held: list[int] = []
    micro_step = trainer._micro_step

    def measured(*args):
        micro_step(*args)
        held.append(held_grad_bytes(root))

    trainer._micro_step = measured
    trainer.train()
    return {"weights": snapshots, "held": held, "total_bytes": total_bytes, "world": comm.world}


def main(argv: list[str]) -> int:
    torch.set_num_threads(1)
    with process_group("gloo", timeout_s=120) as comm:
        sharded = run(comm)
        with fsdp2_no_sync_between_micro_steps():
            no_sync = run(comm)
        held = comm.all_gather_object((sharded["held"], no_sync["held"]))
        if comm.is_main:
            torch.save({"sharded": sharded, "no_sync": no_sync, "held_per_rank": held}, argv[0])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
