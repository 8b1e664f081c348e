"""Decoding throughput: our transformers sampling loop against transformers ``model.generate``, like with like, under
the benchmark protocol (benchmarks/protocol.py, docs/benchmarks.md).

    ours       tasks/generation/transformers_loop.py ``sample`` as the GRPO sampler calls it: each distinct prompt of
               a batch prefilled once and its KV cache copied to its rows, then a plain loop of the model's forward
               with the cache written in place (tasks/generation/kv_cache.py); rows that emitted EOS leave the
               batch; it also computes each sampled token's log-prob (the trainer needs them), which generate does
               not
    compiled   the same sampling through the compiled static-shape step (``generation.compile``,
               tasks/generation/static_decode.py): a StaticCache of the bucketed prompt width + the new tokens,
               finished rows masked instead of dropped, the draws' noise made ahead; its first call compiles
               (reported apart: compile s, graphs), the timed calls reuse the compiled step
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

Decoding against its roofs: "of bound" is tok/s over the memory-bandwidth bound (copy bandwidth / weight bytes x
rows decoded per step: each step reads every weight once, docs/benchmarks.md) and "of FLOP roof" over the float32
GEMM peak / (2 x matmul weights) (each token costs 2 FLOPs per weight), both measured at ``--threads`` in the
parent before the rounds (bench_matmul_peak.py's functions) or read from ``--peak-json``. Whichever roof is lower
is the one a side can approach: at 128 rows the tiny model and SmolLM2-135M are compute-bound on this CPU.

Each side of each round is a fresh process (ours, generate, ours, generate, ...; ``--rounds`` >= 2), gated on a
quiet machine; it reports its set-up (imports, loading) and first call (warm-up) apart from the ``--repeats``
timed calls, the first call's memory peak, and its process's wall time and max RSS. Then the per-round ratios
ours / generate of tokens/s with their spread, and a row for benchmarks/RESULTS.md.

    python benchmarks/bench_generation.py                     # the default tiny model, 128 rows x 32 tokens
    python benchmarks/bench_generation.py --model 25m --threads 2
    python benchmarks/bench_generation.py --model smollm2-135m-instruct --prompts 4 --samples 8 --batch 32
    python benchmarks/bench_generation.py --sides compiled ours      # without generate
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
SIDES = ("compiled", "ours", "generate")
NAMES = {
    "compiled": "grpoflow static_decode.CompiledDecoder (torch.compile'd static-shape step, generation.compile=on)",
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

    from grpoflow.tasks.generation.static_decode import CompiledDecoder
    from grpoflow.tasks.generation.transformers_loop import distinct_prompts, sample
    from grpoflow.tasks.generation.types import left_pad
    from grpoflow.tasks.grpo.flops import model_shape
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
    decoder = CompiledDecoder()

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
            if args.side in ("ours", "compiled"):
                decode = sample if args.side == "ours" else decoder.sample
                _, _, lengths, _ = decode(model, u_ids, u_mask, p, eos, prompt_rows=index)
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

    call.decoder = decoder
    call.matmul_params = model_shape(model).matmul_params
    return call


def run_side(args) -> None:
    def measure() -> dict:
        made = []
        res = protocol.measure_calls(lambda: made.append(setup_side(args)) or made[0], args.repeats, args.threads)
        stats = made[0].decoder.stats
        return res | {
            "sampler": NAMES[args.side],
            "sampling": repr(sampling(args)),
            "weight_bytes": made[0].matmul_params * 4,  # float32
            "matmul_params": made[0].matmul_params,
            "compile_s": round(stats.compile_s, 2),
            "graphs": stats.compiles,
        }

    protocol.side_main(measure)


def roofs(args) -> dict:
    """Copy bandwidth (bytes/s) and float32 GEMM peak (FLOP/s) at --threads: from --peak-json, else measured here
    (bench_matmul_peak.py's functions: a 512 MiB copy, 1024^2 GEMMs for 1 s)."""
    import json

    import torch
    from bench_matmul_peak import copy_bandwidth, gemm_rate

    if args.peak_json:
        peak = json.loads(Path(args.peak_json).read_text())
        if peak.get("threads") != args.threads:
            raise SystemExit(f"--peak-json {args.peak_json}: measured at {peak.get('threads')} threads, not --threads "
                             f"{args.threads}")  # fmt: skip
        return {"copy_Bps": peak["copy_gbs"] * 1e9, "flops": peak["fp32_tflops"] * 1e12}
    before = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return {"copy_Bps": copy_bandwidth(512), "flops": gemm_rate(1024, torch.float32, 1.0)}
    finally:
        torch.set_num_threads(before)


def print_roofs(args, runs: list[protocol.SideRun], roof: dict) -> list[str]:
    """Each side's median tok/s against the bandwidth bound and the FLOP roof, and its compile time; returns the
    per-side summaries for the results row."""
    ok = [r for r in runs if not r.error]
    if not ok:
        return []
    r0 = ok[0].result
    rows = min(args.batch, args.prompts * args.samples)
    bound = roof["copy_Bps"] / r0["weight_bytes"] * rows
    flop_roof = roof["flops"] / (2 * r0["matmul_params"])
    print(f"\n== roofs at {args.threads} threads: copy {roof['copy_Bps'] / 1e9:.1f} GB/s, float32 GEMM "
          f"{roof['flops'] / 1e9:.0f} GFLOP/s; {r0['matmul_params'] / 1e6:.2f}M matmul weights "
          f"({r0['weight_bytes'] / 2**20:.1f} MiB), {rows} rows a step: bandwidth bound {bound:.0f} tok/s, "
          f"FLOP roof {flop_roof:.0f} tok/s")  # fmt: skip
    summary = []
    for side in SIDES:
        rates = [protocol.rate(r.result) for r in ok if r.side == side]
        rates = [x for x in rates if x]
        if not rates:
            continue
        med = sorted(rates)[len(rates) // 2]
        mine = [r.result for r in ok if r.side == side]
        comp = ""
        if side == "compiled":
            comp = (f", compile {min(d['compile_s'] for d in mine):.1f}-{max(d['compile_s'] for d in mine):.1f} s "
                    f"({max(d['graphs'] for d in mine)} graph(s) a process, first call "
                    f"{min(d['first_call_s'] for d in mine):.1f} s)")  # fmt: skip
        line = f"{side} {med:.0f} tok/s = {med / bound:.1%} of bound, {med / flop_roof:.1%} of FLOP roof{comp}"
        print("  " + line)
        summary.append(line)
    return summary


def report(args, runs: list[protocol.SideRun], roof: dict) -> None:
    ok = [r for r in runs if not r.error]
    rows = args.prompts * args.samples
    print(f"\n== decoding: model {args.model}, {rows} rows ({args.prompts} prompts x {args.samples}) in batches of "
          f"{args.batch}, <= {args.max_new_tokens} new tokens, stop {args.stop}, {args.threads} torch threads on "
          f"both sides, {args.repeats} timed calls a process, {args.rounds} alternating rounds")  # fmt: skip
    for side in args.sides:
        print(f"  {side}: {NAMES[side]}")
    if ok:
        print(f"  sampling (both): {ok[0].result['sampling']}")
    tokens = {side: [w for r in ok if r.side == side for w in r.result["work"] or []] for side in args.sides}
    counts = {side: (min(t), max(t)) if t else None for side, t in tokens.items()}
    print(f"  tokens produced per call (min, max): {counts}")
    if args.stop == "length":
        print(
            f"  difference: none in the tokens decoded (every row decodes {args.max_new_tokens} on both sides); ours "
            "also computes each sampled token's log-prob (the trainer's sampler log-probs), generate does not"
        )
    else:
        total = {side: sum(t) for side, t in tokens.items()}
        print(f"  difference: ours also computes each sampled token's log-prob; all stop rows at EOS, but generate "
              f"decodes finished rows (padded) until the last ends, and once a row has ended the sides draw from "
              f"different random streams; tokens produced over all timed calls: {total}; the ratio is of "
              f"tokens/s")  # fmt: skip
    protocol.print_calls(runs, unit="tok")
    protocol.print_rounds(runs)
    summary = print_roofs(args, runs, roof)
    pairs = [(a, b) for a, b in (("compiled", "ours"), ("ours", "generate"), ("compiled", "generate"))
             if a in args.sides and b in args.sides]  # fmt: skip
    ratios = {(a, b): protocol.compare(runs, a, b, protocol.rate, f"{a}/{b} (tok/s)") for a, b in pairs}
    head, ratio = next(iter(ratios.items()), ((None, None), {"per_round": []}))
    parts = [f"{a}/{b} tok/s {r['median']:.2f}x" for (a, b), r in ratios.items() if r["per_round"]]
    result = (f"{args.model} decoding, {args.prompts * args.samples} rows x {args.max_new_tokens} tokens, stop "
              f"{args.stop}: {', '.join(parts) or 'no ratio (a side failed)'}; {'; '.join(summary)}")  # fmt: skip
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
    ap.add_argument("--sides", nargs="+", choices=SIDES, default=list(SIDES), help="sides to run, in this order")
    ap.add_argument("--peak-json", help="a bench_matmul_peak.py --json result at --threads (else measured here)")
    args = ap.parse_args()
    if args.side:
        return run_side(args)
    roof = roofs(args)
    runs = protocol.alternate_on_folder(
        args, list(args.sides), __file__, lambda tmp: build_folder(args.model, args.cache_dir, tmp)
    )
    report(args, runs, roof)


if __name__ == "__main__":
    main()
