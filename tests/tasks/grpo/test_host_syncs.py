"""The GRPO micro-step makes no device-to-host sync of its own: the metrics stay on the device until the optimizer
step (one collective, one read), the prompt groups and row lengths are read once per round, and the chunked
log-prob path adds a vocabulary tile's target by masked arithmetic. Counted on CPU (tests/host_syncs.py: the calls
that sync on CUDA), through the CUDA "chunked" kernel (kernel_dtype patched to float32 routes the CPU tensors to
it), over one optimizer step of 2 and of 4 micro-steps, with vocabulary tiles of 64 and of 16 tokens."""

import functools
from pathlib import Path

import pytest
import torch

import grpoflow.kernels.logprobs as logprobs
import grpoflow.tasks.grpo.batch as batch
from grpoflow.tasks.config import GRPOConfig
from grpoflow.tasks.model.optim import build_scheduler
from tests.host_syncs import counting_syncs
from tests.tasks.grpo.test_trainer import make, make_trainer


def syncs_of_one_step(monkeypatch, micro_steps: int, vocab_chunk: int):
    """The syncs of one optimizer step of ``micro_steps`` micro-batches (its round generated beforehand)."""
    monkeypatch.setattr(logprobs, "kernel_dtype", lambda *_: torch.float32)  # the CUDA path's code on CPU tensors
    tiled = functools.partial(logprobs.token_logprobs, vocab_chunk_size=vocab_chunk)
    monkeypatch.setattr(batch, "token_logprobs", tiled)
    torch.manual_seed(0)
    tok, model = make(lora=False)
    cfg = GRPOConfig(
        max_steps=1,
        per_device_train_batch_size=2,
        steps_per_generation=micro_steps,
        gradient_accumulation_steps=micro_steps,
        num_generations=4,
        max_completion_length=8,
        logprob_impl="chunked",
        save_steps=100,
    )
    trainer = make_trainer(cfg, tok, model, Path("/nonexistent-checkpoints"), n_rows=8)
    trainer.optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # AdamW reads its CPU step counter: no sync
    trainer.scheduler = build_scheduler(trainer.optimizer, cfg, cfg.max_steps)
    trainer.save_checkpoint = lambda: None  # the last step saves one: not what is measured
    trainer.round = trainer.new_round()
    # a micro-step whose rows without a gradient run apart (micro_plan.py) makes two forwards
    forwards = sum(p.split and (p.train is not None) + 1 or 1 for p in trainer.round.plans)
    with counting_syncs() as syncs:
        trainer.train()
    assert trainer.step == 1 and trainer.micro_step == micro_steps
    assert {"loss", "entropy", "clip_ratio/low_min"} <= set(trainer.history[-1])  # the metrics were still logged
    return syncs, forwards


@pytest.mark.parametrize("vocab_chunk", [64, 16])
def test_an_optimizer_step_syncs_a_constant_number_of_times(monkeypatch, vocab_chunk):
    (two, _), (four, forwards) = (syncs_of_one_step(monkeypatch, m, vocab_chunk) for m in (2, 4))
    ours = two.ours()
    assert ours == four.ours(), (two.where, four.where)  # none per micro-step nor per tile
    # per optimizer step: the metrics, the FLOPs' row lengths, the grad norm; per round: its prompts and row order
    assert sum(ours.values()) <= 5, ours
    # transformers' mask builder checks for padding once per forward (masking_utils; not grpoflow's to remove)
    assert sum(four.where.values()) - sum(ours.values()) <= forwards, (forwards, four.where)
