"""GRPO training throughput: our trainer vs TRL 1.16's GRPOTrainer, like with like, under the benchmark protocol
(benchmarks/protocol.py, docs/benchmarks.md).

Both train LoRA (r=16, alpha=32, all linear layers) on the same folder, float32, gradient checkpointing off,
16 prompts x 8 generations per optimizer step (per-device batch 32 x 4 accumulation steps, one generation
round per optimizer step in both), up to --completion-len new tokens at temperature 1, the dapo loss, beta 0,
the `correctness` reward on arithmetic prompts with the XML system prompt, and --threads torch threads in
training for both. Samplers, like with like (--sampler):

    transformers   ours: the KV-cached transformers loop (LoRA merged, --gen-threads threads)
                   TRL:  transformers generate on the PEFT model (--threads threads)
    vllm           ours: vLLM's CPU engine in-process (tasks/generation/vllm_engine.py, enforce_eager)
                   TRL:  its own vLLM colocate mode on the same engine (use_vllm=True, vllm_mode="colocate");
                         when it cannot run, its error is printed and the comparison carries on without it

Every side of every round is a fresh process (ours, TRL, ours, TRL, ...; --rounds >= 2), gated on a quiet
machine. Per side and round it reports

    tok/s       completion tokens per second of the training loop (trainer.train())
    first s     process start -> first optimizer step done (imports, loading, engine start, the first step)
    loop s      the training loop; process s: the whole process, spawn to exit (start-up = process - loop)
    gen share   the sampler's share of the loop (decoding, for vLLM with the weight sync)
    train TFLOP/s, MFU   the training half's model FLOPs (tasks/grpo/flops.py) over the loop less generation,
                over this machine's measured float32 matmul peak at --threads (bench_matmul_peak.py)
    dec tok/s, bound   decoding's completion tokens/s against the memory-bandwidth bound: copy bandwidth /
                weight bytes x rows decoded per step (every weight read once per decode step)
    max RSS     the process's peak resident memory

then the per-round ratios ours / TRL of tok/s, their spread, and a row for benchmarks/RESULTS.md.

    python benchmarks/bench_trl_throughput.py --model tiny                      # both samplers
    python benchmarks/bench_trl_throughput.py --model smollm2-135m-instruct --sampler vllm
    python benchmarks/bench_trl_throughput.py --model tiny --steps 2 --rounds 2 --allow-contended   # smoke run
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import protocol  # noqa: E402

SYSTEM = "Respond in the following format:\n<reasoning>\n...\n</reasoning>\n<answer>\n...\n</answer>"
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
PEAK_KEY = {"float32": "fp32_tflops", "bfloat16": "bf16_tflops"}  # bench_matmul_peak.py's keys

SAMPLERS = {
    "transformers": {
        "ours": "grpoflow transformers KV-cached loop (LoRA merged, {gen_threads} decode threads, "
        "generation.compile={compile})",
        "trl": "transformers generate on the PEFT model ({threads} threads)",
    },
    "vllm": {
        "ours": "vLLM CPU engine in-process (grpoflow VLLMGenerator, enforce_eager, merged LoRA sync)",
        "trl": "vLLM CPU engine, TRL colocate (external_launcher, vLLM's default compilation, max 4096 batched tokens)",
    },
}


def arithmetic_rows(n: int, seed: int = 0) -> list[dict]:
    """TRL-style conversational rows: prompt (system + user), answer."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b, op = rng.randint(0, 99), rng.randint(0, 99), rng.choice("+-")
        q = f"What is {a} {op} {b}?"
        rows.append(
            {
                "prompt": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}],
                "question": q,
                "answer": str(a + b if op == "+" else a - b),
            }
        )
    return rows


def model_folder(name: str, cache_dir: str, rows: list[dict], work: Path) -> str:
    """A transformers folder both trainers load: the default tiny model saved once, or a resolved model.name."""
    if name != "tiny":
        from grpoflow.tasks.model.sources import resolve_model

        return resolve_model(name, cache_dir)
    from grpoflow.tasks.config import load_config
    from grpoflow.tasks.model.tiny import build_tiny_model, train_tiny_tokenizer

    cfg = load_config(None, [])
    texts = [t for r in rows for t in (SYSTEM, r["question"], f"<answer>\n{r['answer']}\n</answer>")]
    tok = train_tiny_tokenizer(texts, cfg.model.tiny.vocab_size)
    model = build_tiny_model(cfg.model.tiny, tok, seed=0)
    folder = work / "tiny"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


def lora_config():
    from peft import LoraConfig

    return LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")


