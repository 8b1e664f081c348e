"""Decoding throughput: our transformers sampling loop against transformers ``model.generate``, like with like, under
the benchmark protocol (benchmarks/protocol.py, docs/benchmarks.md).

    ours       tasks/generation/transformers_loop.py ``sample`` as the GRPO sampler calls it: each distinct prompt of
               a batch prefilled once and its KV cache copied to its rows, then a plain loop of the model's forward
               with the cache written in place (tasks/generation/kv_cache.py); rows that emitted EOS leave the
               batch; it also computes each sampled token's log-prob (the trainer needs them), which generate does
               not
    generate   transformers ``model.generate(do_sample=True)`` with its default dynamic cache

Both sides decode the same rows (``--prompts`` arithmetic prompts in the default config's chat format, each
``--samples`` times, left-padded, in batches of ``--batch`` rows) from the same model folder (float32, no LoRA:
what the trainer decodes with once its LoRA is merged), with the same sampling settings (the default config's GRPO
temperature, top-p, top-k, min-p and repetition penalty, through transformers' own logits processors on both
sides), the same ``--max-new-tokens``, the same seed per call and ``--threads`` torch threads. ``--stop``:

    length     (default) no EOS stop on either side: every row decodes ``--max-new-tokens`` tokens, so both produce
               the same number of tokens, the loop alone is compared
    eos        both stop a row at its first EOS; ours drops finished rows from the batch while generate decodes
               them (padded) until the last row ends, and once a row has ended the two draw from different random
               streams, so the token counts may differ: both are printed, with their difference; the ratio is of
               tokens/s

Each side of each round is a fresh process (ours, generate, ours, generate, ...; ``--rounds`` >= 2), gated on a
quiet machine; it reports its set-up (imports, loading) and first call (warm-up) apart from the ``--repeats``
timed calls, the first call's memory peak, and its process's wall time and max RSS. Then the per-round ratios
ours / generate of tokens/s with their spread, and a row for benchmarks/RESULTS.md.

    python benchmarks/bench_generation.py                     # the default tiny model, 128 rows x 32 tokens
    python benchmarks/bench_generation.py --model 25m --threads 2
    python benchmarks/bench_generation.py --rounds 2 --repeats 1 --prompts 2 --samples 2 --max-new-tokens 4 \\
        --allow-contended --wait 0                                       # smoke run: checks the fields only
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import protocol  # noqa: E402
from bench_trl_throughput import arithmetic_rows, model_folder  # noqa: E402

# a model of the 25M class built from config (the default tiny model is --model tiny)
MODEL_25M = dict(
    hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4
)
SIDES = ("ours", "generate")
NAMES = {
    "ours": "grpoflow transformers_loop.sample (one prefill per prompt, in-place KV cache, finished rows leave)",
    "generate": "transformers model.generate(do_sample=True), dynamic cache",
}


def build_folder(name: str, cache_dir: str, work: Path) -> str:
    """The model folder both sides load: tiny (the default config's), 25m (built from config) or a model name."""
    rows = arithmetic_rows(400)
    if name != "25m":
        return model_folder(name, cache_dir, rows, work)
    from grpoflow.tasks.config import TinyModelConfig, load_config
    from grpoflow.tasks.model.tiny import build_tiny_model

    tiny = model_folder("tiny", cache_dir, rows, work)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny)
    cfg = load_config(None, []).model.tiny.model_dump() | MODEL_25M
    model = build_tiny_model(TinyModelConfig(**cfg), tok, seed=0)
    folder = work / "25m"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


def sampling(args):
    """The default config's GRPO sampling settings, with --max-new-tokens."""
    from dataclasses import replace

    from grpoflow.tasks.config import load_config
    from grpoflow.tasks.generation.types import SamplingParams

    return replace(SamplingParams.from_grpo(load_config(None, []).grpo), max_new_tokens=args.max_new_tokens)


