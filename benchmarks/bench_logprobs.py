"""Per-token log-probs, forward + backward: chunked torch (kernels.logprobs) vs materialized logits.

Each case runs in a fresh process and reports the process's peak RSS growth over a baseline taken
after the inputs exist (ru_maxrss before/after), so the numbers are what the computation itself
adds on top of H and W. Times are the median of --repeats runs after one warm-up; both
implementations run side by side in one invocation so their ratio is meaningful on a noisy host.

    python benchmarks/bench_logprobs.py                 # quick shape
    python benchmarks/bench_logprobs.py --n 8192 --d 512 --v 32768
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time


def run_case(impl: str, n: int, d: int, v: int, repeats: int) -> dict:
    import torch

    from kernels.logprobs import token_logprobs, token_logprobs_reference

    torch.manual_seed(0)
    h = torch.randn(n, d, requires_grad=True)
    w = torch.randn(v, d) * 0.02
    y = torch.randint(0, v, (n,))

    def step():
        if impl == "chunked":
            lp, _ = token_logprobs(h, w, y)
        else:
            lp, _ = token_logprobs_reference(h, w, y)
        lp.sum().backward()
        h.grad = None

    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    step()  # warm-up (and the peak)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"impl": impl, "seconds": statistics.median(times), "peak_mb": (peak - base) / 1024}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=2048)
    p.add_argument("--d", type=int, default=256)
    p.add_argument("--v", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--case", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.case:
        print(json.dumps(run_case(a.case, a.n, a.d, a.v, a.repeats)))
        return
    rows = {}
    for impl in ("naive", "chunked"):
        cmd = [
            sys.executable,
            __file__,
            "--case",
            impl,
            "--n",
            str(a.n),
            "--d",
            str(a.d),
            "--v",
            str(a.v),
            "--repeats",
            str(a.repeats),
        ]
        rows[impl] = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    print(f"N={a.n} D={a.d} V={a.v} float32, forward+backward (dH)")
    for r in rows.values():
        print(f"  {r['impl']:8s} {r['seconds'] * 1e3:9.1f} ms  peak +{r['peak_mb']:8.1f} MB")
    n, c = rows["naive"], rows["chunked"]
    mem = c["peak_mb"] / max(n["peak_mb"], 1e-9)
    print(f"  chunked/naive: time {c['seconds'] / n['seconds']:.2f}x, memory {mem:.3f}x")


if __name__ == "__main__":
    main()
