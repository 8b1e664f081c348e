"""The GPU check, one command: the log-prob kernels side by side, then GRPO on the device through grpoflow's trainer.

Prepared on a CPU machine for a GPU one (one H200: under 8 minutes). It imports only torch, transformers, peft,
triton, pydantic and grpoflow's own modules (no vLLM, Prefect, MLflow, datasets or bitsandbytes: a GPU machine may
have none of them), writes --out (JSON) and prints two tables.

1. kernel: per-token log-probs forward + backward (dH; --train-head adds dW) at N x D x V in bf16 (float32 with
   --small on CPU), every case against a float32 reference computed from the same inputs:
       naive        H W^T, log_softmax in float32 (kernels.logprobs.token_logprobs_reference)
       triton       kernels/triton_logprobs.py (what GRPO uses on CUDA: token_logprobs impl="auto")
       chunked      the chunked torch path (what GRPO uses on CPU)
       trl_chunked  TRL 1.16's ChunkedLogProbFunction (trl/kernels/chunked_logprob.py)
       trl_triton   materialized logits + TRL's Triton log-softmax/entropy kernel (trl/kernels/logprob_entropy.py)
       liger        Liger-Kernel's LigerFusedLinearGRPOLoss (beta 0): log-probs fused with the GRPO loss
       bare         the two GEMMs the math needs and nothing else: Z = H W^T, then Z W (the dH GEMM); the floor
                    that says whether a kernel is compute or memory bound
   A peer whose package is missing or fails (trl, liger-kernel: small wheels, carry them) is reported, not fatal.
   Columns: max |logp - ref|, max |dH - ref| / max |ref|, median seconds, peak memory above the inputs (CUDA).
2. grpo: grpoflow's GRPOTrainer on the device, generation with the transformers backend:
       tiny   the built-in task's shape (0.8M-parameter model, arithmetic prompts, the default rewards), from a
              short SFT warm-up, for --tiny-steps optimizer steps: first and last reward
       qwen   a model of Qwen2.5-0.5B's shape built from config (random weights), bf16 base + float32 LoRA r16
              on all linear layers, --qwen-steps steps
   Columns: median step seconds, tokens/s (prompt + completion tokens of the rounds), peak memory, and whether
   every parameter, gradient, optimizer state and round tensor stayed on the device.

    python benchmarks/gpu_check.py                                   # a GPU machine
    python benchmarks/gpu_check.py --device cpu --small --out x.json # the same code on CPU, toy sizes (a test)

On CPU the triton case needs TRITON_INTERPRET=1 (the test sets it) and is skipped otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


def _grpoflow_from_the_tree() -> None:
    """A bare checkout (the GPU machine gets the working tree, not an install): expose its flows/, tasks/ and
    kernels/ folders as grpoflow.* through a folder of symlinks, as pyproject's package-dir does when installed."""
    try:
        import grpoflow.tasks  # noqa: F401
    except ImportError:
        root = Path(__file__).resolve().parents[1]
        shim = Path(tempfile.mkdtemp()) / "grpoflow"
        shim.mkdir()
        for name in ("flows", "tasks", "kernels", "configs"):
            (shim / name).symlink_to(root / name)
        sys.path.insert(0, str(shim.parent))
        for name in [m for m in sys.modules if m == "grpoflow" or m.startswith("grpoflow.")]:
            del sys.modules[name]


_grpoflow_from_the_tree()

KERNEL_CASES = ("naive", "triton", "chunked", "trl_chunked", "trl_triton", "liger", "bare")
OURS = ("naive", "triton", "chunked")  # an error in one of these fails the check; a peer's is reported
TRL_VOCAB_CHUNK = 32768  # trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE in TRL 1.16