def setup_side(args):
    """The call one side times: decode every row once, batch by batch; it returns the tokens produced."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpoflow.tasks.generation.transformers_loop import distinct_prompts, sample
    from grpoflow.tasks.generation.types import left_pad
    from grpoflow.tasks.model.loading import prompt_ids

    logging.getLogger("transformers").setLevel(logging.ERROR)  # generate's warning about the never-matching EOS id
    tok = AutoTokenizer.from_pretrained(args.folder)
    model = AutoModelForCausalLM.from_pretrained(args.folder, dtype=torch.float32).eval()
    p = sampling(args)
    eos = tok.eos_token_id if args.stop == "eos" else -1  # -1: never sampled, so no row stops before the limit
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    rows = arithmetic_rows(args.prompts, seed=3)
    expanded = [prompt_ids(tok, r["prompt"]) for r in rows for _ in range(args.samples)]
    batches = [left_pad(expanded[i : i + args.batch], pad) for i in range(0, len(expanded), args.batch)]
    shared = []  # ours: the distinct prompts of each batch and each row's index into them (the GRPO sampler's call)
    for i in range(0, len(expanded), args.batch):
        unique, index = distinct_prompts(expanded[i : i + args.batch])
        shared.append((*left_pad(unique, pad), torch.tensor(index)))
    calls = {"n": 0}

    def produced(new: torch.Tensor) -> int:
        """Tokens a row produced: up to and including its first EOS, else all of them."""
        if eos < 0:
            return new.numel()
        hit = new == eos
        first = torch.where(hit.any(1), hit.int().argmax(1) + 1, torch.full_like(new[:, 0], new.shape[1]))
        return int(first.sum())

    @torch.no_grad()
    def call() -> int:
        torch.manual_seed(args.seed + calls["n"])  # the same seed per call on both sides
        calls["n"] += 1
        tokens = 0
        for (ids, mask), (u_ids, u_mask, index) in zip(batches, shared, strict=True):
            if args.side == "ours":
                _, _, lengths, _ = sample(model, u_ids, u_mask, p, eos, prompt_rows=index)
                tokens += int(lengths.sum())
            else:
                out = model.generate(
                    input_ids=ids, attention_mask=mask, do_sample=not p.greedy, max_new_tokens=p.max_new_tokens,
                    min_new_tokens=0, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k or 0,
                    min_p=p.min_p, repetition_penalty=p.repetition_penalty, eos_token_id=eos, pad_token_id=pad,
                    use_cache=True,
                )  # fmt: skip
                tokens += produced(out[:, ids.shape[1] :])
        return tokens

    return call


def run_side(args) -> None:
    def measure() -> dict:
        res = protocol.measure_calls(lambda: setup_side(args), args.repeats, args.threads)
        return res | {"sampler": NAMES[args.side], "sampling": repr(sampling(args))}

    protocol.side_main(measure)


def report(args, runs: list[protocol.SideRun]) -> None:
    ok = [r for r in runs if not r.error]
    rows = args.prompts * args.samples
    print(f"\n== decoding: model {args.model}, {rows} rows ({args.prompts} prompts x {args.samples}) in batches of "
          f"{args.batch}, <= {args.max_new_tokens} new tokens, stop {args.stop}, {args.threads} torch threads on "
          f"both sides, {args.repeats} timed calls a process, {args.rounds} alternating rounds")  # fmt: skip
    for side in SIDES:
        print(f"  {side}: {NAMES[side]}")
    if ok:
        print(f"  sampling (both): {ok[0].result['sampling']}")
    tokens = {side: [w for r in ok if r.side == side for w in r.result["work"] or []] for side in SIDES}
    counts = {side: (min(t), max(t)) if t else None for side, t in tokens.items()}
    print(f"  tokens produced per call: ours {counts['ours']}, generate {counts['generate']} (min, max)")
    if args.stop == "length":
        print(
            f"  difference: none in the tokens decoded (every row decodes {args.max_new_tokens} on both sides); ours "
            "also computes each sampled token's log-prob (the trainer's sampler log-probs), generate does not"
        )
    else:
        total = {side: sum(t) for side, t in tokens.items()}
        print(f"  difference: ours also computes each sampled token's log-prob; both stop rows at EOS, but generate "
              f"decodes finished rows (padded) until the last ends and, once a row has ended, the two draw from "
              f"different random streams; tokens produced over all timed calls: ours {total['ours']}, generate "
              f"{total['generate']} ({total['ours'] - total['generate']:+d}); the ratio is of tokens/s")  # fmt: skip
    protocol.print_calls(runs, unit="tok")
    protocol.print_rounds(runs)
    ratio = protocol.compare(runs, "ours", "generate", protocol.rate, "ours/generate (tok/s)")
    result = (f"{args.model} decoding, stop {args.stop}: ours/generate tok/s {ratio['median']:.2f}x"
              if ratio["per_round"] else f"{args.model} decoding: no ratio (a side failed)")  # fmt: skip
    print("RESULTS.md row:\n" + protocol.results_row(runs, f"-/{args.threads}", result, ratio))


def add_decoding_args(ap: argparse.ArgumentParser, models: str, threads: int, repeats: int) -> None:
    """The options of a benchmark that samples the default GRPO round's rows from one model folder (this one and
    bench_vllm_sync.py), the protocol's, and the hidden ones its side processes get."""
    ap.add_argument("--model", default="tiny", help=f"{models}, a .gguf file or a folder")
    ap.add_argument("--cache-dir", default="~/.cache/grpoflow/models")
    ap.add_argument("--prompts", type=int, default=16, help="prompts a round (the default GRPO round: 16)")
    ap.add_argument("--samples", type=int, default=8, help="completions per prompt (the default GRPO round: 8)")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--stop", default="length", choices=["length", "eos"], help="see above (length)")
    ap.add_argument("--threads", type=int, default=threads, help=f"torch threads of both sides ({threads})")
    ap.add_argument("--repeats", type=int, default=repeats, help="timed calls per side process, after the first")
    ap.add_argument("--seed", type=int, default=0)
    protocol.add_protocol_args(ap)
    for hidden in ("--side", "--folder"):
        ap.add_argument(hidden, help=argparse.SUPPRESS)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_decoding_args(ap, "tiny, 25m, smollm2-135m-instruct", threads=1, repeats=3)
    ap.add_argument("--batch", type=int, default=128, help="rows decoded together")
    args = ap.parse_args()
    if args.side:
        return run_side(args)
    runs = protocol.alternate_on_folder(
        args, list(SIDES), __file__, lambda tmp: build_folder(args.model, args.cache_dir, tmp)
    )
    report(args, runs)


if __name__ == "__main__":
    main()
