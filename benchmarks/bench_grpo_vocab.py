"""Peak memory of one GRPO micro-step as the vocabulary grows: fused log-probs stay flat, naive ones grow.

A micro-step is what the trainer does per micro-batch: policy_logprobs (backbone forward, then
log-probs and entropy of the completion tokens from the last hidden states and the lm_head), the GRPO
loss, backward. The model is a tiny Qwen2 built from config (grpoflow.tasks.model.tiny.build_tiny_model, 2 layers,
hidden 128, tied embeddings) with LoRA adapters, as the trainer's default, so the head is frozen; only
the vocabulary size changes. The batch is B rows of P prompt and C completion tokens.

    naive  impl="reference": materialized [B*C, V] logits, log_softmax, and their gradient: grows with V
    fused  impl="chunked": kernels/chunked_logprobs.py, one [rows, vocab tile] block at a time: grows only
           until V fills its vocabulary tile (8192 columns), then stays flat

Under the benchmark protocol (benchmarks/protocol.py, docs/benchmarks.md): each (impl, V) is a side that runs in a
fresh process, --rounds rounds (>= 2) visiting them in turn, gated on a quiet machine, with --threads torch threads.
A side reports its set-up (imports, model, batch), its first micro-step (time, and the peak RSS growth over what
was resident before it: model and batch; see benchmarks/bench_logprobs.py for the method), the median of
--repeats more steps, and its process's wall time and max RSS. Then per V the per-round ratios fused / naive of
the first step's peak and of the step time, with their spread, and a RESULTS.md row (the largest V).

    python benchmarks/bench_grpo_vocab.py               # V = 512 .. 32768, B=8 P=32 C=256
    python benchmarks/bench_grpo_vocab.py --vocabs 512 --b 2 --p 8 --c 8 --repeats 1 --allow-contended --wait 0
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import protocol  # noqa: E402

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
    parser.add_argument("--vocabs", type=int, nargs="+", default=list(VOCABS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="torch threads of every side (2)")
    protocol.add_protocol_args(parser)
    parser.add_argument("--side", help=argparse.SUPPRESS)  # impl@vocab
    a = parser.parse_args()
    if a.side:
        impl, vocab = a.side.split("@")
        setup = lambda: make_step(impl, int(vocab), a.b, a.p, a.c)  # noqa: E731
        return protocol.side_main(lambda: protocol.measure_calls(setup, a.repeats, a.threads))
    protocol.check_rounds(a)
    shape = ["--b", str(a.b), "--p", str(a.p), "--c", str(a.c), "--repeats", str(a.repeats)]
    shape += ["--threads", str(a.threads)]
    print(f"machine now: {protocol.quiet_now()}, {protocol.machine()}")
    sides = [f"{impl}@{vocab}" for vocab in a.vocabs for impl in IMPLS]
    runs = protocol.alternate(a, sides, lambda side: [sys.executable, __file__, "--side", side, *shape])
    print(f"\n== GRPO micro-step (LoRA, tiny Qwen2 hidden 128), B={a.b} P={a.p} C={a.c}: {a.b * a.c} completion "
          f"tokens, {a.threads} torch threads, {a.rounds} rounds x {a.repeats} timed steps")  # fmt: skip
    protocol.print_calls(runs)
    protocol.print_rounds(runs)
    peak, time_of = (lambda d: d["first_peak_mib"]), (lambda d: d["median_s"])
    for vocab in a.vocabs:
        mem = protocol.compare(runs, f"fused@{vocab}", f"naive@{vocab}", peak, f"V={vocab} fused/naive first-step peak")
        protocol.compare(runs, f"fused@{vocab}", f"naive@{vocab}", time_of, f"V={vocab} fused/naive step time")
    result = f"GRPO micro-step B={a.b} C={a.c} V={a.vocabs[-1]}: fused/naive first-step peak {mem['median']:.3f}x"
    print("RESULTS.md row:\n" + protocol.results_row(runs, f"{a.threads}/-", result, mem))


if __name__ == "__main__":
    main()
