"""Generation throughput and GRPO step time: vLLM (co-located, in-process) vs the transformers backend.

Two models built from config, both float32 with LoRA (r=16, all-linear) as in configs/default.yaml:

    tiny   the default pipeline's model (hidden 128, 4 layers, 0.8M parameters)
    25m    hidden 512, 8 layers, 8 heads (head_dim 64), 4 KV heads, MLP 1408 (~24M parameters)

For each model and backend (transformers: the KV-cached sampling loop with LoRA merged on the side;
transformers-unmerged: the same loop through peft's LoRA layers; vLLM with LoRA synced as merged
weights; vLLM serving the adapter itself) the script measures, in one run so that ratios are
meaningful on a noisy shared host:

    gen tok/s   completion tokens per second of one generation round of the default config
                (16 prompts x 8 samples, up to 32 new tokens, temperature 1), median of --repeats rounds
                that visit the backends in turn (all engines alive at once), so a load burst hits each
    step s      GRPO step time (generate + score + old log-probs + 2 micro-batches + optimizer step)
                with the default grpo settings, median over --steps steps after one warm-up step
    sync ms     vLLM only: time to push the trained weights into the engine, median per sync

Engine start-up (vLLM, 10-30 s; the first generate with log-probs also compiles a helper once per
machine) is excluded from all three and printed separately.

    python benchmarks/bench_generation.py              # both models (a few minutes on 2 cores)
    python benchmarks/bench_generation.py --models tiny --steps 2
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
from pathlib import Path

MODELS = {
    "tiny": dict(
        hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2
    ),
    "25m": dict(
        hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4
    ),
}
BACKENDS = ("transformers", "transformers-unmerged", "vllm-merge", "vllm-adapter")


def rows_and_texts(n: int = 400):
    """Arithmetic prompts in the default config's format, and the text the tokenizer is trained on."""
    import random

    rng = random.Random(0)
    system = "Think in <reasoning></reasoning>, then give the number in <answer></answer>."
    rows, texts = [], []
    for _ in range(n):
        a, b, op = rng.randint(0, 19), rng.randint(0, 19), rng.choice("+-")
        ans = str(a + b if op == "+" else a - b)
        q = f"What is {a} {op} {b}?"
        rows.append({"prompt": [{"role": "system", "content": system}, {"role": "user", "content": q}], "answer": ans})
        texts += [system, q, f"<reasoning>\n{a} {op} {b} = {ans}\n</reasoning>\n<answer>\n{ans}\n</answer>"]
    return rows, texts


def make_generator(backend, model_dir, tok, prompts):
    """A fresh LoRA model (r=16, all-linear, as the default config) and its generator; start-up seconds."""
    import torch

    from grpoflow.tasks.config import GenerationConfig, ModelConfig
    from grpoflow.tasks.generation.transformers_loop import TransformersGenerator
    from grpoflow.tasks.model.loading import add_lora, load_causal_lm

    torch.manual_seed(0)
    lora = ModelConfig(lora={"target_modules": "all-linear"}).lora
    model = add_lora(load_causal_lm(str(model_dir), ModelConfig()), lora)
    t0 = time.perf_counter()
    if backend.startswith("transformers"):  # -unmerged: LoRA applied as three matmuls per layer while decoding
        gen = TransformersGenerator(model, tok, batch_size=64, merge_lora=backend == "transformers")
    else:
        from grpoflow.tasks.generation.vllm_engine import VLLMGenerator

        cfg = GenerationConfig(vllm_lora_sync=backend.split("-")[1], vllm_max_num_seqs=128)
        gen = VLLMGenerator(model, tok, str(model_dir), cfg, max_model_len=max(map(len, prompts)) + 32, seed=0)
    return model, gen, time.perf_counter() - t0


