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
# Peers whose forward computes the gradients itself (a backward per chunk inside the forward, stored for the
# autograd backward to scale): no forward-only time exists for them, so none is reported (the "fwd" of the
# Liger case was a forward + backward).
FUSED_BACKWARD = {
    "liger": "Liger's chunked GRPO loss runs torch.autograd.grad per chunk inside its forward",
    "liger_flce": "Liger's fused linear cross entropy computes grad_input and grad_weight inside its forward",
}
TRITON_ONLY = {"liger_flce": "Liger's fused linear cross entropy"}  # TRL's chunked path has a torch fallback


def bare(h, w, wrt_w: bool, backward: bool) -> None:
    """The matmul floor: Z = H W^T (forward); then Z W (the dH GEMM) and, for a trainable head, Z^T H (dW)."""
    with torch.no_grad():
        z = h @ w.t()
        if backward:
            z @ w
            if wrt_w:
                z.t() @ h


def trl_chunked(h, w, y):
    """TRL's chunked log-prob (trl/kernels/chunked_logprob.py): its autograd Function called with the arguments
    its forward declares, by name (hidden, weight, bias, targets, temperature, chunk_size = TRL_VOCAB_CHUNK, the
    vocabulary width TRL's trainer passes, and outputs = ("entropy",): the entropy ours computes too, none of TRL's
    other optional outputs; any other parameter left at its default), so that the TRL release installed decides
    the order of the signature. Returns the log-probs. On CPU TRL folds its tiles with torch ops (Triton on CUDA)."""
    import inspect

    from trl.kernels.chunked_logprob import ChunkedLogProbFunction

    known = {"hidden": h, "weight": w, "bias": None, "targets": y, "temperature": 1.0}
    known.update(chunk_size=TRL_VOCAB_CHUNK, outputs=("entropy",))
    args = []
    for name, p in list(inspect.signature(ChunkedLogProbFunction.forward).parameters.items())[1:]:  # after ctx
        if name in known:
            args.append(known[name])
        elif p.default is not inspect.Parameter.empty:
            args.append(p.default)
        else:
            raise Skip(f"TRL's ChunkedLogProbFunction.forward requires {name!r}, a parameter this check does not know")
    out = ChunkedLogProbFunction.apply(*args)
    return out[0] if isinstance(out, tuple) else out


def peer_logprobs(impl: str, h, w, y):
    if impl == "trl_chunked":
        return trl_chunked(h, w, y)
    if impl == "trl_triton":
        from trl.kernels.logprob_entropy import selective_log_softmax_and_entropy

        return selective_log_softmax_and_entropy(h @ w.t(), y)[0]
    raise ValueError(impl)


def liger_grpo_loss(h, w, y):
    """Liger's fused linear GRPO loss on all N rows as 8 sequences (its log-probs are not exposed alone): beta 0
    with use_ref_model=False (True asserts that ref_per_token_logps or ref_input is given: LigerFusedLinearPPOBase),
    compiled=False (torch.compile of its [B, T] loss math would add compile time, not kernel time)."""
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    n = h.shape[0]
    rows = 8 if n % 8 == 0 else 1
    hb, yb = h.view(rows, n // rows, -1), y.view(rows, n // rows)
    adv = torch.linspace(-1, 1, rows, device=h.device)
    mask = torch.ones(yb.shape, device=h.device)  # float: Liger clamps and divides its sums
    loss = LigerFusedLinearGRPOLoss(beta=0.0, use_ref_model=False, compiled=False)(hb, w, yb, mask, adv)
    return loss[0] if isinstance(loss, tuple) else loss


def liger_flce(h, w, y):
    """Liger's fused linear cross entropy (the summed NLL of y: the log-prob pass with g = 1 on every row)."""
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    return LigerFusedLinearCrossEntropyLoss(reduction="sum")(w, h, y)


def one_pass(impl: str, h, w, y, up, backward: bool) -> None:
    """What one timed repetition runs: the no-grad forward (old and reference log-probs) or the training
    forward + backward (dH, and dW for a trainable head)."""
    wrt = (h, w) if w.requires_grad else (h,)
    if impl == "bare":
        return bare(h, w, w.requires_grad, backward)
    if impl in FUSED_BACKWARD:
        if not backward:
            raise ValueError(f"{impl}: {FUSED_BACKWARD[impl]}; it has no forward-only pass")
        loss = liger_grpo_loss(h, w, y) if impl == "liger" else liger_flce(h, w, y)
        torch.autograd.grad(loss, wrt)
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


def timed_ms(fn: Callable[[], None], device: torch.device, repeats: int) -> tuple[float, str]:
    """Median milliseconds of ``fn`` and the timer used. CUDA: CUDA events through triton.testing.do_bench (warm-up,
    L2 flushed between calls, as many calls as fit in 100 ms and at least one), on ``device``; without Triton,
    torch.cuda.Event pairs around ``repeats`` calls. CPU: perf_counter around ``repeats`` calls after a warm-up."""
    if device.type == "cuda":
        with torch.cuda.device(device):
            try:
                from triton.testing import do_bench
            except ImportError:
                return _event_ms(fn, repeats), "cuda events (torch.cuda.Event; triton not importable)"
            return float(do_bench(fn, warmup=25, rep=100, return_mode="median")), "cuda events (triton do_bench)"
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times), "perf_counter"


