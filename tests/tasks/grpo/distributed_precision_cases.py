"""FSDP2's mixed precision on 2 ranks (gloo, CPU), run by test_distributed_precision.py through ONE torchrun launch:

    python -m torch.distributed.run --standalone --nproc_per_node=2 \
        -m tests.tasks.grpo.distributed_precision_cases OUT.pt

Each case wraps a tiny model as the GRPO stage does (``wrap_root`` with the stage's autocast dtype) and trains it for
two AdamW steps under the trainer's autocast:

- full-bf16: full fine-tuning with model.dtype bfloat16 (float32 weights, bf16 autocast): the MixedPrecisionPolicy
  (bf16 params, float32 reduce) on every FSDP module; bf16 weights inside the forward, float32 shards stepped.
- lora-bf16: LoRA with model.dtype bfloat16 (bf16 frozen base, float32 adapters, no autocast): no policy; the base
  gathered in bf16 and the adapters in float32, as on one process.

Rank 0 writes, per case: the policies, the dtypes a forward hook saw, the sharded parameters' dtypes after training,
the losses, and whether the trained weights moved.
"""

from __future__ import annotations

import sys

import torch

from grpoflow.tasks.config import GRPOConfig
from grpoflow.tasks.grpo.batch import PolicyLogProbs
from grpoflow.tasks.grpo.distributed import wrap_root
from grpoflow.tasks.launch.dist import Comm, process_group
from tests.tasks.grpo.distributed_cases import trainable
from tests.tasks.grpo.test_trainer import make, make_trainer

CASES = {"full-bf16": (False, torch.bfloat16), "lora-bf16": (True, None)}  # name: (lora, autocast dtype)


def fsdp_policies(root: torch.nn.Module) -> list[tuple]:
    """(param_dtype, reduce_dtype) of every FSDP module under ``root``."""
    from torch.distributed.fsdp import FSDPModule

    return [
        (m._get_fsdp_state()._mp_policy.param_dtype, m._get_fsdp_state()._mp_policy.reduce_dtype)
        for m in root.modules()
        if isinstance(m, FSDPModule)
    ]


def run_case(comm: Comm, lora: bool, autocast_dtype: torch.dtype | None) -> dict:
    torch.manual_seed(0)
    tok, model = make(lora)
    if lora:  # model.dtype bfloat16 with LoRA: the frozen base in bf16, the adapters in float32 (train_dtypes)
        for p in model.parameters():
            if not p.requires_grad:
                p.data = p.data.to(torch.bfloat16)
    root = wrap_root(PolicyLogProbs(model), comm, "fsdp2", autocast_dtype)
    seen: list[tuple] = []
    proj = model.get_base_model().model.layers[0].mlp.down_proj if lora else model.model.layers[0].mlp.down_proj

    def record(module, args):
        if torch.is_grad_enabled():  # the training forward (generation runs without grad)
            weights = [module.base_layer.weight, module.lora_A["default"].weight] if lora else [module.weight]
            seen.append(tuple(w.dtype for w in weights))

    proj.register_forward_pre_hook(record)
    cfg = GRPOConfig(
        max_steps=2,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=6,
        learning_rate=1e-2,
        save_steps=100,
    )
    cfg = GRPOConfig.model_validate(cfg.model_dump(), context={"num_processes": comm.world})
    before = trainable(model)
    trainer = make_trainer(
        cfg, tok, model, "/nonexistent", n_rows=8, comm=comm, root=root, row_seeded=True, autocast_dtype=autocast_dtype
    )
    trainer.save_checkpoint = lambda: None  # train() saves the last step's: not what these cases look at
    trainer.train()
    after = trainable(model)
    return {
        "policies": fsdp_policies(root),
        "seen": sorted(set(seen), key=str),
        "trainable_dtypes": sorted({str(p.dtype) for p in model.parameters() if p.requires_grad}),
        "frozen_dtypes": sorted({str(p.dtype) for p in model.parameters() if not p.requires_grad}),
        "losses": [h["loss"] for h in trainer.history],
        "moved": max((after[n] - before[n]).abs().max().item() for n in before),
    }


def main(argv: list[str]) -> int:
    torch.set_num_threads(1)
    with process_group("gloo", timeout_s=120) as comm:
        results = {name: run_case(comm, *case) for name, case in CASES.items()}
        if comm.is_main:
            torch.save(results, argv[0])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
