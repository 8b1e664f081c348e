"""The log-prob kernel sections of benchmarks/gpu_check.py: correctness against the float32 reference, timing
against the matmul floor, and the outside peers (TRL, Liger) when installed.

Every case is a function returning a dict of numbers (JSON); the runner in gpu_check.py times it, catches what it
raises and writes the report after it. ``Skip`` says why a case did not run.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

V_FULL = 151936  # Qwen2.5's vocabulary
TRL_VOCAB_CHUNK = 32768  # trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE in TRL 1.16
LOGIT_STD = 4.0  # the inputs' logits spread like a trained LM's (a few nats), not N(0, 1)
# Bounds on the error against the float32 reference computed from the same (rounded) inputs. float32: the same
# math in another summation order. bf16: what bf16 GEMM operands (float32 accumulation) and bf16 logits or
# probabilities may cost; a wrong kernel is off by O(1). The errors themselves are recorded for reading.
TOLERANCE = {
    torch.float32: {"logp": 1e-3, "entropy": 1e-3, "grad_rel": 1e-3},
    torch.bfloat16: {"logp": 0.1, "entropy": 0.1, "grad_rel": 0.05},
}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


class Skip(Exception):
    """A case that cannot run here; its message is the reason recorded."""


@dataclass
class Case:
    name: str
    run: Callable[[], dict]
    est_s: float = 0.0  # about what it takes on the GPU: not started with less budget left


# ---------------------------------------------------------------------------------------------- device helpers
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak(device: torch.device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def free_bytes(device: torch.device) -> int | None:
    return torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None


def inputs(n: int, d: int, v: int, dtype: torch.dtype, device: torch.device, trainable: bool, seed: int = 0):
    """H [N, D], W [V, D] (logits of std LOGIT_STD), targets y [N] and an upstream gradient g [N] (GRPO's
    per-token weights), on ``device``; W needs a gradient when the head is ``trainable``."""
    g = torch.Generator(device=device).manual_seed(seed)  # drawn on the device: W at D=4096 is 622M numbers
    h = torch.randn(n, d, generator=g, device=device).to(dtype).requires_grad_()
    w = (torch.randn(v, d, generator=g, device=device) * (LOGIT_STD / d**0.5)).to(dtype).requires_grad_(trainable)
    y = torch.randint(0, v, (n,), generator=g, device=device)
    up = torch.randn(n, generator=g, device=device)
    return h, w, y, up


def run_impl(impl: str, h, w, y, up, temperature: float) -> dict[str, torch.Tensor]:
    """logp, entropy and the gradients of sum(g * logp) (dH; dW when W needs one) through ``impl``."""
    if impl == "reference":
        from grpoflow.kernels.logprobs import token_logprobs_reference

        logp, ent = token_logprobs_reference(h, w, y, temperature)
    else:
        from grpoflow.kernels.logprobs import token_logprobs

        logp, ent = token_logprobs(h, w, y, temperature, compute_entropy=True, impl=impl)
    wrt = (h, w) if w.requires_grad else (h,)
    grads = torch.autograd.grad((logp.float() * up).sum(), wrt)
    out = {"logp": logp.detach(), "entropy": ent.detach(), "dH": grads[0]}
    if w.requires_grad:
        out["dW"] = grads[1]
    return out


# ---------------------------------------------------------------------------------------------- correctness
class _ReferenceCache:
    """The float32 reference of the last input set: the cases of one shape, dtype and head share it."""

    def __init__(self):
        self.key, self.value = None, None

    def get(self, key, make):
        if key != self.key:
            self.key, self.value = None, None  # free the old one first
            self.value, self.key = make(), key
        return self.value


def correctness_case(impl, shape, dtype_name, trainable, temperature, device, cache) -> dict:
    """``impl`` against the float32 reference on the same inputs (values, entropy, dH and dW), and whether two
    runs on the same inputs give the same bits."""
    if impl == "triton" and device.type != "cuda":
        import os

        if os.environ.get("TRITON_INTERPRET") != "1":
            raise Skip("triton on CPU needs TRITON_INTERPRET=1")
    n, d, v = shape
    dtype = DTYPES[dtype_name]

    def make():
        h, w, y, up = inputs(n, d, v, dtype, device, trainable)
        hr = h.detach().float().requires_grad_()
        wr = w.detach().float().requires_grad_(trainable)
        return (h, w, y, up), run_impl("reference", hr, wr, y, up, temperature)

    (h, w, y, up), ref = cache.get((shape, dtype_name, trainable, temperature), make)
    first = run_impl(impl, h, w, y, up, temperature)
    second = run_impl(impl, h, w, y, up, temperature)
    tol = TOLERANCE[dtype]
    out: dict = {"N": n, "D": d, "V": v, "dtype": dtype_name, "temperature": temperature, "tolerance": tol}
    bad = []
    for key, got in first.items():
        err = (got.float() - ref[key].float()).abs().max().item()
        if key in ("dH", "dW"):
            err /= max(ref[key].abs().max().item(), 1e-30)
            name, bound = f"{key}_rel_err", tol["grad_rel"]
        else:
            name, bound = f"{key}_max_err", tol[key]
        out[name] = err
        if not err <= bound:  # NaN fails too
            bad.append(f"{name} {err:.3g} > {bound:g}")
    out["logp_dtype"] = str(first["logp"].dtype).removeprefix("torch.")
    out["bitwise_repeatable"] = all(torch.equal(first[k], second[k]) for k in first)
    if bad:
        out.update(status="failed", reason="; ".join(bad))
    return out


def correctness_cases(device: torch.device, small: bool) -> list[Case]:
    """Most valuable first: bf16 (what GRPO runs on a GPU) at Qwen's vocabulary, then float32 (model.dtype
    float32, QLoRA's upcast head), then ragged N, D and V with a temperature."""
    regular = (64, 64, 256) if small else (1024, 896, V_FULL)
    ragged = (37, 40, 301) if small else (1001, 900, 32003)
    cache = _ReferenceCache()
    cases = []
    for shape, temperature in ((regular, 1.0), (ragged, 0.7)):
        for dtype_name in ("bf16", "fp32"):
            for trainable in (False, True):
                for impl in ("triton", "chunked"):
                    head = "trainable" if trainable else "frozen"
                    name = f"{impl}/{dtype_name}/{head}/{'x'.join(map(str, shape))}"
                    args = (impl, shape, dtype_name, trainable, temperature, device, cache)
                    cases.append(Case(name, lambda a=args: correctness_case(*a), est_s=4.0))
    return cases