def _event_ms(fn: Callable[[], None], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def measure(fn: Callable[[], None], device: torch.device, repeats: int) -> dict:
    """The peak memory of one call above what was allocated before it (CUDA; this call also warms up: compilation,
    autotuning, the allocator), then the median time (:func:`timed_ms`)."""
    fn()
    sync(device)
    base = allocated(device)
    reset_peak(device)
    fn()
    sync(device)
    top = peak(device)
    ms, timer = timed_ms(fn, device, repeats)
    return {"ms": ms, "timer": timer, "peak_gb": None if top is None else (top - base) / 2**30}


def free_after_empty_cache(device: torch.device) -> int:
    """Free device bytes once the caching allocator has returned its unused blocks (mem_get_info alone counts
    the blocks it caches as used)."""
    import gc

    gc.collect()
    with torch.cuda.device(device):
        torch.cuda.empty_cache()
    return free_bytes(device)


def timing_case(impl, n, d, v, trainable, device, repeats) -> dict:
    if impl == "triton" and device.type != "cuda":
        import os

        if os.environ.get("TRITON_INTERPRET") != "1":
            raise Skip("triton on CPU needs TRITON_INTERPRET=1")
    if impl == "reference" and device.type == "cuda":  # float32 logits, log_softmax, its exp and the gradient
        need, free = 4 * n * v * 4 + 2 * v * d * 4, free_after_empty_cache(device)
        if need > 0.8 * free:
            raise Skip(f"the float32 reference needs about {need / 2**30:.0f} GiB, {free / 2**30:.0f} GiB free")
    if impl in ("trl_chunked", "trl_triton"):
        _need("trl.kernels.chunked_logprob" if impl == "trl_chunked" else "trl.kernels.logprob_entropy", "trl")
    if impl in ("liger", "liger_flce"):
        _need("liger_kernel.chunked_loss" if impl == "liger" else "liger_kernel.transformers", "liger_kernel")
    if impl in TRITON_ONLY and device.type != "cuda":
        raise Skip(f"{TRITON_ONLY[impl]} is Triton kernels launched for CUDA tensors: a GPU case")
    h, w, y, up = inputs(n, d, v, torch.bfloat16 if device.type == "cuda" else torch.float32, device, trainable)
    out = {"N": n, "D": d, "V": v, "dtype": str(h.dtype).removeprefix("torch."), "repeats": repeats}
    out["head"] = "trainable" if trainable else "frozen"
    if impl in FUSED_BACKWARD:
        fwd = {"ms": None, "peak_gb": None}
        out["fwd_note"] = f"no forward-only time: {FUSED_BACKWARD[impl]}"
    else:
        fwd = measure(lambda: one_pass(impl, h, w, y, up, False), device, repeats)
    fwd_bwd = measure(lambda: one_pass(impl, h, w, y, up, True), device, repeats)
    out.update(fwd_ms=fwd["ms"], fwd_bwd_ms=fwd_bwd["ms"], fwd_peak_gb=fwd["peak_gb"])
    out.update(fwd_bwd_peak_gb=fwd_bwd["peak_gb"], timer=fwd_bwd["timer"])
    return out


def _need(module: str, package: str) -> None:
    """Skip unless ``module`` imports: "PACKAGE is not installed" when the package itself is missing, else the
    import error (an installed release without that module, or a dependency of it missing)."""
    import importlib
    import importlib.util

    try:
        importlib.import_module(module)
    except ImportError as e:
        try:
            missing = importlib.util.find_spec(package) is None
        except (ImportError, ValueError):  # a blocked module (sys.modules[name] = None) reads as missing too
            missing = True
        if missing:
            raise Skip(f"{package} is not installed") from None
        raise Skip(f"{package} is installed but {module} does not import ({type(e).__name__}: {e})") from None


def timing_shapes(small: bool) -> list[tuple[int, int, int]]:
    """(N, D, V), the most telling first: Qwen2.5-0.5B's hidden size at a small round, then the big one."""
    if small:
        return [(64, 32, 300), (128, 64, 300), (128, 32, 300), (64, 64, 300)]
    return [(2048, 896, V_FULL), (16384, 4096, V_FULL), (16384, 896, V_FULL), (2048, 4096, V_FULL)]


TIMED = ("triton", "chunked", "trl_chunked", "liger_flce", "bare")


def timing_cases(device: torch.device, small: bool, repeats: int, impls=TIMED) -> list[Case]:
    """Per shape and head, side by side: ours (triton, chunked), TRL 1.16's chunked path and Liger's fused linear
    cross entropy (skipped with the reason when not installed), and the bare GEMMs (the floor)."""
    cases = []
    for n, d, v in timing_shapes(small):
        for trainable in (False, True):
            for impl in impls:
                head = "trainable" if trainable else "frozen"
                est = 2.0 + 1e-12 * n * d * v * (1.5 if trainable else 1.0)  # float32 chunked at ~50 TFLOP/s
                args = (impl, n, d, v, trainable, device, repeats)
                cases.append(Case(f"{impl}/{head}/{n}x{d}x{v}", lambda a=args: timing_case(*a), est_s=est))
    return cases


TILES = ((1024, 8192), (1024, 16384))  # the chunked path's [rows, vocabulary] tiles (16384: its CUDA default)


def _fused_against_torch(run, rows: int, cols: int, bytes_per_elem: int, device, repeats: int) -> dict:
    """Times ``run(fused)`` both ways; each call clones the tile first, which is timed alone and taken out."""
    u = run.tile
    fused = measure(lambda: run(True), device, repeats)
    plain = measure(lambda: run(False), device, repeats)
    clone_ms = measure(lambda: u.clone(), device, repeats)["ms"]
    fused_ms = max(fused["ms"] - clone_ms, 1e-6)
    return {
        "rows": rows, "cols": cols, "fused_ms": fused_ms, "torch_ms": plain["ms"] - clone_ms, "clone_ms": clone_ms,
        "fused_gb_per_s": bytes_per_elem * rows * cols / fused_ms / 1e6,
        "torch_over_fused": (plain["ms"] - clone_ms) / fused_ms, "timer": fused["timer"],
    }  # fmt: skip


def _tile(rows: int, cols: int, device: torch.device):
    import os

    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise Skip("the Triton tile kernels on CPU need TRITON_INTERPRET=1")
    g = torch.Generator(device=device).manual_seed(0)
    u = torch.randn(rows, cols, device=device, generator=g) * 4
    y = torch.randint(0, cols, (rows,), device=device, generator=g)
    return u, y


def fold_case(rows: int, cols: int, device: torch.device, repeats: int) -> dict:
    """One tile's online-softmax fold (kernels/tiles.py, as a frozen head's forward runs it: e written in bf16,
    with the entropy's sums), fused (kernels/triton_tiles.py: one read of the float32 tile, e written once)
    against the torch ops it replaces: results compared, both timed, and the fused fold's bytes per second at 6
    bytes a tile element (4 read, 2 written), the figure docs/kernel-roofline.md's byte count of the chunked path
    assumes runs at HBM speed."""
    from grpoflow.kernels.tile_state import new_state
    from grpoflow.kernels.tiles import fold_tile

    u, y = _tile(rows, cols, device)

    def run(fused: bool):
        state = new_state(rows, True, device)
        return fold_tile(u.clone(), None, 1.0, y, state, torch.bfloat16, False, fused=fused), state

    run.tile = u
    (got, st_f), (want, st_t) = run(True), run(False)
    err = max((a - b).abs().max().item() for a, b in zip((st_f.s, st_f.c, st_f.z_y), (st_t.s, st_t.c, st_t.z_y)))
    e_err = (got.e.float() - want.e.float()).abs().max().item()
    if err > 1e-3 * cols or e_err > 1e-2:
        raise AssertionError(f"fused fold differs from the torch fold: state {err:.3g}, e {e_err:.3g}")
    return {"max_state_err": err, "max_err": e_err, **_fused_against_torch(run, rows, cols, 6, device, repeats)}


def grad_case(rows: int, cols: int, device: torch.device, repeats: int) -> dict:
    """One tile's gradient G (kernels/tiles.py grad_tile, with the entropy's term, G in bf16), fused against the
    torch ops, as :func:`fold_case` (6 bytes a tile element)."""
    from grpoflow.kernels.tiles import grad_tile

    u, y = _tile(rows, cols, device)
    lse = torch.logsumexp(u, 1) + 1.0
    g_t, ent, ge_t = (torch.randn(rows, device=device) for _ in range(3))

    def run(fused: bool):
        return grad_tile(u.clone(), None, 1.0, lse, y, g_t, ent.abs(), ge_t, torch.bfloat16, fused=fused)

    run.tile = u
    got, want = run(True).float(), run(False).float()
    err = ((got - want).abs().max() / want.abs().max()).item()  # bf16: one rounding step apart is 2^-8 of a value
    if err > 2**-7:
        raise AssertionError(f"fused gradient differs from the torch one by {err:.3g} of its largest entry")
    return {"max_err": err, **_fused_against_torch(run, rows, cols, 6, device, repeats)}


def tile_cases(device: torch.device, small: bool, repeats: int) -> list[Case]:
    """The fold and the gradient at each of TILES (toy tiles with --small)."""
    tiles = ((16, 300), (8, 64)) if small else TILES
    return [
        Case(f"{kind}/{r}x{c}", lambda f=fn, a=(r, c, device, repeats): f(*a), est_s=3.0)
        for kind, fn in (("fold", fold_case), ("grad", grad_case))
        for r, c in tiles
    ]


def reference_timing_cases(device: torch.device, small: bool, repeats: int) -> list[Case]:
    """The naive float32 reference at the timing shapes, after everything else (it materializes [N, V] float32
    logits: 10 GB at N=16384), where memory allows."""
    return timing_cases(device, small, repeats, impls=("reference",))


def peer_cases(device: torch.device, small: bool, repeats: int) -> list[Case]:
    """The peers that are not a log-prob pass alone: TRL's Triton log-softmax over materialized logits and Liger's
    fused linear GRPO loss (fwd+bwd only: FUSED_BACKWARD), at the first two timing shapes."""
    shapes = timing_shapes(small)[:2]
    cases = []
    for impl in ("trl_triton", "liger"):
        for n, d, v in shapes:
            args = (impl, n, d, v, False, device, repeats)
            cases.append(Case(f"{impl}/frozen/{n}x{d}x{v}", lambda a=args: timing_case(*a), est_s=8.0))
    return cases


def comparisons(timing: dict) -> list[dict]:
    """Per shape and head: triton / chunked, each / bare and each peer / triton (time ratios, fwd and fwd+bwd),
    which of ours is faster in each pass (faster_fwd, faster_fwd_bwd: what the auto table records) and the fastest
    of all measured in the training pass (fastest_fwd_bwd), from the timing section's passed cases."""
    by_key: dict[tuple, dict] = {}
    for name, rec in timing.items():
        if rec.get("status") == "passed":
            impl = name.split("/", 1)[0]
            by_key.setdefault((rec["N"], rec["D"], rec["V"], rec["head"]), {})[impl] = rec
    rows = []
    for (n, d, v, head), got in by_key.items():
        row = {"N": n, "D": d, "V": v, "head": head}
        pairs = [("triton", "chunked"), ("triton", "bare"), ("chunked", "bare")]
        pairs += [(peer, "triton") for peer in ("trl_chunked", "liger_flce")] + [
            ("trl_chunked", "bare"),
            ("liger_flce", "bare"),
        ]
        for mode in ("fwd", "fwd_bwd"):
            for a, b in pairs:
                ta, tb = (got[k].get(f"{mode}_ms") if k in got else None for k in (a, b))
                if ta is not None and tb:
                    row[f"{a}/{b}_{mode}"] = ta / tb
        timed = {k: c["fwd_bwd_ms"] for k, c in got.items() if k != "bare" and c.get("fwd_bwd_ms") is not None}
        if timed:
            row["fastest_fwd_bwd"] = min(timed, key=timed.get)
        if "triton" in got and "chunked" in got:
            row["faster_fwd_bwd"] = min(("triton", "chunked"), key=lambda k: got[k]["fwd_bwd_ms"])
            row["faster_fwd"] = min(("triton", "chunked"), key=lambda k: got[k]["fwd_ms"])
        rows.append(row)
    return rows