def grpo_settings(args, steps: int) -> dict:
    """The GRPO keys both trainers get, by their shared (TRL) names."""
    return dict(
        learning_rate=1e-4,
        max_steps=steps,
        per_device_train_batch_size=32,
        gradient_accumulation_steps=4,
        num_generations=8,
        max_prompt_length=256,
        max_completion_length=args.completion_len,
        temperature=1.0,
        beta=0.0,
        loss_type="dapo",
        save_steps=10**6,
    )


# ------------------------------------------------------------------ the sides (each in its own process)
def side_ours(args, rows: list[dict]) -> dict:
    import torch

    from grpoflow.tasks.config import GenerationConfig, GRPOConfig, ModelConfig
    from grpoflow.tasks.generation.backend import make_generator
    from grpoflow.tasks.grpo.flops import model_shape
    from grpoflow.tasks.grpo.trainer import GRPOTrainer
    from grpoflow.tasks.grpo.trainer_runtime import TrainerRuntime
    from grpoflow.tasks.model.loading import compute_dtype, load_tokenizer, load_trainable, prompt_ids
    from grpoflow.tasks.rewards import resolve_reward_funcs
    from grpoflow.tasks.tracking.tracker import RunLogger

    imports_s = protocol.since_process_start()
    torch.manual_seed(0)
    folder = args.folder
    mcfg = ModelConfig(name=folder, dtype=args.dtype, lora={"r": 16, "alpha": 32, "target_modules": "all-linear"})
    tok = load_tokenizer(folder, mcfg)
    model = load_trainable(folder, mcfg, use_lora=True)  # as the GRPO stage: bf16 -> float32 attention on CPUs
    g = GRPOConfig(**grpo_settings(args, args.steps))
    gen_cfg = GenerationConfig(
        backend=args.sampler, batch_size=128, torch_threads=args.gen_threads, compile=args.compile
    )
    prompts = [prompt_ids(tok, r["prompt"]) for r in rows]
    max_len = max(map(len, prompts)) + g.max_completion_length
    t = time.perf_counter()
    gen = make_generator(gen_cfg, model, tok, model_path=folder, dtype=args.dtype, max_model_len=max_len, seed=0)
    engine_s = time.perf_counter() - t
    funcs = resolve_reward_funcs(["correctness"])
    autocast = compute_dtype(mcfg, use_lora=True)  # bf16: the GRPO stage's autocast over the float32 adapters
    log = RunLogger.disabled()
    rt = TrainerRuntime(model, tok, rows, prompts, funcs, gen, log, Path(args.out), autocast_dtype=autocast)
    trainer = GRPOTrainer(g, rt, seed=0)  # a vLLM sampler: corrected for its drift
    torch.set_num_threads(args.threads)
    loop_start = protocol.since_process_start()
    t = time.perf_counter()
    trainer.train()
    loop_s = time.perf_counter() - t
    if hasattr(gen, "close"):
        gen.close()
    h = trainer.history
    n = g.batching().generation_batch_size
    decode_rows = min(n, gen_cfg.batch_size if args.sampler == "transformers" else gen_cfg.vllm_max_num_seqs)
    return {
        "imports_s": imports_s,
        "engine_start_s": engine_s,
        "first_step_s": loop_start + h[0]["step_time"],
        "loop_s": loop_s,
        "steps": len(h),
        "tokens": sum(x["completions/mean_length"] * n for x in h),
        "gen_s": sum(x["generation_time"] for x in h),
        "train_flops": sum(x["perf/train_flops"] for x in h),
        "train_s": sum(x["perf/train_seconds"] for x in h),
        "decode_rows": decode_rows,
        "weight_bytes": model_shape(model).matmul_params * DTYPE_BYTES[args.dtype],
        "threads": {"train": args.threads, "decode": args.gen_threads if args.sampler == "transformers" else None},
        "reward": sum(x["reward"] for x in h) / len(h),
        # generation.compile: the decode step's compiles (inside gen_s and the loop), reported apart
        "compile_s": decoder.stats.compile_s if (decoder := getattr(gen, "decoder", None)) else 0.0,
        "compiles": decoder.stats.compiles if decoder else 0,
    }


