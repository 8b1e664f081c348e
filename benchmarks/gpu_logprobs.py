"""Per-token log-probs on a CUDA GPU, forward + backward, bf16: our Triton kernel and torch path vs peers.

Prepared for a GPU machine (none was available when it was written: run it there and record the numbers).
It first checks the Triton kernel against the naive float32 reference on a small shape (values and
gradients; the kernel's CPU tests run under TRITON_INTERPRET=1, which does not exercise GPU codegen), then
times, at N=16384 D=4096 V=151936 (Qwen2.5 vocabulary) in bf16:

    naive        H W^T in bf16, then log_softmax in float32 (kernels.logprobs.token_logprobs_reference)
    triton       kernels.logprobs.token_logprobs(impl="triton"): kernels/triton_logprobs.py
    torch        kernels.logprobs.token_logprobs(impl="torch"): the chunked CPU path (float32 GEMMs)
    trl_chunked  TRL's ChunkedLogProbFunction: cuBLAS tiles + a Triton fold (trl/kernels/chunked_logprob.py)
    trl_triton   materialized bf16 logits + TRL's Triton log-softmax/entropy kernel
                 (trl/kernels/logprob_entropy.py: selective_log_softmax_and_entropy)
    bare         the two GEMMs the math needs, in bf16: Z = H W^T, then Z W (the dH GEMM)

Time: CUDA events, the median of --repeats steps after a warm-up. Memory: torch.cuda.max_memory_allocated
during one step, minus what was allocated before it (the inputs). --train-head adds dW (full fine-tuning).

    python benchmarks/gpu_logprobs.py
    python benchmarks/gpu_logprobs.py --n 4096 --cases triton,bare     # a quicker look
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

CASES = ("naive", "triton", "torch", "trl_chunked", "trl_triton", "bare")
TRL_VOCAB_CHUNK = 32768  # trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE in TRL 1.16


def inputs(n: int, d: int, v: int, dtype: torch.dtype, train_head: bool, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    h = torch.randn(n, d, device="cuda", generator=g).to(dtype).requires_grad_()
    w = (torch.randn(v, d, device="cuda", generator=g) / d**0.5).to(dtype).requires_grad_(train_head)
    y = torch.randint(0, v, (n,), device="cuda", generator=g)
    return h, w, y


def logprobs(case: str, h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """logp [N] of ``case`` (with autograd), entropy requested where the implementation offers it."""
    from grpoflow.kernels.logprobs import token_logprobs, token_logprobs_reference

    if case == "naive":
        return token_logprobs_reference(h, w, y)[0]
    if case in ("triton", "torch"):
        return token_logprobs(h, w, y, compute_entropy=True, impl=case)[0]
    if case == "trl_chunked":
        from trl.kernels.chunked_logprob import ChunkedLogProbFunction

        return ChunkedLogProbFunction.apply(h, w, None, y, 1.0, TRL_VOCAB_CHUNK, None, 1.0, ("entropy",))[0]
    if case == "trl_triton":
        from trl.kernels.logprob_entropy import selective_log_softmax_and_entropy

        return selective_log_softmax_and_entropy(h @ w.t(), y)[0]
    raise ValueError(f"unknown case {case!r}: expected one of {CASES}")


def step(case: str, h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> None:
    """One forward + backward; ``bare`` is the two GEMMs alone."""
    if case == "bare":
        with torch.no_grad():
            (h @ w.t()) @ w
        return
    logprobs(case, h, w, y).sum().backward()
    h.grad = w.grad = None


def verify(n: int = 300, d: int = 200, v: int = 1000) -> None:
    """The Triton kernel against the float32 reference on a small shape (values and gradients, fp32 and bf16)."""
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 2e-2)):
        h, w, y = inputs(n, d, v, dtype, train_head=True)
        up = torch.randn(n, device="cuda")
        got = logprobs("triton", h, w, y)
        grads = torch.autograd.grad((got * up).sum(), (h, w))
        hr, wr = (t.detach().float().requires_grad_() for t in (h, w))
        want = logprobs("naive", hr, wr, y)
        ref_grads = torch.autograd.grad((want * up).sum(), (hr, wr))
        errors = [(got - want).abs().max().item()]
        errors += [((a.float() - b).abs().max() / b.abs().max()).item() for a, b in zip(grads, ref_grads)]
        status = "ok" if max(errors) < tol else "MISMATCH"
        print(f"verify {dtype}: |logp err| {errors[0]:.1e}, dH rel {errors[1]:.1e}, dW rel {errors[2]:.1e}: {status}")
        if status != "ok":
            sys.exit(f"the Triton kernel disagrees with the reference in {dtype} (tolerance {tol})")


def run(case: str, n: int, d: int, v: int, repeats: int, train_head: bool) -> dict:
    h, w, y = inputs(n, d, v, torch.bfloat16, train_head)
    step(case, h, w, y)  # warm-up (compilation, autotune)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step(case, h, w, y)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step(case, h, w, y)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del h, w, y
    torch.cuda.empty_cache()
    return {"seconds": statistics.median(times), "peak_gb": peak / 2**30}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=16384)
    p.add_argument("--d", type=int, default=4096)
    p.add_argument("--v", type=int, default=151936)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--train-head", action="store_true", help="also dW (full fine-tuning)")
    p.add_argument("--cases", default=",".join(CASES))
    a = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_logprobs.py needs a CUDA GPU: torch.cuda.is_available() is False (on CPU: bench_logprobs.py)")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    verify()
    print(
        f"N={a.n} D={a.d} V={a.v} bf16, forward+backward ({'dH, dW' if a.train_head else 'dH'}), median of {a.repeats}"
    )
    rows = {}
    for case in a.cases.split(","):
        try:
            rows[case] = run(case, a.n, a.d, a.v, a.repeats, a.train_head)
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
            print(f"  {case:12s} out of memory")
            continue
        r = rows[case]
        print(f"  {case:12s} {r['seconds'] * 1e3:9.1f} ms  peak +{r['peak_gb']:7.2f} GB", flush=True)
    for ours in ("triton", "torch"):
        for other in ("naive", "bare", "trl_chunked", "trl_triton"):
            if ours in rows and other in rows:
                t = rows[ours]["seconds"] / rows[other]["seconds"]
                m = rows[ours]["peak_gb"] / max(rows[other]["peak_gb"], 1e-9)
                print(f"  {ours} / {other:12s} time {t:5.2f}x   memory {m:7.4f}x")


if __name__ == "__main__":
    main()
