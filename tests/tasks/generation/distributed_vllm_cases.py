"""The vLLM cases test_vllm_ranks.py compares between one process and two. Both runs are subprocesses (vLLM's
parallel state is process-wide, so the test process starts no engine): the 2-rank one is ONE torchrun launch
(gloo), each rank with its own co-located engine (vLLM's external_launcher executor, tensor parallel 1); the
1-process one is the same module run by plain python (the ``uni`` executor):

    python -m torch.distributed.run --standalone --nproc_per_node=2 \
        -m tests.tasks.generation.distributed_vllm_cases OUT.pt
    python -m tests.tasks.generation.distributed_vllm_cases OUT.pt

Two engines per process serve every case (one streams merged weights, one applies the adapter; starting one
costs ~10 s): each case trains a fresh tiny model (head_dim
32, the smallest vLLM's CPU attention takes), which the engine takes over at the case's first weight sync. A case
runs two SGD steps, one per generation round of 12 completions in groups of 4 (the second group straddles the
ranks: rank 0 owns rows 0-5), so the second round is sampled after an optimizer step and a weight sync on every
rank; completions are seeded by their row of the round. Rank 0 writes, per case: the rounds' completions, rewards
and advantages, the weights after each step, the logged metrics and each rank's count of weight syncs.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from grpoflow.tasks.config import GenerationConfig, GRPOConfig, ModelConfig, TinyModelConfig
from grpoflow.tasks.generation.vllm_engine import VLLMGenerator
from grpoflow.tasks.grpo.batch import PolicyLogProbs
from grpoflow.tasks.grpo.distributed import wrap_root
from grpoflow.tasks.launch.dist import Comm, process_group
from grpoflow.tasks.model.loading import add_lora
from grpoflow.tasks.model.optim import build_scheduler
from grpoflow.tasks.model.tiny import build_tiny_model, train_tiny_tokenizer
from tests.tasks.grpo.distributed_cases import eos_prone, record, scratch, trainable
from tests.tasks.grpo.test_trainer import TEXTS, addition_rows, make_trainer

ROWS_PER_ROUND = 12
TINY = TinyModelConfig(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1
)
CASES = [  # (name, lora, strategy, generation.vllm_lora_sync)
    ("ddp-lora", True, "ddp", "merge"),
    ("ddp-full", False, "ddp", "merge"),
    ("fsdp2-full", False, "fsdp2", "merge"),
    ("fsdp2-lora", True, "fsdp2", "merge"),
    ("ddp-lora-adapter", True, "ddp", "adapter"),
    ("fsdp2-lora-adapter", True, "fsdp2", "adapter"),
]


def tiny(tok, lora: bool):
    model = build_tiny_model(TINY, tok, seed=0)
    if lora:
        model = add_lora(model, ModelConfig().lora.model_copy(update={"r": 4, "target_modules": "all-linear"}))
    return model


def start_engines(comm: Comm, folder: Path) -> tuple:
    """The tokenizer and the process's engines by ``vllm_lora_sync`` (merge: weights streamed merged; adapter: the
    engine applies the adapter), started from a tiny model saved by rank 0 (every rank starts them together)."""
    tok = train_tiny_tokenizer(TEXTS, 280)
    path = folder / "engine-model"
    if comm.is_main:
        tiny(tok, lora=False).save_pretrained(path)
        tok.save_pretrained(path)
    comm.barrier()
    engines = {}
    for sync in ("merge", "adapter"):
        cfg = GenerationConfig(backend="vllm", vllm_max_num_seqs=16, vllm_kv_cache_gib=0.05, vllm_lora_sync=sync)
        engines[sync] = VLLMGenerator(tiny(tok, lora=sync == "adapter"), tok, str(path), cfg, max_model_len=128)
    return tok, engines


def run_case(
    comm: Comm,
    tok,
    engines: dict,
    name: str,
    lora: bool,
    strategy: str,
    lora_sync: str,
    *,
    max_steps: int = 2,
    checkpoints: Path | None = None,
    resume_from: Path | None = None,
) -> dict:
    """Train case ``name``; with ``checkpoints`` saving after every step there, with ``resume_from`` continuing that
    checkpoint (the engine then serves the loaded weights only if it syncs after the load)."""
    torch.manual_seed(0)
    generator = engines[lora_sync]
    model = tiny(tok, lora)
    eos_prone(model, tok, addition_rows(tok, 1)[1][0])
    settings = dict(
        max_steps=max_steps,
        per_device_train_batch_size=ROWS_PER_ROUND // 2 // comm.world,
        steps_per_generation=2,
        gradient_accumulation_steps=2,  # one optimizer step per round: the second round follows a step
        num_generations=4,
        max_completion_length=8,
        learning_rate=0.5,
        max_grad_norm=None,
        save_steps=1 if checkpoints else 100,
    )
    cfg = GRPOConfig.model_validate(settings, context={"num_processes": comm.world})
    root = wrap_root(PolicyLogProbs(model), comm, strategy)
    trainer = make_trainer(
        cfg,
        tok,
        model,
        checkpoints or scratch(comm),  # save_steps 100: only the last step's checkpoint is written
        n_rows=8,
        generator=generator,
        is_correction=True,  # as the stage runs a separate engine: the sampler's log-probs enter the loss
        comm=comm,
        root=root,
        row_seeded=True,
    )
    trainer.optimizer = torch.optim.SGD([p for p in root.parameters() if p.requires_grad], lr=cfg.learning_rate)
    trainer.scheduler = build_scheduler(trainer.optimizer, cfg, cfg.max_steps)
    generator.sync_weights(model, force=True)  # the engine serves this case's model from now on
    syncs = generator.syncs
    snapshots, rounds = record(trainer, model)
    if resume_from is not None:
        trainer.load_checkpoint(resume_from)
    trainer.train()
    return {
        "samples": rounds,
        "weights": snapshots,
        "history": trainer.history,
        "syncs": comm.all_gather_object(generator.syncs - syncs),  # each rank's, during training
        "final": trainable(model),
    }


RESUMED = ("fsdp2-lora", True, "fsdp2", "merge")


def run_resumed(comm: Comm, tok, engines: dict, folder: Path) -> dict:
    """RESUMED for 3 steps uninterrupted (a sharded checkpoint after each), and continued from its checkpoint-2 by a
    fresh trainer whose engine was last synced with the fresh model: the third round is sampled after the load."""
    whole = run_case(comm, tok, engines, *RESUMED, max_steps=3, checkpoints=folder / "whole")
    resumed = run_case(
        comm,
        tok,
        engines,
        *RESUMED,
        max_steps=3,
        checkpoints=folder / "resumed",
        resume_from=folder / "whole" / "checkpoint-2",
    )
    return {"whole": whole, "resumed": resumed}


def main(argv: list[str]) -> int:
    torch.set_num_threads(1)
    out = Path(argv[0])
    with process_group("gloo", timeout_s=120) as comm:
        tok, engines = start_engines(comm, out.parent)
        results = {case[0]: run_case(comm, tok, engines, *case) for case in CASES}
        results["resumed"] = run_resumed(comm, tok, engines, out.parent / "checkpoints")
        if comm.is_main:
            torch.save(results, out)
        comm.barrier()
        for engine in engines.values():  # after the last collective: vLLM's shutdown destroys the process group
            engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