def grpo_steps(model, gen, tok, rows, prompts, gcfg, steps: int) -> dict:
    """Median step time over ``steps`` GRPO steps after a warm-up step; vLLM: sync time and log-prob gap."""
    from grpoflow.tasks.grpo.trainer import GRPOTrainer
    from grpoflow.tasks.grpo.trainer_runtime import TrainerRuntime
    from grpoflow.tasks.rewards import resolve_reward_funcs
    from grpoflow.tasks.runtime.tracking import RunLogger

    with tempfile.TemporaryDirectory() as ckpt:
        funcs = resolve_reward_funcs(gcfg.reward_funcs)
        rt = TrainerRuntime(model, tok, rows, prompts, funcs, gen, RunLogger.disabled(), Path(ckpt))
        trainer = GRPOTrainer(gcfg.model_copy(update={"max_steps": steps + 1, "save_steps": 10**6}), rt, seed=0)
        sync_before = (getattr(gen, "sync_seconds", 0.0), getattr(gen, "syncs", 0))
        trainer.train()
    res = {"step_s": statistics.median(h["step_time"] for h in trainer.history[1:])}
    if hasattr(gen, "syncs"):
        res["sync_ms"] = 1e3 * (gen.sync_seconds - sync_before[0]) / max(gen.syncs - sync_before[1], 1)
        res["logp_gap"] = trainer.history[-1].get("sampling/sampling_logp_difference/max", float("nan"))
    return res


def run_model(name, model_dir, tok, rows, prompts, gcfg, args) -> dict[str, dict]:
    """Generation rounds interleaved over the backends (so load bursts hit all), then GRPO steps."""
    from grpoflow.tasks.generation.types import SamplingParams

    params = SamplingParams.from_grpo(gcfg)
    batch = prompts[: gcfg.batching().unique_prompts]
    made = {b: make_generator(b, model_dir, tok, prompts) for b in args.backends}
    res = {b: {"startup": made[b][2], "rates": []} for b in args.backends}
    for b in args.backends:
        made[b][1].generate(batch, gcfg.num_generations, params)  # warm-up (vLLM: compiles its log-prob helper)
    for _ in range(args.repeats):
        for b in args.backends:
            t = time.perf_counter()
            out = made[b][1].generate(batch, gcfg.num_generations, params)
            res[b]["rates"].append(sum(map(len, out.completion_ids)) / (time.perf_counter() - t))
    for b in args.backends:
        model, gen, _ = made[b]
        res[b].update(grpo_steps(model, gen, tok, rows, prompts, gcfg, args.steps))
        res[b]["tok_s"] = statistics.median(res[b].pop("rates"))
        print(f"  {name} {b}: {res[b]}", flush=True)
    for _, gen, _ in made.values():  # only now: closing one engine tears down vLLM's process-wide state
        if hasattr(gen, "close"):
            gen.close()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=list(BACKENDS))
    ap.add_argument("--repeats", type=int, default=3, help="timed generation rounds per backend")
    ap.add_argument("--steps", type=int, default=2, help="timed GRPO steps (after one warm-up step)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("vllm").setLevel(logging.ERROR)

    import torch

    from grpoflow.tasks.config import DEFAULT_CONFIG, TinyModelConfig, load_config
    from grpoflow.tasks.model.loading import prompt_ids
    from grpoflow.tasks.model.tiny import build_tiny_model, train_tiny_tokenizer

    gcfg = load_config(DEFAULT_CONFIG).grpo
    rows, texts = rows_and_texts()
    tok = train_tiny_tokenizer(texts, 384)
    prompts = [prompt_ids(tok, r["prompt"], gcfg.max_prompt_length) for r in rows]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; default grpo batch: "
          f"{gcfg.batching().unique_prompts} prompts x {gcfg.num_generations} samples, "
          f"<= {gcfg.max_completion_length} new tokens")  # fmt: skip
    table = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            model = build_tiny_model(TinyModelConfig(**MODELS[name]), tok, seed=0)
            n_params = sum(p.numel() for p in model.parameters())
            model_dir = Path(tmp) / name
            model.save_pretrained(model_dir)
            tok.save_pretrained(model_dir)
            for backend, r in run_model(name, model_dir, tok, rows, prompts, gcfg, args).items():
                table.append((f"{name} ({n_params / 1e6:.1f}M)", backend, r))
    print("\n| model | backend | gen tok/s | GRPO step s | sync ms | max logp gap | start-up s |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for model_name, backend, r in table:
        sync = f"{r['sync_ms']:.1f}" if "sync_ms" in r else "-"
        gap = f"{r['logp_gap']:.1e}" if "logp_gap" in r else "-"
        print(
            f"| {model_name} | {backend} | {r['tok_s']:.0f} | {r['step_s']:.2f} | {sync} | {gap} | {r['startup']:.1f} |"
        )


if __name__ == "__main__":
    main()
