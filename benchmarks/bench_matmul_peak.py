"""This machine's limits at a thread count: sustained matmul FLOP/s (float32, bfloat16 where it runs) and memory
bandwidth, the denominators of the MFU and of the decoding bound that bench_trl_throughput.py prints.

    matmul    square GEMMs C = A B of a few sizes (2 n^3 FLOPs each), repeated for about --seconds each; the
              best size's best repeat is the peak (a sustained rate: each repeat runs >= 0.2 s of GEMMs)
    copy      a large tensor copy (--copy-mib, far past the caches): (read + write bytes) / seconds, best repeat

Runs in seconds. The load gate of the protocol applies (benchmarks/protocol.py): on a busy machine it stops
unless --allow-contended.

    python benchmarks/bench_matmul_peak.py --threads 2
    python benchmarks/bench_matmul_peak.py --threads 2 --json peak.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import protocol  # noqa: E402

SIZES = (256, 512, 1024, 2048)


def gemm_rate(n: int, dtype, seconds: float) -> float:
    """Best FLOP/s of repeats of n x n GEMMs, each repeat looping for >= 0.2 s, within about ``seconds``."""
    import torch

    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    c = torch.empty(n, n, dtype=dtype)
    torch.mm(a, b, out=c)  # warm-up: thread pool, the library's packing buffers
    best, end = 0.0, time.perf_counter() + seconds
    while True:
        k, t0 = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - t0) < 0.2:
            torch.mm(a, b, out=c)
            k += 1
        best = max(best, 2 * n**3 * k / elapsed)
        if time.perf_counter() >= end:
            return best


def copy_bandwidth(mib: int, repeats: int = 5) -> float:
    """Best bytes/s of copying a ``mib`` MiB float32 tensor into another (read + write counted)."""
    import torch

    src = torch.ones(mib * (1 << 20) // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = max(best, 2 * src.numel() * 4 / (time.perf_counter() - t0))
    return best


def measure(threads: int, seconds: float = 1.0, copy_mib: int = 512, sizes=SIZES) -> dict:
    """{"threads", "fp32_tflops", "bf16_tflops" (None when bf16 GEMMs fail), "per_size", "copy_gbs"}."""
    import torch

    torch.set_num_threads(threads)
    per_size: dict[str, dict[int, float]] = {"float32": {}, "bfloat16": {}}
    bf16_error = None
    for n in sizes:
        per_size["float32"][n] = gemm_rate(n, torch.float32, seconds) / 1e12
        if bf16_error is None:
            try:
                per_size["bfloat16"][n] = gemm_rate(n, torch.bfloat16, seconds) / 1e12
            except RuntimeError as e:
                bf16_error = f"{type(e).__name__}: {str(e).splitlines()[0]}"
    return {
        "threads": threads,
        "torch": torch.__version__,
        "fp32_tflops": round(max(per_size["float32"].values()), 4),
        "bf16_tflops": round(max(per_size["bfloat16"].values()), 4) if per_size["bfloat16"] else None,
        "bf16_error": bf16_error,
        "per_size_tflops": {k: {n: round(v, 4) for n, v in d.items()} for k, d in per_size.items()},
        "copy_gbs": round(copy_bandwidth(copy_mib) / 1e9, 2),
        "copy_mib": copy_mib,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=1.0, help="time per GEMM size and dtype")
    ap.add_argument("--copy-mib", type=int, default=512)
    ap.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    ap.add_argument("--json", type=Path, help="write the result here too")
    ap.add_argument("--emit", action="store_true", help=argparse.SUPPRESS)  # as a protocol side process
    protocol.add_protocol_args(ap, rounds=2)
    args = ap.parse_args()
    if args.emit:  # the parent applied the gate
        protocol.emit(measure(args.threads, args.seconds, args.copy_mib, args.sizes))
        return
    before = protocol.wait_for_quiet(args, "matmul peak")
    watch = protocol.LoadWatch().start()
    t0 = time.process_time()
    res = measure(args.threads, args.seconds, args.copy_mib, args.sizes)
    res["load"] = {"before": before, "during": watch.stop(time.process_time() - t0)}
    res["cpu"] = protocol.cpu_name()
    bf16 = res["bf16_tflops"] * 1e3 if res["bf16_tflops"] else float("nan")
    print(f"{res['cpu']}, {args.threads} threads: float32 {res['fp32_tflops'] * 1e3:.1f} GFLOP/s, bfloat16 "
          f"{bf16:.1f} GFLOP/s, copy {res['copy_gbs']} GB/s "
          f"(load {before['load1']}, other cores during {res['load']['during']['other_cores']})")  # fmt: skip
    for dtype, d in res["per_size_tflops"].items():
        print(f"  {dtype:9s} " + "  ".join(f"n={n}: {v * 1e3:.1f}" for n, v in d.items()) + "  GFLOP/s")
    if args.json:
        args.json.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
