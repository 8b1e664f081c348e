"""Per-token log-probs, forward + backward (dH; the head frozen, as with LoRA), on CPU in float32.

Cases:

    naive      materialized logits + log_softmax (kernels.logprobs.token_logprobs_reference)
    fused      kernels.logprobs.token_logprobs, impl="chunked" (chunked, online logsumexp, J trick)
    fused+ent  the same with compute_entropy=True (what the GRPO trainer calls)
    bare       the two matmuls the math needs, into preallocated outputs: Z = H W^T, then Z W (the dH GEMM)
    trl        TRL's ChunkedLogProbFunction (trl/kernels/chunked_logprob.py; on CPU its tiles fold in torch),
               with the vocabulary chunk TRL's trainer uses (32768)
    liger      Liger-Kernel's LigerFusedLinearGRPOLoss (compiled=False, beta=0): log-probs + the GRPO loss,
               H reshaped to [8, N/8, D]; skipped with the reason when liger-kernel is not importable

Under the benchmark protocol (benchmarks/protocol.py, docs/benchmarks.md): every case runs in a fresh process,
--rounds rounds (>= 2) visiting the cases in turn, each process gated on a quiet machine, all with --threads torch
threads. A case process builds its inputs (set-up s), runs one forward + backward (first s, and its memory peak),
then --repeats timed steps (median s).

Memory: once a case's inputs exist, its process resets the kernel's peak-RSS mark (writing 5 to
/proc/self/clear_refs; Linux) and notes VmRSS; after the first forward + backward, VmHWM minus that VmRSS ("first
peak MiB") is what the computation added on top of H and W. CPU tensors are plain malloc blocks, the large ones
mmap'ed and unmapped on free, so no caching allocator hides or inflates the peak. The protocol's max RSS (the whole
process, imports included) is printed beside it.

Printed: the per-case table, the protocol's per-round table, per-round ratios (with their spread) of the step time
and of the first-call peak for each pair below, and a RESULTS.md row (fused / naive).

    python benchmarks/bench_logprobs.py            # N=8192 D=512 V=32768 (minutes)
    python benchmarks/bench_logprobs.py --quick    # N=2048 D=256 V=8192
    python benchmarks/bench_logprobs.py --n 256 --d 32 --v 512 --repeats 1 --cases naive fused \\
        --allow-contended --wait 0                  # smoke run: checks the fields only
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import protocol  # noqa: E402

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


def no_work(step):
    """``step`` as a call that reports no work (the protocol's calls may return the work they did)."""

    def call() -> None:
        step()

    return call


def liger_unavailable() -> str | None:
    try:
        import liger_kernel.chunked_loss  # noqa: F401
    except Exception as e:  # an import failure is the reason to print
        return f"{type(e).__name__}: {e}"
    return None


def report(runs: list[protocol.SideRun], a: argparse.Namespace) -> None:
    print(f"\n== N={a.n} D={a.d} V={a.v} float32, forward+backward (dH), {a.threads} torch threads in every case, "
          f"{a.rounds} rounds x {a.repeats} timed steps")  # fmt: skip
    protocol.print_calls(runs)
    protocol.print_rounds(runs)
    print("ratios per round (time: of the median step; memory: of the first call's peak above its start)")
    ran = {r.side for r in runs if not r.error}
    time_of, peak_of = (lambda d: d["median_s"]), (lambda d: d["first_peak_mib"])
    main = {}
    for num, den, target in RATIOS:
        if num not in ran or den not in ran:
            continue
        if target:
            print(f"target {num} / {den}: {target}")
        main[num, den, "time"] = protocol.compare(runs, num, den, time_of, f"{num}/{den} time")
        if den != "bare":
            main[num, den, "memory"] = protocol.compare(runs, num, den, peak_of, f"{num}/{den} first-call peak")
    t, m = main.get(("fused", "naive", "time")), main.get(("fused", "naive", "memory"))
    if t and t["per_round"]:
        result = f"log-probs N={a.n} D={a.d} V={a.v}: fused/naive time {t['median']:.2f}x, memory {m['median']:.4f}x"
    else:
        t = protocol.ratios([], [])
        result = f"log-probs N={a.n} D={a.d} V={a.v}: no fused/naive ratio (a case failed or was not run)"
    print("RESULTS.md row:\n" + protocol.results_row(runs, f"{a.threads}/-", result, t))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="N=2048 D=256 V=8192")
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--d", type=int, default=512)
    p.add_argument("--v", type=int, default=32768)
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    p.add_argument("--repeats", type=int, default=3, help="timed steps per case process")
    p.add_argument("--threads", type=int, default=2, help="torch threads of every case (2)")
    protocol.add_protocol_args(p)
    p.add_argument("--side", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.quick:
        a.n, a.d, a.v = 2048, 256, 8192
    if a.side:
        return protocol.side_main(lambda: protocol.measure_calls(lambda: no_work(make_step(a.side, a.n, a.d, a.v)),
                                                                 a.repeats, a.threads))  # fmt: skip
    protocol.check_rounds(a)
    cases = list(a.cases)
    if "liger" in cases and (reason := liger_unavailable()):
        print(f"liger: not run ({reason})")
        cases.remove("liger")
    print(f"machine now: {protocol.quiet_now()}, {protocol.machine()}")
    shape = ["--n", str(a.n), "--d", str(a.d), "--v", str(a.v), "--repeats", str(a.repeats)]
    shape += ["--threads", str(a.threads)]
    runs = protocol.alternate(a, cases, lambda case: [sys.executable, __file__, "--side", case, *shape])
    report(runs, a)


if __name__ == "__main__":
    main()