def side_trl(args, rows: list[dict]) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from grpoflow.tasks.grpo.flops import forward_flops, model_shape, train_flops
    from grpoflow.tasks.rewards import correctness

    imports_s = protocol.since_process_start()
    torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(args.folder)

    def n_prompt_tokens(messages) -> int:
        # transformers 5 returns a BatchEncoding (a dict: len() would be its 2 keys), 4.x a list of ids
        enc = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return len(enc["input_ids"] if hasattr(enc, "keys") else enc)

    prompt_len = {r["question"]: n_prompt_tokens(r["prompt"]) for r in rows}
    counted = {"tokens": 0, "lens": [], "rewards": []}

    def correctness_counting(prompts, completions, completion_ids, question, **kwargs):
        counted["tokens"] += sum(len(c) for c in completion_ids)
        counted["lens"] += [prompt_len[q] + len(c) for q, c in zip(question, completion_ids, strict=True)]
        scores = correctness(prompts, completions, question=question, **kwargs)
        counted["rewards"] += [s for s in scores if s is not None]
        return scores

    torch.manual_seed(0)
    # the same precision as ours: a bfloat16 base (peft keeps the adapters float32) computing under TRL's bf16 autocast
    model = AutoModelForCausalLM.from_pretrained(args.folder, dtype=getattr(torch, args.dtype))
    s = grpo_settings(args, args.steps)
    s.pop("max_prompt_length")  # TRL 1.16 has no prompt truncation key; our prompts are far shorter anyway
    s.pop("save_steps")
    vllm = {}
    if args.sampler == "vllm":
        max_len = max(prompt_len.values()) + args.completion_len
        vllm = dict(use_vllm=True, vllm_mode="colocate", vllm_max_model_length=max_len, vllm_enable_sleep_mode=False)
    cfg = GRPOConfig(
        output_dir=args.out, **s, **vllm, use_cpu=True, bf16=args.dtype == "bfloat16", gradient_checkpointing=False,
        report_to=[],
        save_strategy="no", logging_steps=10**6, disable_tqdm=True, seed=0, dataloader_num_workers=0,
    )  # fmt: skip
    t = time.perf_counter()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[correctness_counting],
        args=cfg,
        train_dataset=Dataset.from_list(rows),
        processing_class=tok,
        peft_config=lora_config(),
    )
    engine_s = time.perf_counter() - t if args.sampler == "vllm" else None  # the trainer builds TRL's engine
    gen = {"s": 0.0}
    generate = trainer._generate_single_turn  # TRL's sampling call (vLLM: with its weight sync)

    def timed_generate(*a, **k):
        t = time.perf_counter()
        try:
            return generate(*a, **k)
        finally:
            gen["s"] += time.perf_counter() - t

    trainer._generate_single_turn = timed_generate
    first = {}

    class FirstStep(TrainerCallback):
        def on_step_end(self, *a, **k):
            first.setdefault("s", protocol.since_process_start())

    trainer.add_callback(FirstStep())
    torch.set_num_threads(args.threads)
    t = time.perf_counter()
    trainer.train()
    loop_s = time.perf_counter() - t
    shape = model_shape(trainer.model)
    # TRL's passes: the loss pass (forward + backward) over every completion; with vLLM's importance-sampling
    # correction (on by default) also a forward for the old log-probs of each round
    flops = train_flops(shape, counted["lens"])
    if args.sampler == "vllm" and cfg.vllm_importance_sampling_correction:
        flops += forward_flops(shape, counted["lens"])
    n = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps
    return {
        "imports_s": imports_s,
        "engine_start_s": engine_s,
        "first_step_s": first.get("s"),
        "loop_s": loop_s,
        "steps": args.steps,
        "tokens": counted["tokens"],
        "gen_s": gen["s"],
        "train_flops": flops,
        "train_s": max(loop_s - gen["s"], 0.0),
        "decode_rows": n if args.sampler == "transformers" else min(n, cfg.vllm_max_num_seqs or n),
        "weight_bytes": shape.matmul_params * DTYPE_BYTES[args.dtype],
        "threads": {"train": args.threads, "decode": args.threads if args.sampler == "transformers" else None},
        "reward": sum(counted["rewards"]) / max(len(counted["rewards"]), 1),
    }


