"""GRPO log-prob pass: one forward at the round's widths vs grpo.logprob_chunk_rows (length-sorted chunks, each cut
to its own longest prompt and completion).

A round as the real-model config makes one: 64 rows, chat-templated arithmetic prompts with the XML system prompt
(their real lengths), completions of random tokens with lengths drawn like a GRPO round's (uniform 8..max, a
quarter clipped at max). Each variant runs forward + backward of sum(logp * mask) through a LoRA (r16, all linear
layers) model in float32, in alternating repetitions; prints the median seconds of each, the ratio to one pass,
the tokens each computes, and each one's first-call peak (resident-memory high-water mark above its start).

    python benchmarks/bench_logprob_chunks.py --model smollm2-135m-instruct --chunks 0 16 8
"""

from __future__ import annotations

import statistics
import time

import torch

from benchmarks.bench_sft_loss import lora_model, model_cli, peak_above_start
from benchmarks.bench_trl_throughput import arithmetic_rows


def main() -> None:
    ap = model_cli(__doc__)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--max-completion", type=int, default=48)
    ap.add_argument("--chunks", type=int, nargs="+", default=[0, 16, 8])
    args = ap.parse_args()

    from grpoflow.tasks.grpo.batch import build_round, completion_lengths, policy_logprobs
    from grpoflow.tasks.model.loading import prompt_ids

    rows = arithmetic_rows(args.rows, seed=2)
    tok, model = lora_model(args, rows)
    g = torch.Generator().manual_seed(0)
    n_max = args.max_completion
    lengths = [
        n_max if torch.rand((), generator=g) < 0.25 else int(torch.randint(8, n_max, (), generator=g)) for _ in rows
    ]
    completions = [torch.randint(3, len(tok), (n,), generator=g).tolist() for n in lengths]
    reasons = ["length" if n == n_max else "stop" for n in lengths]
    batch = build_round(
        [prompt_ids(tok, r["prompt"]) for r in rows],
        completions,
        [[0.0] * n for n in lengths],
        reasons,
        tok.pad_token_id,
        False,
    )
    mask = batch.completion_mask.float()
    P, C = batch.prompt_ids.shape[1], batch.completion_ids.shape[1]
    real_prompt = batch.prompt_mask.sum(1)
    print(
        f"model {args.model}: {args.rows} rows, prompts {int(real_prompt.min())}-{P} tokens, completions "
        f"{min(lengths)}-{C} (mean {sum(lengths) / len(lengths):.1f})"
    )

    def tokens(chunk: int) -> int:
        if not chunk:
            return args.rows * (P + C)
        n = completion_lengths(batch)
        order = torch.argsort(n, stable=True)
        return sum(len(r) * (int(real_prompt[r].max()) + int(n[r].max())) for r in order.split(chunk))

    def step(chunk: int) -> None:
        logp, _ = policy_logprobs(model, batch, 1.0, compute_entropy=True, chunk_rows=chunk)
        (logp * mask).sum().backward()
        model.zero_grad(set_to_none=True)

    step(0)  # one-time set-up shared by all (autograd, thread pools)
    times: dict[int, list[float]] = {c: [] for c in args.chunks}
    first: dict[int, float] = {}
    for rep in range(args.reps + 1):
        for chunk in args.chunks if rep % 2 == 0 else list(reversed(args.chunks)):
            t = time.perf_counter()
            peak = peak_above_start(lambda chunk=chunk: step(chunk))
            (times[chunk] if rep else []).append(time.perf_counter() - t)
            first.setdefault(chunk, peak)
    base = statistics.median(times[args.chunks[0]])
    for chunk in args.chunks:
        med = statistics.median(times[chunk])
        print(
            f"chunk_rows {chunk:3d}: {med:7.2f} s  x{base / med:4.2f}  {tokens(chunk):6d} tokens  "
            f"first-call peak {first[chunk]:7.1f} MiB"
        )


if __name__ == "__main__":
    main()