# ---------------------------------------------------------------------------------------------- kernel
def kernel_logprobs(case: str, h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """logp [N] of ``case`` with autograd (entropy computed where the implementation offers it, as GRPO asks)."""
    from grpoflow.kernels.logprobs import token_logprobs, token_logprobs_reference

    if case == "naive":
        return token_logprobs_reference(h, w, y)[0]
    if case in ("triton", "chunked"):
        return token_logprobs(h, w, y, compute_entropy=True, impl=case)[0]
    if case == "trl_chunked":
        from trl.kernels.chunked_logprob import ChunkedLogProbFunction

        return ChunkedLogProbFunction.apply(h, w, None, y, 1.0, TRL_VOCAB_CHUNK, None, 1.0, ("entropy",))[0]
    if case == "trl_triton":
        from trl.kernels.logprob_entropy import selective_log_softmax_and_entropy

        return selective_log_softmax_and_entropy(h @ w.t(), y)[0]
    raise ValueError(f"unknown case {case!r}")


def liger_loss(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Liger's fused linear GRPO loss on one group of all N rows (its log-probs are not exposed alone)."""
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    loss_fn = LigerFusedLinearGRPOLoss(beta=0.0, compiled=False)
    n = h.shape[0]
    rows = 8 if n % 8 == 0 else 1
    hb, yb = h.view(rows, n // rows, -1), y.view(rows, n // rows)
    mask = torch.ones_like(yb)
    adv = torch.linspace(-1, 1, rows, device=h.device)
    return loss_fn(hb, w, yb, mask, adv)[0]


def kernel_case(
    case: str, n: int, d: int, v: int, dtype: torch.dtype, device: torch.device, repeats: int, train_head: bool
) -> dict:
    from grpoflow.kernels.logprobs import token_logprobs_reference

    if case == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return {"skipped": "triton on CPU needs TRITON_INTERPRET=1"}
    g = torch.Generator(device=device).manual_seed(0)
    h = torch.randn(n, d, device=device, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(v, d, device=device, generator=g) / d**0.5).to(dtype).requires_grad_(train_head)
    y = torch.randint(0, v, (n,), device=device, generator=g)
    up = torch.randn(n, device=device, generator=g)
    hr = h.detach().float().requires_grad_()
    ref = token_logprobs_reference(hr, w.float(), y)[0]
    (ref_dh,) = torch.autograd.grad((ref * up).sum(), hr)

    wrt = (h, w) if train_head else (h,)

    def step():
        if case == "bare":
            with torch.no_grad():
                (h @ w.t()) @ w
            return None, None
        if case == "liger":
            return None, torch.autograd.grad(liger_loss(h, w, y), wrt)[0]
        got = kernel_logprobs(case, h, w, y)
        return got.detach(), torch.autograd.grad((got * up).sum(), wrt)[0]

    try:
        got, dh = step()  # warm-up: compilation, autotuning; also the values checked
    except Exception as e:  # a peer's missing package or failure is reported; ours fail the check
        if case in OURS:
            raise
        return {"skipped": f"{type(e).__name__}: {str(e)[:200]}"}
    out = {}
    if got is not None:
        out["logp_max_err"] = (got.float() - ref.detach()).abs().max().item()
        out["dh_rel_err"] = ((dh.float() - ref_dh).abs().max() / ref_dh.abs().max()).item()
    sync(device)
    base = memory_allocated(device)
    reset_peak(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        sync(device)
        times.append(time.perf_counter() - t0)
    peak = peak_memory(device)
    out["seconds"] = statistics.median(times)
    out["peak_gb"] = None if peak is None else (peak - base) / 2**30
    return out


# ---------------------------------------------------------------------------------------------- device helpers
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def memory_allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


# ---------------------------------------------------------------------------------------------- grpo
class _Tracker:
    """What GRPOTrainer logs, kept in memory (no MLflow on a bare GPU machine)."""

    def log_metrics(self, metrics, step=None):
        pass

    def log_table(self, table, name):
        pass


def arithmetic_rows(n: int, seed: int) -> list[dict]:
    """Rows of the built-in task's shape: a chat prompt, the answer, the reference completion."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, 20), rng.randint(0, 20)
        ref = f"<reasoning>\n{a} + {b} = {a + b}\n</reasoning>\n<answer>\n{a + b}\n</answer>"
        rows.append({"prompt": [{"role": "user", "content": f"What is {a} + {b}?"}], "answer": str(a + b), "ref": ref})
    return rows


def sft_warmup(model, tok, rows: list[dict], steps: int, device: torch.device) -> None:
    """A few cross-entropy steps on prompt + reference (the pipeline's SFT stage, minus its bookkeeping), so the
    tiny model starts GRPO producing the answer format."""
    from grpoflow.tasks.model.loading import prompt_ids

    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    seqs = [prompt_ids(tok, r["prompt"]) + tok(r["ref"], add_special_tokens=False)["input_ids"] for r in rows]
    seqs = [s + [tok.eos_token_id] for s in seqs]
    for _ in range(steps):
        batch = random.sample(seqs, min(16, len(seqs)))
        width = max(map(len, batch))
        ids = torch.tensor([s + [tok.pad_token_id] * (width - len(s)) for s in batch], device=device)
        labels = torch.tensor([s + [-100] * (width - len(s)) for s in batch], device=device)
        logits = model(input_ids=ids).logits[:, :-1].float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()


def on_device(trainer, device: torch.device) -> bool:
    """Every parameter, gradient, optimizer state tensor and the last round's tensors on ``device``."""
    tensors = list(trainer.model.parameters())
    tensors += [p.grad for p in trainer.model.parameters() if p.grad is not None]
    tensors += [t for s in trainer.optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim()]
    if trainer.round is not None:
        r = trainer.round
        tensors += [getattr(r.batch, f) for f in r.batch.__dataclass_fields__] + [r.advantages]
    return all(t.device.type == device.type for t in tensors)


def grpo_case(name: str, device: torch.device, small: bool, steps: int) -> dict:
    from grpoflow.tasks.config import GRPOConfig, LoraConfig, TinyModelConfig
    from grpoflow.tasks.generation.transformers_loop import TransformersGenerator
    from grpoflow.tasks.grpo.trainer import GRPOTrainer
    from grpoflow.tasks.model.loading import add_lora, prompt_ids
    from grpoflow.tasks.model.tiny import build_tiny_model, train_tiny_tokenizer
    from grpoflow.tasks.rewards import resolve_reward_funcs

    torch.manual_seed(0)
    random.seed(0)
    rows = arithmetic_rows(200, seed=1)
    tok = train_tiny_tokenizer([r["prompt"][0]["content"] + "\n" + r["ref"] for r in rows], 300)
    if name == "tiny":
        shape = TinyModelConfig()
        model = build_tiny_model(shape, tok, seed=0).to(device)
        sft_warmup(model, tok, rows, 20 if small else 300, device)
        cfg = GRPOConfig(
            max_steps=steps,
            per_device_train_batch_size=16,
            num_generations=8,
            learning_rate=5e-4,
            max_completion_length=32,
            reward_funcs=["correctness", "proximity", "strict_format"],
        )
    else:  # Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 heads, 2 KV heads, MLP 4864; its 151936 vocabulary)
        shape = TinyModelConfig(
            hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2
        )
        if small:
            shape = TinyModelConfig(
                hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1
            )
        model = build_tiny_model(shape, tok, seed=0)
        if not small:  # Qwen's vocabulary size: the head and the log-prob kernel at full width (ids past the
            model.resize_token_embeddings(151936)  # tokenizer's decode to nothing: a speed check, not a task)
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        model = add_lora(model.to(device=device, dtype=dtype), LoraConfig(r=16, alpha=32, target_modules="all-linear"))
        cfg = GRPOConfig(
            max_steps=steps,
            per_device_train_batch_size=8 if small else 32,
            num_generations=8,
            max_completion_length=16 if small else 128,
            reward_funcs=["proximity"],
        )
    prompts = [prompt_ids(tok, r["prompt"]) for r in rows]
    trainer = GRPOTrainer(
        cfg,
        model,
        tok,
        rows,
        prompts,
        resolve_reward_funcs(cfg.reward_funcs),
        TransformersGenerator(model, tok),
        _Tracker(),
        Path(tempfile.mkdtemp()),
        seed=0,
    )
    reset_peak(device)
    t0 = time.perf_counter()
    trainer.train()
    sync(device)
    seconds = time.perf_counter() - t0
    h = trainer.history
    peak = peak_memory(device)
    return {
        "parameters": sum(p.numel() for p in model.parameters()),
        "steps": len(h),
        "first_reward": h[0]["reward"],
        "last_reward": statistics.mean(x["reward"] for x in h[-max(1, len(h) // 5) :]),
        "step_seconds": statistics.median(x["step_time"] for x in h),
        "seconds": seconds,
        "tokens_per_second": h[-1]["tokens_per_second"],  # prompt + completion tokens of the rounds, per second
        "peak_gb": None if peak is None else peak / 2**30,
        "all_on_device": on_device(trainer, device),
    }


# ---------------------------------------------------------------------------------------------- main
def fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--small", action="store_true", help="toy sizes (the CPU test)")
    p.add_argument("--n", type=int, default=16384)
    p.add_argument("--d", type=int, default=4096)
    p.add_argument("--v", type=int, default=151936)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--cases", default=",".join(KERNEL_CASES))
    p.add_argument("--train-head", action="store_true", help="kernel: also dW (full fine-tuning)")
    p.add_argument("--tiny-steps", type=int, default=40)
    p.add_argument("--qwen-steps", type=int, default=5)
    p.add_argument("--out", default="gpu_check.json")
    a = p.parse_args(argv)
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("gpu_check: --device cuda, but torch sees no GPU (on CPU: --device cpu --small)")
    n, d, v, dtype = (64, 32, 300, torch.float32) if a.small else (a.n, a.d, a.v, torch.bfloat16)
    steps = (2, 1) if a.small else (a.tiny_steps, a.qwen_steps)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    report: dict = {"device": name, "torch": torch.__version__, "kernel": {}, "grpo": {}}
    print(f"{name}, torch {torch.__version__}")
    grads = "dH, dW" if a.train_head else "dH"
    print(f"kernel: N={n} D={d} V={v} {dtype}, forward + backward ({grads}), median of {a.repeats}")
    print(f"  {'case':12s} {'|logp err|':>11s} {'dH rel err':>11s} {'ms':>10s} {'peak GB':>9s}")
    for case in a.cases.split(","):
        r = report["kernel"][case] = kernel_case(case, n, d, v, dtype, device, a.repeats, a.train_head)
        if "skipped" in r:
            print(f"  {case:12s} skipped: {r['skipped']}")
            continue
        ms = r["seconds"] * 1e3
        err, rel = fmt(r.get("logp_max_err"), "11.2e"), fmt(r.get("dh_rel_err"), "11.2e")
        print(f"  {case:12s} {err:>11s} {rel:>11s} {ms:10.2f} {fmt(r['peak_gb'], '9.3f'):>9s}", flush=True)
    timed = {c: r for c, r in report["kernel"].items() if "seconds" in r}
    for ours in ("triton", "chunked"):
        for other in ("naive", "bare", "trl_chunked", "trl_triton", "liger"):
            if ours in timed and other in timed:
                t = timed[ours]["seconds"] / timed[other]["seconds"]
                mem = ""
                if timed[ours]["peak_gb"] is not None and timed[other]["peak_gb"]:
                    mem = f"   memory {timed[ours]['peak_gb'] / timed[other]['peak_gb']:7.4f}x"
                print(f"  {ours} / {other:12s} time {t:6.2f}x{mem}")
    print(f"grpo on {device} (transformers generation)")
    head = f"{'params':>11s} {'steps':>5s} {'reward':>15s} {'s/step':>7s} {'tok/s':>8s} {'peak GB':>8s}"
    print(f"  {'case':6s} {head} on-device")
    for case, k in zip(("tiny", "qwen"), steps):
        r = report["grpo"][case] = grpo_case(case, device, a.small, k)
        reward = f"{r['first_reward']:.2f} -> {r['last_reward']:.2f}"
        print(
            f"  {case:6s} {r['parameters']:11,d} {r['steps']:5d} {reward:>15s} {r['step_seconds']:7.2f} "
            f"{r['tokens_per_second']:8.0f} {fmt(r['peak_gb'], '8.2f'):>8s} {r['all_on_device']}",
            flush=True,
        )
    Path(a.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {a.out}")
    return report


if __name__ == "__main__":
    main()
