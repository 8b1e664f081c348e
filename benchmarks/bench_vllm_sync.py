"""The vLLM backend's two ways of following a LoRA model, like with like, under the benchmark protocol
(benchmarks/protocol.py, docs/benchmarks.md): ``generation.vllm_lora_sync`` merge (the default) against adapter.

    merge      before each round whose weights changed, stream W + scale * B @ A of every LoRA layer (computed on the
               side) and the other weights into the engine, which then decodes a plain model
    adapter    the base weights once; before each such round, hand the engine the adapter's A and B tensors
               (a fresh in-memory adapter), which it applies with its LoRA kernels while decoding

One timed call is what a GRPO round asks of the sampler: the adapter's B matrices move (as an optimizer step moves
them: a small seeded update, the same on both sides), then ``--prompts`` prompts are sampled ``--samples`` times
each through ``VLLMGenerator.generate`` (tasks/generation/vllm_engine.py), which syncs first. Both sides load the
same model folder with the same LoRA (the default config's), draw the same seeds, and use the default config's GRPO
sampling settings with ``--max-new-tokens``; ``--stop length`` (default) decodes every row to the limit on both
sides, so both produce the same tokens count; ``eos`` stops rows at EOS (the two then differ in what they sample:
both counts are printed). The engine's start is set-up, reported apart; the sync's own seconds per call are
printed beside the call's.

    python benchmarks/bench_vllm_sync.py                      # the default tiny model, 128 rows x 32 tokens
    python benchmarks/bench_vllm_sync.py --model smollm2-135m-instruct --rounds 2
    python benchmarks/bench_vllm_sync.py --prompts 2 --samples 2 --max-new-tokens 4 --repeats 1 \\
        --allow-contended --wait 0                                       # smoke run: checks the fields only
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import protocol  # noqa: E402
from bench_generation import add_decoding_args, sampling  # noqa: E402
from bench_trl_throughput import arithmetic_rows, model_folder  # noqa: E402

SIDES = ("merge", "adapter")
NAMES = {
    "merge": "generation.vllm_lora_sync=merge: merged weights streamed in, a plain model decodes",
    "adapter": "generation.vllm_lora_sync=adapter: the adapter's tensors handed over, vLLM's LoRA kernels decode",
}


def setup_side(args, stats: dict):
    """The engine for ``args.side`` over the LoRA model; returns the timed call (one round: move B, sample)."""
    import torch

    from grpoflow.tasks.config import GenerationConfig, load_config
    from grpoflow.tasks.generation.backend import make_generator
    from grpoflow.tasks.model.loading import load_tokenizer, load_trainable, prompt_ids

    mcfg = load_config(None, []).model.model_copy(update={"name": args.folder})
    tok = load_tokenizer(args.folder, mcfg)
    torch.manual_seed(0)  # the LoRA's initial A: the same on both sides
    model = load_trainable(args.folder, mcfg, use_lora=True)
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    prompts = [prompt_ids(tok, r["prompt"]) for r in arithmetic_rows(args.prompts, seed=3)]
    p = sampling(args)
    gen_cfg = GenerationConfig(backend="vllm", vllm_lora_sync=args.side, vllm_max_num_seqs=args.prompts * args.samples)
    max_len = max(map(len, prompts)) + args.max_new_tokens
    gen = make_generator(gen_cfg, model, tok, model_path=args.folder, max_model_len=max_len, seed=0)
    if args.stop == "length":  # every row decodes --max-new-tokens: vLLM's own EOS stop off, ours too
        from grpoflow.tasks.generation import vllm_engine

        plain = vllm_engine.sampling_kwargs
        vllm_engine.sampling_kwargs = lambda *a: plain(*a) | {"ignore_eos": True, "stop_token_ids": []}
    step = torch.Generator().manual_seed(1)
    calls = {"n": 0}

    @torch.no_grad()
    def call() -> int:
        for b in lora_b:  # an optimizer step's move of the adapter (B starts at zero: the first makes it nonzero)
            b.add_(torch.randn(b.shape, generator=step) * 1e-3)
        torch.manual_seed(args.seed + calls["n"])  # the generator draws its request seeds from torch's RNG
        calls["n"] += 1
        synced, syncs = gen.sync_seconds, gen.syncs
        out = gen.generate(prompts, args.samples, p)
        stats["sync_s"].append(round(gen.sync_seconds - synced, 5))
        stats["syncs"] += gen.syncs - syncs
        return sum(len(c) for c in out.completion_ids)

    stats["close"] = gen.close
    return call


def run_side(args) -> None:
    def measure() -> dict:
        stats = {"sync_s": [], "syncs": 0}
        res = protocol.measure_calls(lambda: setup_side(args, stats), args.repeats, args.threads)
        stats.pop("close")()
        # sync_s: the first (warm-up) call's, then each timed call's
        return res | {"sync_s": stats["sync_s"], "syncs": stats["syncs"], "sampler": NAMES[args.side]}

    logging.getLogger("vllm").setLevel(logging.ERROR)
    protocol.side_main(measure)


def report(args, runs: list[protocol.SideRun]) -> None:
    ok = [r for r in runs if not r.error]
    rows = args.prompts * args.samples
    print(f"\n== vLLM LoRA sync: model {args.model}, a round = the adapter moves, then {rows} rows ({args.prompts} "
          f"prompts x {args.samples}) sampled, <= {args.max_new_tokens} new tokens, stop {args.stop}; "
          f"{args.threads} torch threads, {args.repeats} timed rounds a process, {args.rounds} alternating "
          f"rounds")  # fmt: skip
    for side in SIDES:
        print(f"  {side}: {NAMES[side]}")
    tokens = {side: [w for r in ok if r.side == side for w in r.result["work"] or []] for side in SIDES}
    print(
        f"  tokens produced per call: merge {min(tokens['merge'], default=None)}-{max(tokens['merge'], default=None)}"
        f", adapter {min(tokens['adapter'], default=None)}-{max(tokens['adapter'], default=None)}"
        + ("" if args.stop == "length" else " (stop at EOS: the sides sample differently, the ratio is of tok/s)")
    )
    print(f"\n{'round':>5} {'side':8} {'syncs':>5} {'sync s (first; timed)':>30} {'round s (median)':>16}")
    for r in ok:
        s = r.result["sync_s"]
        timed = ", ".join(f"{x:.3f}" for x in s[1:])
        print(f"{r.round:5d} {r.side:8} {r.result['syncs']:5d} {f'{s[0]:.3f}; {timed}':>30} "
              f"{r.result['median_s']:16.3f}")  # fmt: skip
    protocol.print_calls(runs, unit="tok")
    protocol.print_rounds(runs)
    ratio = protocol.compare(runs, "merge", "adapter", protocol.rate, "merge/adapter (tok/s of whole rounds)")
    result = (f"{args.model} vLLM rounds (sync + sampling): merge/adapter tok/s {ratio['median']:.2f}x"
              if ratio["per_round"] else f"{args.model} vLLM sync: no ratio (a side failed)")  # fmt: skip
    print("RESULTS.md row:\n" + protocol.results_row(runs, f"{args.threads}/engine", result, ratio))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_decoding_args(ap, "tiny, smollm2-135m-instruct", threads=2, repeats=5)
    args = ap.parse_args()
    if args.side:
        return run_side(args)
    runs = protocol.alternate_on_folder(
        args, list(SIDES), __file__, lambda tmp: model_folder(args.model, args.cache_dir, arithmetic_rows(400), tmp)
    )
    report(args, runs)


if __name__ == "__main__":
    main()
