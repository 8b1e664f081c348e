"""GRPO training throughput: our trainer vs TRL 1.16's GRPOTrainer, same model folder, prompts and settings.

Both train LoRA (r=16, alpha=32, all linear layers) on the same folder, float32, gradient checkpointing off,
16 prompts x 8 generations per optimizer step (per-device batch 32 x 4 accumulation steps, one generation
round per optimizer step in both), up to --completion-len new tokens at temperature 1, the dapo loss, beta 0,
the `correctness` reward on arithmetic prompts with the XML system prompt, and the same torch thread count.
They run in alternating rounds (ours, TRL, ours, TRL, ...; each round a fresh trainer of --steps / --rounds
optimizer steps from the same start), so a load burst on a shared host hits both. For each it prints

    tok/s     completion tokens generated per second of the training loop (trainer.train(): generation,
              scoring, log-probs, backward, optimizer), summed over its rounds
    s/step    seconds per optimizer step

and the ratio ours / TRL. Model loading and engine start-up are outside the timed loop for both.

    python benchmarks/bench_trl_throughput.py --model tiny                      # the default tiny model
    python benchmarks/bench_trl_throughput.py --model smollm2-135m-instruct     # the real model (fetched once)
    python benchmarks/bench_trl_throughput.py --model PATH --steps 50 --rounds 2 --ours-backend vllm
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import tempfile
import time
from pathlib import Path

SYSTEM = "Respond in the following format:\n<reasoning>\n...\n</reasoning>\n<answer>\n...\n</answer>"


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


def run_ours(folder: str, rows: list[dict], steps: int, args, out: Path) -> dict:
    import torch

    from grpoflow.tasks.config import GenerationConfig, GRPOConfig, ModelConfig
    from grpoflow.tasks.generation.backend import make_generator
    from grpoflow.tasks.grpo.trainer import GRPOTrainer
    from grpoflow.tasks.model.loading import add_lora, load_causal_lm, load_tokenizer, prompt_ids
    from grpoflow.tasks.rewards import resolve_reward_funcs
    from grpoflow.tasks.runtime.tracking import RunLogger

    torch.manual_seed(0)
    mcfg = ModelConfig(name=folder, lora={"r": 16, "alpha": 32, "target_modules": "all-linear"})
    tok = load_tokenizer(folder, mcfg)
    model = add_lora(load_causal_lm(folder, mcfg), mcfg.lora)
    g = GRPOConfig(**grpo_settings(args, steps))
    gen_cfg = GenerationConfig(backend=args.ours_backend, batch_size=128, torch_threads=args.gen_threads)
    prompts = [prompt_ids(tok, r["prompt"]) for r in rows]
    max_len = max(map(len, prompts)) + g.max_completion_length
    gen = make_generator(gen_cfg, model, tok, model_path=folder, max_model_len=max_len, seed=0)
    trainer = GRPOTrainer(
        g, model, tok, rows, prompts, resolve_reward_funcs(["correctness"]), gen, RunLogger.disabled(), out,
        seed=0, is_correction=g.vllm_importance_sampling_correction and gen.separate_engine,
    )  # fmt: skip
    t = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - t
    if hasattr(gen, "close"):
        gen.close()
    n = g.batching().generation_batch_size
    tokens = sum(h["completions/mean_length"] * n for h in trainer.history)
    return {"seconds": seconds, "tokens": tokens, "steps": steps}


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


def run_trl(folder: str, rows: list[dict], steps: int, args, out: Path) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from grpoflow.tasks.rewards import correctness

    counted = {"tokens": 0}

    def correctness_counting(prompts, completions, completion_ids, **kwargs):
        counted["tokens"] += sum(len(c) for c in completion_ids)
        return correctness(prompts, completions, **kwargs)

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    s = grpo_settings(args, steps)
    s.pop("max_prompt_length")  # TRL 1.16 has no prompt truncation key; our prompts are far shorter anyway
    s.pop("save_steps")
    cfg = GRPOConfig(
        output_dir=str(out),
        **s,
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        report_to=[],
        save_strategy="no",
        logging_steps=10**6,
        disable_tqdm=True,
        seed=0,
        dataloader_num_workers=0,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[correctness_counting],
        args=cfg,
        train_dataset=Dataset.from_list(rows),
        processing_class=tok,
        peft_config=lora_config(),
    )
    t = time.perf_counter()
    trainer.train()
    return {"seconds": time.perf_counter() - t, "tokens": counted["tokens"], "steps": steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="tiny, smollm2-135m-instruct, a .gguf file or a model folder")
    ap.add_argument("--cache-dir", default="~/.cache/grpoflow/models")
    ap.add_argument("--steps", type=int, default=50, help="optimizer steps of each trainer, over all its rounds")
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds per trainer")
    ap.add_argument("--completion-len", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2, help="torch threads of both training loops")
    ap.add_argument("--gen-threads", type=int, default=1, help="our transformers decoding loop's threads")
    ap.add_argument("--ours-backend", default="transformers", choices=["transformers", "vllm"])
    ap.add_argument("--json", type=Path, help="write the results here too")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("vllm").setLevel(logging.ERROR)
    import torch

    torch.set_num_threads(args.threads)
    rows = arithmetic_rows(400)
    per_round = max(1, args.steps // args.rounds)
    res: dict[str, list[dict]] = {"ours": [], "trl": []}
    with tempfile.TemporaryDirectory() as tmp:
        folder = model_folder(args.model, args.cache_dir, rows, Path(tmp))
        for r in range(args.rounds):
            for name, fn in (("ours", run_ours), ("trl", run_trl)):
                out = Path(tmp) / f"{name}{r}"
                res[name].append(fn(folder, rows, per_round, args, out))
                torch.set_num_threads(args.threads)  # whatever either trainer changed
                d = res[name][-1]
                print(f"round {r} {name}: {d['tokens']:.0f} tokens, {d['seconds']:.1f} s", flush=True)
    summary = {}
    for name, rounds in res.items():
        sec = sum(d["seconds"] for d in rounds)
        summary[name] = {
            "tok_s": sum(d["tokens"] for d in rounds) / sec,
            "s_per_step": sec / sum(d["steps"] for d in rounds),
        }
    ratio = summary["ours"]["tok_s"] / summary["trl"]["tok_s"]
    print(f"\nmodel {args.model}, {per_round * args.rounds} steps each, {args.rounds} alternating rounds")
    print(f"{'trainer':8} {'tok/s':>8} {'s/step':>8}")
    for name, d in summary.items():
        print(f"{name:8} {d['tok_s']:8.1f} {d['s_per_step']:8.2f}")
    print(f"ratio ours/TRL (tok/s): {ratio:.2f}x")
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "rounds": res,
                                         "summary": summary, "ratio": ratio}, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
