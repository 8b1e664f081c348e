"""Per-token log-probs, forward + backward (dH; the head frozen, as with LoRA), on CPU in float32.

Cases, all run side by side in one invocation so that their ratios are meaningful on a noisy host:

    naive      materialized logits + log_softmax (kernels.logprobs.token_logprobs_reference)
    fused      kernels.logprobs.token_logprobs, impl="chunked" (chunked, online logsumexp, J trick)
    fused+ent  the same with compute_entropy=True (what the GRPO trainer calls)
    bare       the two matmuls the math needs, into preallocated outputs: Z = H W^T, then Z W (the dH GEMM)
    trl        TRL's ChunkedLogProbFunction (trl/kernels/chunked_logprob.py; on CPU its tiles fold in torch),
               with the vocabulary chunk TRL's trainer uses (32768)
    liger      Liger-Kernel's LigerFusedLinearGRPOLoss (compiled=False, beta=0): log-probs + the GRPO loss,
               H reshaped to [8, N/8, D]; skipped with the reason when liger-kernel is not importable

Memory: each case runs in a fresh process. Once its inputs exist, it resets the kernel's peak-RSS mark
(writing 5 to /proc/self/clear_refs; Linux) and notes VmRSS; after the first forward + backward, VmHWM minus
that VmRSS is what the computation added on top of H and W. CPU tensors are plain malloc blocks, the large
ones mmap'ed and unmapped on free, so no caching allocator hides or inflates the peak.

Time: the median over all timed steps. Each case process runs one warm-up step (the memory peak), then
--repeats timed steps; --rounds rounds visit the cases in turn, so a burst of load on the shared host hits
every case rather than one.

    python benchmarks/bench_logprobs.py            # N=8192 D=512 V=32768 (minutes)
    python benchmarks/bench_logprobs.py --quick    # N=2048 D=256 V=8192
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time

CASES = ("naive", "fused", "fused+ent", "bare", "trl", "liger")
# (numerator, denominator, target) of the printed ratios
RATIOS = [
    ("fused", "naive", "time <= 1.2x, memory <= 1/16"),
    ("fused", "bare", "time <= 1.5x"),
    ("fused+ent", "bare", ""),
    ("naive", "bare", ""),
    ("fused", "trl", ""),
    ("fused", "liger", ""),
    ("trl", "naive", ""),
    ("liger", "naive", ""),
]
TRL_VOCAB_CHUNK = 32768  # trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE in TRL 1.16


def make_step(case: str, n: int, d: int, v: int):
    """Inputs and a closure running one forward + backward of ``case``."""
    import torch

    from grpoflow.kernels.logprobs import token_logprobs, token_logprobs_reference

    torch.manual_seed(0)
    h = torch.randn(n, d, requires_grad=True)
    w = torch.randn(v, d).mul_(0.02)
    y = torch.randint(0, v, (n,))

    def backward(loss):
        loss.backward()
        h.grad = None

    if case == "naive":
        return lambda: backward(token_logprobs_reference(h, w, y)[0].sum())
    if case in ("fused", "fused+ent"):
        ent = case == "fused+ent"
        return lambda: backward(token_logprobs(h, w, y, compute_entropy=ent, impl="chunked")[0].sum())
    if case == "bare":
        z, dh = torch.empty(n, v), torch.empty(n, d)
        return lambda: (torch.mm(h.detach(), w.t(), out=z), torch.mm(z, w, out=dh))
    if case == "trl":
        from trl.kernels.chunked_logprob import ChunkedLogProbFunction

        args = (None, y, 1.0, TRL_VOCAB_CHUNK, None, 1.0, ())
        return lambda: backward(ChunkedLogProbFunction.apply(h, w, *args)[0].sum())
    if case == "liger":
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

        loss_fn = LigerFusedLinearGRPOLoss(beta=0.0, compiled=False, use_ref_model=False)
        b = 8
        hb, yb = h.view(b, n // b, d), y.view(b, n // b)
        mask, adv = torch.ones(b, n // b), torch.randn(b)
        return lambda: backward(loss_fn(hb, w, yb, mask, adv)[0])
    raise ValueError(f"unknown case {case!r}: expected one of {CASES}")


def memory_kb(field: str) -> int:
    """VmRSS (resident now) or VmHWM (peak resident since the last reset) of this process, in kB."""
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M).group(1))


def measure(step, repeats: int) -> dict:
    """Peak RSS growth (MB) of the first ``step()`` in this process, then the seconds of ``repeats`` more."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    base = memory_kb("VmRSS")
    step()
    peak = memory_kb("VmHWM")
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return {"seconds": times, "peak_mb": (peak - base) / 1024}


def spawn(script: str, args: list[str]) -> dict:
    """Run ``script`` in a fresh Python process and parse the JSON its last output line holds."""
    out = subprocess.run([sys.executable, script, *args], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{script} {' '.join(args)} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.splitlines()[-1])


def liger_unavailable() -> str | None:
    try:
        import liger_kernel.chunked_loss  # noqa: F401
    except Exception as e:  # an import failure is the reason to print
        return f"{type(e).__name__}: {e}"
    return None


def report(rows: dict[str, dict], a: argparse.Namespace) -> None:
    print(f"N={a.n} D={a.d} V={a.v} float32, forward+backward (dH), {a.rounds} rounds x {a.repeats} steps")
    print(f"  {'case':10s} {'median s':>9s} {'min s':>7s} {'peak +MB':>9s}")
    for case, r in rows.items():
        print(f"  {case:10s} {statistics.median(r['seconds']):9.2f} {min(r['seconds']):7.2f} {r['peak_mb']:9.1f}")
    t = {case: statistics.median(r["seconds"]) for case, r in rows.items()}
    fastest = {case: min(r["seconds"]) for case, r in rows.items()}
    mem = {case: r["peak_mb"] for case, r in rows.items()}
    print("ratios (time: of medians, and of minima, the least disturbed steps; memory: of peak RSS growth)")
    for num, den, target in RATIOS:
        if num in t and den in t:
            line = f"  {num + ' / ' + den:20s} time {t[num] / t[den]:5.2f}x (min {fastest[num] / fastest[den]:5.2f}x)"
            if den != "bare":
                ratio = mem[num] / mem[den]
                line += f"   memory {ratio:7.4f}x" + (f" (1/{1 / ratio:.0f})" if ratio < 1 else "")
            print(line + (f"   target {target}" if target else ""))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="N=2048 D=256 V=8192")
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--d", type=int, default=512)
    p.add_argument("--v", type=int, default=32768)
    p.add_argument("--repeats", type=int, default=3, help="timed steps per case process")
    p.add_argument("--rounds", type=int, default=2, help="fresh processes per case, visited in turn")
    p.add_argument("--case", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.quick:
        a.n, a.d, a.v = 2048, 256, 8192
    if a.case:
        print(json.dumps(measure(make_step(a.case, a.n, a.d, a.v), a.repeats)))
        return
    cases = list(CASES)
    if reason := liger_unavailable():
        print(f"liger: not run ({reason})")
        cases.remove("liger")
    rows = {case: {"seconds": [], "peak_mb": 0.0} for case in cases}
    for _ in range(a.rounds):
        for case in cases:
            r = spawn(
                __file__,
                ["--case", case, "--n", str(a.n), "--d", str(a.d), "--v", str(a.v), "--repeats", str(a.repeats)],
            )
            rows[case]["seconds"] += r["seconds"]
            rows[case]["peak_mb"] = max(rows[case]["peak_mb"], r["peak_mb"])
    report(rows, a)


if __name__ == "__main__":
    main()
