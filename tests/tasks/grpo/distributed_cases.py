"""The GRPO cases test_distributed_ranks.py compares between one process and two: run by that test in-process, and
on 2 ranks by ONE torchrun launch (gloo), so the suite pays for one launch:

    python -m torch.distributed.run --standalone --nproc_per_node=2 \
        -m tests.tasks.grpo.distributed_cases OUT.pt CKPT_DIR

Each case trains a tiny model for two SGD steps (SGD: Adam's per-coordinate normalization would hide a gradient
that is off by a constant factor) over one generation round replayed twice (num_iterations 2: the second step
uses the old log-probs), with per_device_train_batch_size B on one process and B/2 on two, so both see the same
round of 12 completions in groups of 4, the second group straddling the ranks (rows 4-7; rank 0 owns 0-5).
The DDP cases wrap the root module in DistributedDataParallel, the FSDP2 ones shard it per decoder layer plus
the root on a CPU device mesh (generation runs on the gathered weights). Rank 0 writes what both runs are compared
on: the round's completions, rewards and advantages, the weights after each optimizer step and the logged metrics.
The RESUMED cases also write sharded checkpoints (tasks/grpo/dist_checkpoint.py) into CKPT_DIR and continue from one.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

from grpoflow.tasks.config import GRPOConfig
from grpoflow.tasks.grpo.batch import PolicyLogProbs
from grpoflow.tasks.grpo.distributed import wrap_root
from grpoflow.tasks.grpo.trainer_runtime import CheckpointHooks
from grpoflow.tasks.launch.dist import Comm, process_group
from grpoflow.tasks.model.optim import build_scheduler
from tests.tasks.grpo.test_head_rows import half_constant
from tests.tasks.grpo.test_trainer import addition_rows, make, make_trainer

ROWS_PER_ROUND = 12  # per_device_train_batch_size (6 on 1 process, 3 on 2) * processes * steps_per_generation 2
CASES = [  # (name, loss_type, lora, scale_rewards, strategy)
    ("grpo-lora", "grpo", True, "group", "ddp"),
    ("dr_grpo-lora", "dr_grpo", True, "batch", "ddp"),
    ("dapo-lora", "dapo", True, "group", "ddp"),
    ("grpo-full", "grpo", False, "batch", "ddp"),
    ("dr_grpo-full", "dr_grpo", False, "group", "ddp"),
    ("dapo-full", "dapo", False, "batch", "ddp"),
    ("grpo-full-fsdp2", "grpo", False, "group", "fsdp2"),
    ("dr_grpo-full-fsdp2", "dr_grpo", False, "batch", "fsdp2"),
    ("dapo-full-fsdp2", "dapo", False, "group", "fsdp2"),
    ("dapo-lora-fsdp2", "dapo", True, "batch", "fsdp2"),
    # rewards equal within half the prompts' groups: advantage 0, rows without a gradient (micro_plan.py)
    ("dr_grpo-lora-zero", "dr_grpo", True, "group", "ddp"),
    ("dapo-full-zero", "dapo", False, "batch", "ddp"),
    ("grpo-full-fsdp2-zero", "grpo", False, "group", "fsdp2"),
]
ZERO_ADVANTAGE = {"dr_grpo-lora-zero", "dapo-full-zero", "grpo-full-fsdp2-zero"}


def full(p: torch.Tensor) -> torch.Tensor:
    """A parameter's whole value (FSDP2 holds a shard per rank: gathered, a collective every rank makes)."""
    return p.full_tensor() if hasattr(p, "full_tensor") else p


def scratch(comm: Comm) -> Path:
    """A fresh folder every rank of ``comm`` shares, for a case that saves no checkpoint along the way: train()
    still saves the last step's, and cases run at once (one process and two ranks) must not publish into one
    folder."""
    made = tempfile.mkdtemp(prefix="grpo-case-") if comm.is_main else None
    return Path(comm.all_gather_object(made)[0])


