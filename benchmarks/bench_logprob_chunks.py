"""GRPO log-prob pass: one forward at the round's widths vs grpo.logprob_chunk_rows (length-sorted chunks, each cut
to its own longest prompt and completion).

A round as the real-model config makes one: 64 rows, chat-templated arithmetic prompts with the XML system prompt
(their real lengths), completions of random tokens with lengths drawn like a GRPO round's (uniform 8..max, a
quarter clipped at max). Each variant runs forward + backward of sum(logp * mask) through a LoRA (r16, all linear
layers) model in float32 with --threads torch threads.

Under the benchmark protocol (benchmarks/protocol.py, docs/benchmarks.md): each --chunks value is a side run in a
fresh process, --rounds rounds (>= 2) visiting them in turn, gated on a quiet machine. A side reports its set-up
(imports, model, round) and its first pass (time, and its first-call peak: the resident-memory high-water mark
above its start) apart from the median of --reps timed passes, the tokens it computes, and its process's wall time
and max RSS. Then per chunk value the per-round speed-ups against the first --chunks value (0: one pass) with their
spread, and a RESULTS.md row.

    python benchmarks/bench_logprob_chunks.py --model smollm2-135m-instruct --chunks 0 16 8
    python benchmarks/bench_logprob_chunks.py --model tiny --rows 4 --max-completion 12 --chunks 0 2 --reps 1 \\
        --allow-contended --wait 0                                     # smoke run: checks the fields only
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import protocol  # noqa: E402
from bench_sft_loss import lora_model, model_cli, run_in_sides, run_side  # noqa: E402
from bench_trl_throughput import arithmetic_rows  # noqa: E402


def setup_side(args):
    """The pass one side times (chunk_rows = ``args.side``) and what it computes."""
    import torch

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
    shape = {"prompts": f"{int(real_prompt.min())}-{P}", "completions": f"{min(lengths)}-{C}"}
    shape["completion_mean"] = round(sum(lengths) / len(lengths), 1)

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

    chunk = int(args.side)
    return (lambda: step(chunk)), shape | {"tokens": tokens(chunk), "chunk_rows": chunk}


def main() -> None:
    ap = model_cli(__doc__)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--max-completion", type=int, default=48)
    ap.add_argument("--chunks", type=int, nargs="+", default=[0, 16, 8])
    args = ap.parse_args()
    if args.side:
        return run_side(args, setup_side)
    runs = run_in_sides(args, [str(c) for c in args.chunks], arithmetic_rows(args.rows, seed=2))
    ok = {r.side: r.result for r in runs if not r.error}
    print(f"\n== GRPO log-prob pass, model {args.model}: {args.rows} rows, forward + backward through LoRA, "
          f"{args.threads} torch threads, {args.rounds} rounds x {args.reps} timed passes")  # fmt: skip
    for side, d in ok.items():
        print(f"  chunk_rows {side}: {d['tokens']} tokens (prompts {d['prompts']}, completions {d['completions']}, "
              f"mean {d['completion_mean']})")  # fmt: skip
    protocol.print_calls(runs)
    protocol.print_rounds(runs)
    base, ratio = str(args.chunks[0]), protocol.ratios([], [])
    for chunk in args.chunks[1:]:
        r = protocol.compare(
            runs, str(chunk), base, lambda d: 1 / d["median_s"], f"chunk_rows {chunk}/{base} (passes/s)"
        )
        protocol.compare(
            runs, str(chunk), base, lambda d: d["first_peak_mib"], f"chunk_rows {chunk}/{base} first-call peak"
        )
        ratio = ratio if ratio["per_round"] else r
    head = args.chunks[1] if len(args.chunks) > 1 else base
    result = (f"log-prob pass {args.model} {args.rows} rows: chunk_rows {head}/{base} passes/s {ratio['median']:.2f}x"
              if ratio["per_round"] else "log-prob pass: no ratio (a side failed or one --chunks value)")  # fmt: skip
    print("RESULTS.md row:\n" + protocol.results_row(runs, f"{args.threads}/-", result, ratio))


if __name__ == "__main__":
    main()