# ---------------------------------------------------------------------------------------------- timing
def bare(h, w, wrt_w: bool, backward: bool) -> None:
    """The matmul floor: Z = H W^T (forward); then Z W (the dH GEMM) and, for a trainable head, Z^T H (dW)."""
    with torch.no_grad():
        z = h @ w.t()
        if backward:
            z @ w
            if wrt_w:
                z.t() @ h


def peer_logprobs(impl: str, h, w, y):
    if impl == "trl_chunked":
        from trl.kernels.chunked_logprob import ChunkedLogProbFunction

        return ChunkedLogProbFunction.apply(h, w, None, y, 1.0, TRL_VOCAB_CHUNK, None, 1.0, ("entropy",))[0]
    if impl == "trl_triton":
        from trl.kernels.logprob_entropy import selective_log_softmax_and_entropy

        return selective_log_softmax_and_entropy(h @ w.t(), y)[0]
    raise ValueError(impl)


def liger_loss(h, w, y):
    """Liger's fused linear GRPO loss (beta 0) on all N rows as 8 groups: its log-probs are not exposed alone."""
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    n = h.shape[0]
    rows = 8 if n % 8 == 0 else 1
    hb, yb = h.view(rows, n // rows, -1), y.view(rows, n // rows)
    adv = torch.linspace(-1, 1, rows, device=h.device)
    return LigerFusedLinearGRPOLoss(beta=0.0, compiled=False)(hb, w, yb, torch.ones_like(yb), adv)[0]


def one_pass(impl: str, h, w, y, up, backward: bool) -> None:
    """What one timed repetition runs: the no-grad forward (old and reference log-probs) or the training
    forward + backward (dH, and dW for a trainable head)."""
    wrt = (h, w) if w.requires_grad else (h,)
    if impl == "bare":
        return bare(h, w, w.requires_grad, backward)
    if impl == "liger":
        if backward:
            torch.autograd.grad(liger_loss(h, w, y), wrt)
        else:
            with torch.no_grad():
                liger_loss(h, w, y)
        return None
    with torch.set_grad_enabled(backward):
        if impl in ("trl_chunked", "trl_triton"):
            logp = peer_logprobs(impl, h, w, y)
        else:
            from grpoflow.kernels.logprobs import token_logprobs

            logp = token_logprobs(h, w, y, compute_entropy=True, impl=impl)[0]
        if backward:
            torch.autograd.grad((logp.float() * up).sum(), wrt)
    return None


def measure(fn: Callable[[], None], device: torch.device, repeats: int) -> dict:
    """Median seconds of ``repeats`` calls after one warm-up (compilation, autotuning, allocator), and the peak
    memory above what was allocated before (CUDA)."""
    fn()
    sync(device)
    base = allocated(device)
    reset_peak(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    top = peak(device)
    return {"ms": 1e3 * statistics.median(times), "peak_gb": None if top is None else (top - base) / 2**30}


def timing_case(impl, n, d, v, trainable, device, repeats) -> dict:
    if impl == "triton" and device.type != "cuda":
        import os

        if os.environ.get("TRITON_INTERPRET") != "1":
            raise Skip("triton on CPU needs TRITON_INTERPRET=1")
    if impl == "reference" and device.type == "cuda":  # float32 logits, log_softmax, its exp and the gradient
        need, free = 4 * n * v * 4 + 2 * v * d * 4, free_bytes(device)
        if need > 0.8 * free:
            raise Skip(f"the float32 reference needs about {need / 2**30:.0f} GiB, {free / 2**30:.0f} GiB free")
    if impl in ("trl_chunked", "trl_triton"):
        _need("trl")
    if impl == "liger":
        _need("liger_kernel")
    h, w, y, up = inputs(n, d, v, torch.bfloat16 if device.type == "cuda" else torch.float32, device, trainable)
    fwd = measure(lambda: one_pass(impl, h, w, y, up, False), device, repeats)
    fwd_bwd = measure(lambda: one_pass(impl, h, w, y, up, True), device, repeats)
    return {
        "N": n,
        "D": d,
        "V": v,
        "dtype": str(h.dtype).removeprefix("torch."),
        "head": "trainable" if trainable else "frozen",
        "repeats": repeats,
        "fwd_ms": fwd["ms"],
        "fwd_bwd_ms": fwd_bwd["ms"],
        "fwd_peak_gb": fwd["peak_gb"],
        "fwd_bwd_peak_gb": fwd_bwd["peak_gb"],
    }


def _need(module: str) -> None:
    import importlib

    try:
        importlib.import_module(module)
    except ImportError as e:
        raise Skip(f"{module} is not installed ({e})") from None


def timing_shapes(small: bool) -> list[tuple[int, int, int]]:
    """(N, D, V), the most telling first: Qwen2.5-0.5B's hidden size at a small round, then the big one."""
    if small:
        return [(64, 32, 300), (128, 64, 300), (128, 32, 300), (64, 64, 300)]
    return [(2048, 896, V_FULL), (16384, 4096, V_FULL), (16384, 896, V_FULL), (2048, 4096, V_FULL)]


def timing_cases(device: torch.device, small: bool, repeats: int, impls=("triton", "chunked", "bare")) -> list[Case]:
    cases = []
    for n, d, v in timing_shapes(small):
        for trainable in (False, True):
            for impl in impls:
                head = "trainable" if trainable else "frozen"
                est = 2.0 + 1e-12 * n * d * v * (1.5 if trainable else 1.0)  # float32 chunked at ~50 TFLOP/s
                args = (impl, n, d, v, trainable, device, repeats)
                cases.append(Case(f"{impl}/{head}/{n}x{d}x{v}", lambda a=args: timing_case(*a), est_s=est))
    return cases


def reference_timing_cases(device: torch.device, small: bool, repeats: int) -> list[Case]:
    """The naive float32 reference at the timing shapes, after everything else (it materializes [N, V] float32
    logits: 10 GB at N=16384), where memory allows."""
    return timing_cases(device, small, repeats, impls=("reference",))


def peer_cases(device: torch.device, small: bool, repeats: int) -> list[Case]:
    shapes = timing_shapes(small)[:2]
    cases = []
    for impl in ("trl_chunked", "trl_triton", "liger"):
        for n, d, v in shapes:
            args = (impl, n, d, v, False, device, repeats)
            cases.append(Case(f"{impl}/frozen/{n}x{d}x{v}", lambda a=args: timing_case(*a), est_s=8.0))
    return cases


def comparisons(timing: dict) -> list[dict]:
    """Per shape and head: triton / chunked, each / bare (time ratios, fwd and fwd+bwd) and which impl is faster
    in the training pass (fwd+bwd), from the timing section's passed cases."""
    by_key: dict[tuple, dict] = {}
    for name, rec in timing.items():
        if rec.get("status") == "passed":
            impl = name.split("/", 1)[0]
            by_key.setdefault((rec["N"], rec["D"], rec["V"], rec["head"]), {})[impl] = rec
    rows = []
    for (n, d, v, head), got in by_key.items():
        row = {"N": n, "D": d, "V": v, "head": head}
        for mode in ("fwd", "fwd_bwd"):
            for a, b in (("triton", "chunked"), ("triton", "bare"), ("chunked", "bare")):
                if a in got and b in got and got[b][f"{mode}_ms"] > 0:
                    row[f"{a}/{b}_{mode}"] = got[a][f"{mode}_ms"] / got[b][f"{mode}_ms"]
        if "triton" in got and "chunked" in got:
            row["faster_fwd_bwd"] = min(("triton", "chunked"), key=lambda k: got[k]["fwd_bwd_ms"])
            row["faster_fwd"] = min(("triton", "chunked"), key=lambda k: got[k]["fwd_ms"])
        rows.append(row)
    return rows