def trainable(model) -> dict[str, torch.Tensor]:
    """A whole copy of the trainable weights (FSDP2 shards gathered)."""
    return {n: full(p).detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def record(trainer, model) -> tuple[list[dict[str, torch.Tensor]], list]:
    """Lists that fill as ``trainer`` runs: the trainable weights after each optimizer step, and each round's rows
    (gathered on every rank, in global order)."""
    snapshots: list[dict[str, torch.Tensor]] = []
    rounds: list = []
    saving: list[bool] = []  # torch.distributed.checkpoint steps a fresh optimizer (zero gradients) to build its state
    trainer.optimizer.register_step_post_hook(lambda *_: None if saving else snapshots.append(trainable(model)))
    save = trainer.save_checkpoint

    def recording_save():
        saving.append(True)
        try:
            return save()
        finally:
            saving.pop()

    trainer.save_checkpoint = recording_save
    new_round = trainer.new_round

    def recording_new_round():
        r = new_round()
        rounds.append(r.samples)
        return r

    trainer.new_round = recording_new_round
    return snapshots, rounds


def record_passes(trainer) -> list[tuple]:
    """A list that fills as ``trainer`` runs: per loss micro-step, its plan (micro_plan.py) as ("whole", rows,
    positions with a gradient) or ("split", rows with a gradient, rows without), and how many forwards it made
    through the root (the distributed wrapper, whose forward and backward run the collectives)."""
    passes: list[tuple] = []
    calls = [0]
    trainer.root.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    policy = trainer._policy_logprobs

    def recording(mb, plan):
        calls[0] = 0
        out = policy(mb, plan)
        if plan.split:
            n = [0 if p is None else p.rows.numel() for p in (plan.train, plan.free)]
            passes.append(("split", *n, calls[0]))
        else:
            passes.append(("whole", plan.whole.rows.numel(), plan.whole.head_rows[0].numel(), calls[0]))
        return out

    trainer._policy_logprobs = recording
    return passes


def eos_prone(model, tok, prompt: list[int]) -> None:
    """Give EOS the logit 4 after ``prompt`` (the random model's logits are ~1): about a sixth of the completions
    then end early, so completion lengths differ and the loss types' normalizers differ from each other."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    with torch.no_grad():
        h = base.model(input_ids=torch.tensor([prompt])).last_hidden_state[0, -1]
        base.get_output_embeddings().weight[tok.eos_token_id] = 4.0 * h / h.norm() ** 2


def run_case(
    comm: Comm,
    name: str,
    loss_type: str,
    lora: bool,
    scale_rewards: str,
    strategy: str,
    *,
    checkpoints: Path | None = None,
    resume_from: Path | None = None,
    max_steps: int = 2,
    per_device: int | None = None,
) -> dict:
    """Train case ``name``; with ``checkpoints`` saving after every step there, with ``resume_from`` continuing that
    checkpoint."""
    torch.manual_seed(0)
    tok, model = make(lora)
    eos_prone(model, tok, addition_rows(tok, 1)[1][0])
    settings = dict(
        max_steps=max_steps,
        per_device_train_batch_size=per_device or ROWS_PER_ROUND // 2 // comm.world,
        steps_per_generation=2,
        gradient_accumulation_steps=2,  # one optimizer step per replay of the round
        num_iterations=2,
        num_generations=4,
        max_completion_length=8,
        learning_rate=0.5,
        loss_type=loss_type,
        scale_rewards=scale_rewards,
        max_grad_norm=None,
        save_steps=1 if checkpoints else 100,
    )
    cfg = GRPOConfig.model_validate(settings, context={"num_processes": comm.world})
    root = wrap_root(PolicyLogProbs(model), comm, strategy)
    out = checkpoints or scratch(comm)  # save_steps 100: only the last step's checkpoint is written
    # checkpoint-1 is what the RESUMED cases continue from: kept although newer ones (the last step's too) are saved
    hooks = CheckpointHooks(pinned=lambda: {"checkpoint-1"})
    funcs = [("half", half_constant)] if name in ZERO_ADVANTAGE else None
    kw = dict(comm=comm, root=root, row_seeded=True, hooks=hooks)
    trainer = make_trainer(cfg, tok, model, out, funcs, n_rows=8, **kw)
    trainer.optimizer = torch.optim.SGD([p for p in root.parameters() if p.requires_grad], lr=cfg.learning_rate)
    trainer.scheduler = build_scheduler(trainer.optimizer, cfg, cfg.max_steps)
    snapshots, rounds = record(trainer, model)
    passes = record_passes(trainer)
    loaded = None
    if resume_from is not None:
        trainer.load_checkpoint(resume_from)
        loaded = trainable(model)
    trainer.train()
    final = trainable(model)
    out = {"samples": rounds, "weights": snapshots, "history": trainer.history, "loaded": loaded, "final": final}
    return out | {"passes": comm.all_gather_object(passes)}  # every rank's


RESUMED = [("dapo-lora", "dapo", True, "group", "ddp"), ("grpo-full-fsdp2", "grpo", False, "group", "fsdp2")]


def run_all(comm: Comm) -> dict:
    return {case[0]: run_case(comm, *case) for case in CASES}


def run_resumed(comm: Comm, folder: Path) -> dict:
    """Per case of RESUMED: 3 steps uninterrupted (a sharded checkpoint after each), and the same run continued
    from its checkpoint-1 (written in the middle of a round: the round spans 2 steps) by a fresh trainer."""
    out = {}
    for case in RESUMED:
        kw = dict(max_steps=3, per_device=4)  # a round of 8 * W rows: valid on 1 process and on 2
        whole = run_case(comm, *case, checkpoints=folder / case[0] / "whole", **kw)
        resumed = run_case(
            comm,
            *case,
            checkpoints=folder / case[0] / "resumed",
            resume_from=folder / case[0] / "whole" / "checkpoint-1",
            **kw,
        )
        out[case[0]] = {"whole": whole, "resumed": resumed}
    return out


def main(argv: list[str]) -> int:
    torch.set_num_threads(1)
    with process_group("gloo", timeout_s=120) as comm:
        results = run_all(comm)
        results["resumed"] = run_resumed(comm, Path(argv[1]))
        if comm.is_main:
            torch.save(results, argv[0])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
