"""Peak memory of one GRPO micro-step as the vocabulary grows: fused log-probs stay flat, naive ones grow.

A micro-step is what the trainer does per micro-batch: policy_logprobs (backbone forward, then
log-probs and entropy of the completion tokens from the last hidden states and the lm_head), the GRPO
loss, backward. The model is a tiny Qwen2 built from config (grpoflow.tasks.model.tiny.build_tiny_model, 2 layers,
hidden 128, tied embeddings) with LoRA adapters, as the trainer's default, so the head is frozen; only
the vocabulary size changes. The batch is B rows of P prompt and C completion tokens.

    naive  impl="reference": materialized [B*C, V] logits, log_softmax, and their gradient: grows with V
    fused  impl="chunked": kernels/chunked_logprobs.py, one [rows, vocab tile] block at a time: grows only
           until V fills its vocabulary tile (8192 columns), then stays flat

Each (impl, V) runs in a fresh process and reports the peak RSS growth of one step over what was resident
before it (model and batch; see benchmarks/bench_logprobs.py for the method) and the median step time of
--repeats more steps.

    python benchmarks/bench_grpo_vocab.py               # V = 512 .. 32768, B=8 P=32 C=256
"""

from __future__ import annotations

import argparse
import json
import statistics

from bench_logprobs import measure, spawn

VOCABS = (512, 2048, 8192, 32768)
IMPLS = {"naive": "reference", "fused": "chunked"}


class _Vocab:
    """What build_tiny_model reads from a tokenizer: its length and the pad and EOS ids."""

    def __init__(self, size: int):
        self.size, self.pad_token_id, self.eos_token_id = size, 0, 1

    def __len__(self) -> int:
        return self.size


def make_step(impl: str, vocab: int, b: int, p: int, c: int):
    """A LoRA tiny model with vocabulary ``vocab``, a random batch, and a closure running one micro-step."""
    import torch

    from grpoflow.tasks.config import LoraConfig, TinyModelConfig
    from grpoflow.tasks.grpo.batch import build_round, policy_logprobs
    from grpoflow.tasks.grpo.loss import LossSettings, grpo_loss
    from grpoflow.tasks.model.loading import add_lora
    from grpoflow.tasks.model.tiny import build_tiny_model

    model = add_lora(build_tiny_model(TinyModelConfig(num_hidden_layers=2), _Vocab(vocab), seed=0), LoraConfig())
    g = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(2, vocab, (n,), generator=g).tolist()  # noqa: E731
    batch = build_round([ids(p)] * b, [ids(c) for _ in range(b)], [[-1.0] * c] * b, ["stop"] * b, 0, False)
    advantages = torch.randn(b, generator=g)
    settings = LossSettings(loss_type="bnpo")

    def step():
        logp, _ = policy_logprobs(model, batch, 1.0, compute_entropy=True, impl=IMPLS[impl])
        loss, _ = grpo_loss(logp, None, advantages, batch.completion_mask, settings)
        loss.backward()
        model.zero_grad(set_to_none=True)

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--b", type=int, default=8)
    parser.add_argument("--p", type=int, default=32)
    parser.add_argument("--c", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--case", nargs=2, help=argparse.SUPPRESS)  # impl, vocab
    a = parser.parse_args()
    if a.case:
        impl, vocab = a.case[0], int(a.case[1])
        print(json.dumps(measure(make_step(impl, vocab, a.b, a.p, a.c), a.repeats)))
        return
    shape = ["--b", str(a.b), "--p", str(a.p), "--c", str(a.c), "--repeats", str(a.repeats)]
    print(f"GRPO micro-step (LoRA, tiny Qwen2 hidden 128), B={a.b} P={a.p} C={a.c}: {a.b * a.c} completion tokens")
    print(f"  {'V':>6s}  {'naive +MB':>10s} {'fused +MB':>10s}  {'naive s':>8s} {'fused s':>8s}")
    for vocab in VOCABS:
        r = {impl: spawn(__file__, ["--case", impl, str(vocab), *shape]) for impl in IMPLS}
        secs = {impl: statistics.median(r[impl]["seconds"]) for impl in IMPLS}
        mem = f"{r['naive']['peak_mb']:10.1f} {r['fused']['peak_mb']:10.1f}"
        print(f"  {vocab:6d}  {mem}  {secs['naive']:8.2f} {secs['fused']:8.2f}", flush=True)


if __name__ == "__main__":
    main()