def run_side(args) -> None:
    """The child process: one trainer, one round; its result (or its error) as the protocol's JSON line."""
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("vllm").setLevel(logging.ERROR)
    rows = arithmetic_rows(400)
    try:
        res = (side_ours if args.side == "ours" else side_trl)(args, rows)
    except Exception as e:  # the parent prints it and carries on without this side
        import traceback

        traceback.print_exc()
        protocol.emit({"error": f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"})
        raise SystemExit(1) from None
    protocol.emit(res | {"sampler": SAMPLERS[args.sampler][args.side].format(**vars(args))})


# ------------------------------------------------------------------ the parent
def derived(r: dict, peak: dict, dtype: str) -> dict:
    """Rates of one side's round: tok/s, generation share, TFLOP/s, MFU (against the matmul peak of ``dtype``),
    decoding against its bound."""
    loop, gen = r["loop_s"], r["gen_s"]
    train_tflops = r["train_flops"] / r["train_s"] / 1e12 if r["train_s"] > 0 else 0.0
    bound = peak["copy_gbs"] * 1e9 / r["weight_bytes"] * r["decode_rows"] if peak.get("copy_gbs") else 0.0
    dec = r["tokens"] / gen if gen > 0 else 0.0
    return {
        "tok_s": r["tokens"] / loop if loop > 0 else 0.0,
        "gen_share": gen / loop if loop > 0 else 0.0,
        "train_tflops": train_tflops,
        "mfu": train_tflops / peak[key] if peak.get(key := PEAK_KEY[dtype]) else float("nan"),
        "decode_tok_s": dec,
        "decode_bound_tok_s": bound,
        "decode_of_bound": dec / bound if bound else float("nan"),
    }


def measure_peak(args) -> dict:
    if args.peak_json:
        peak = json.loads(args.peak_json.read_text())
        if peak.get("threads") != args.threads:
            raise SystemExit(f"--peak-json {args.peak_json}: measured at {peak.get('threads')} threads, not --threads "
                             f"{args.threads}; the MFU needs the peak at the training thread count")  # fmt: skip
        if peak.get("cpu", protocol.cpu_name()) != protocol.cpu_name():
            raise SystemExit(f"--peak-json {args.peak_json}: measured on a {peak['cpu']}, this machine is a "
                             f"{protocol.cpu_name()}; measure the peak here (drop --peak-json)")  # fmt: skip
        return peak
    script = str(Path(__file__).resolve().parent / "bench_matmul_peak.py")
    run = protocol.spawn("peak", 0, [sys.executable, script, "--emit", "--threads", str(args.threads)], args)
    if run.error:
        print(f"matmul peak: failed ({run.error.splitlines()[-1]}); MFU not computed")
        return {}
    return run.result | {"contended": run.contended}


def compare(args, sampler: str, folder: str, tmp: Path, peak: dict) -> dict:
    runs: list[protocol.SideRun] = []
    for r in range(args.rounds):
        for side in ("ours", "trl"):
            argv = [sys.executable, __file__, "--side", side, "--folder", folder]
            argv += ["--out", str(tmp / f"{sampler}{side}{r}"), "--sampler", sampler, "--steps", str(args.steps)]
            argv += ["--threads", str(args.threads)]
            argv += ["--gen-threads", str(args.gen_threads), "--completion-len", str(args.completion_len)]
            argv += ["--dtype", args.dtype, "--compile", args.compile]
            run = protocol.spawn(side, r, argv, args)
            if not run.error:
                run.result |= derived(run.result, peak, args.dtype)
            runs.append(run)
            d = run.result
            line = f"FAILED {run.error.splitlines()[-1][:300]}" if run.error else (
                f"{d['tokens']:.0f} tokens, loop {d['loop_s']:.1f} s, {d['tok_s']:.1f} tok/s")  # fmt: skip
            print(f"[{sampler}] round {r} {side}: {line}", flush=True)
            if run.error and side == "trl":
                print(f"[{sampler}] TRL's error (stderr tail):\n{run.error}", flush=True)
    return report(args, sampler, runs, peak)


def report(args, sampler: str, runs: list[protocol.SideRun], peak: dict) -> dict:
    ok = [r for r in runs if not r.error]
    peak_flops = (peak.get(PEAK_KEY[args.dtype]) or float("nan")) * 1e3
    print(f"\n== sampler {sampler}: model {args.model}, {args.dtype}, {args.steps} steps a round, {args.rounds} "
          f"alternating rounds, {args.threads} training threads, peak {args.dtype} {peak_flops:.1f} GFLOP/s "
          f"and copy {peak.get('copy_gbs', float('nan'))} GB/s at {args.threads} threads")  # fmt: skip
    named = {side: {r.result["sampler"] for r in ok if r.side == side} for side in ("ours", "trl")}
    for side, names in named.items():
        print(f"  {side} sampler: {', '.join(names) or 'did not run'}")
    diff = "the same vLLM engine, driven differently (see the names)" if sampler == "vllm" else (
        "our own decoding loop against transformers generate (the same transformers model)")  # fmt: skip
    print(f"  difference: {diff}")
    head = (f"{'rnd':>3} {'side':5} {'tok/s':>7} {'first s':>7} {'loop s':>7} {'proc s':>7} {'start s':>7} "
            f"{'gen %':>5} {'TFLOP/s':>8} {'MFU':>6} {'dec tok/s':>9} {'bound':>9} {'of bnd':>6} "
            f"{'RSS MiB':>8}")  # fmt: skip
    print(head)
    for r in ok:
        d = r.result
        print(f"{r.round:3d} {r.side:5} {d['tok_s']:7.1f} {d['first_step_s'] or float('nan'):7.1f} {d['loop_s']:7.1f} "
              f"{r.process_wall_s:7.1f} {r.process_wall_s - d['loop_s']:7.1f} {100 * d['gen_share']:5.1f} "
              f"{d['train_tflops']:8.4f} {d['mfu']:6.1%} {d['decode_tok_s']:9.0f} {d['decode_bound_tok_s']:9.0f} "
              f"{d['decode_of_bound']:6.1%} {r.max_rss_mib:8.0f}")  # fmt: skip
    for r in ok:
        d = r.result
        if d.get("compile_s"):  # generation.compile=on: the compiles sit inside the loop and gen_s; shown apart
            loop, gen = d["loop_s"] - d["compile_s"], d["gen_s"] - d["compile_s"]
            bound = d["tokens"] / gen / d["decode_bound_tok_s"]
            print(f"  round {r.round} {r.side}: {d['compile_s']:.1f} s compiling ({d['compiles']} graph(s)) inside the "
                  f"loop; without it {d['tokens'] / loop:.1f} tok/s, decoding {d['tokens'] / gen:.0f} tok/s "
                  f"({bound:.1%} of bound), {gen / loop:.0%} of the loop")  # fmt: skip
    protocol.print_rounds(runs)
    by_round = {(r.round, r.side): r.result["tok_s"] for r in ok}
    both = [k for k in range(args.rounds) if (k, "ours") in by_round and (k, "trl") in by_round]
    ratio = protocol.ratios([by_round[k, "ours"] for k in both], [by_round[k, "trl"] for k in both])
    if both:
        print(f"ratio ours/TRL (tok/s) per round: {ratio['per_round']}; median {ratio['median']:.2f}x, "
              f"min {ratio['min']:.2f}x, max {ratio['max']:.2f}x, spread {ratio['spread']:.1%}")  # fmt: skip
        result = f"{args.model} {args.dtype} {sampler}: ours/TRL tok/s {ratio['median']:.2f}x"
    else:
        result = f"{args.model} {args.dtype} {sampler}: no ratio (a side failed)"
    threads = f"{args.threads}/{args.gen_threads if sampler == 'transformers' else 'engine'}"
    row = protocol.results_row(runs, threads, result, ratio)
    print("RESULTS.md row:\n" + row)
    return {"sampler": sampler, "runs": protocol.to_json(runs), "ratio": ratio, "row": row, "samplers": named}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="tiny, smollm2-135m-instruct, a .gguf file or a model folder")
    ap.add_argument("--cache-dir", default="~/.cache/grpoflow/models")
    ap.add_argument("--steps", type=int, default=25, help="optimizer steps of each trainer in each round")
    ap.add_argument("--sampler", default="both", choices=["transformers", "vllm", "both"])
    ap.add_argument("--completion-len", type=int, default=32)
    ap.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="the frozen base's dtype on both sides (bfloat16: TRL's bf16=True; LoRA adapters stay float32)",
    )
    ap.add_argument("--threads", type=int, default=2, help="torch threads of both training loops")
    ap.add_argument(
        "--gen-threads", type=int, help="our transformers decoding loop's threads (default: --threads, as the product)"
    )
    ap.add_argument(
        "--compile",
        default="auto",
        choices=["auto", "on", "off"],
        help="ours: generation.compile (auto, the product's default, is off on CPU; on: the compiled static-shape "
        "decode step, its compile time printed apart)",
    )
    ap.add_argument("--peak-json", type=Path, help="a bench_matmul_peak.py --json result to reuse (same threads)")
    ap.add_argument("--json", type=Path, help="write the results here too")
    protocol.add_protocol_args(ap)
    for hidden in ("--side", "--folder", "--out"):
        ap.add_argument(hidden, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.gen_threads is None:
        args.gen_threads = args.threads
    if args.side:
        return run_side(args)
    protocol.check_rounds(args)
    logging.basicConfig(level=logging.WARNING)
    print(f"machine now: {protocol.quiet_now()}, {protocol.machine()}")
    peak = measure_peak(args)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = model_folder(args.model, args.cache_dir, arithmetic_rows(400), Path(tmp))
        for sampler in ("transformers", "vllm") if args.sampler == "both" else (args.sampler,):
            results.append(compare(args, sampler, folder, Path(tmp), peak))
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "peak": peak,
                                         "results": results}, indent=2, default=str))  # fmt: skip


if __name__ == "__main__":
    main()
