"""Where a decode step's time goes: compute, per-op launch, and Python around the ops (issue 42's profile).

For each decoding loop (``ours``: the eager transformers loop, ``compiled``: the compiled static-shape step of
``generation.compile``), one call decodes the same rows as bench_generation.py (its options, its model folders, its
sampling settings) after a warm-up call (the compile, for ``compiled``). The call's wall time (unprofiled, median of
``--repeats``) is split by a torch.profiler run of one more call:

    compute floor   the call's matmul FLOPs (2 x matmul weights x rows, per decoded token) at this machine's float32
                    GEMM peak: what the call would take if only the matmuls ran, at their best rate
    kernels         the time inside the ops that do the work (aten ops; inductor's C++ kernels, profiled with
                    TORCHINDUCTOR_CPP_ENABLE_KERNEL_PROFILE=1), less the compute floor: small-shape GEMMs below
                    peak, elementwise and attention kernels, the sampler
    launch          ops x the fixed cost of one op (an aten add of two 1-element tensors, timed here): the
                    dispatcher's per-op price, paid whatever the op's size
    Python          the rest of the wall time: the Python between ops (the model's modules, the loop, dynamo's
                    guards and inductor's wrapper for ``compiled``)

The launch share is an estimate (an op's fixed cost sits inside the profiler's op time, so ``kernels`` above is
measured with it taken out). Profiling adds time between ops, so the wall time split is the unprofiled one and the
profiled call supplies only the op times and counts.

    python benchmarks/profile_decode.py                                   # tiny, 128 rows x 32 tokens, 1 thread
    python benchmarks/profile_decode.py --model smollm2-135m-instruct --prompts 4 --samples 8 --batch 32 \\
        --max-new-tokens 16 --repeats 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TORCHINDUCTOR_CPP_ENABLE_KERNEL_PROFILE", "1")  # before torch._inductor reads its config
sys.path.insert(0, str(Path(__file__).resolve().parent))
import protocol  # noqa: E402
from bench_generation import add_decoding_args, build_folder, roofs, setup_side  # noqa: E402

WORK_PREFIXES = ("aten::", "cpp_fused", "graph_", "mkl", "onednn", "mkldnn")  # ops that do work, not wrappers
NOT_WORK = ("aten::empty", "aten::view", "aten::as_strided", "aten::_reshape_alias", "aten::lift_fresh")


def op_fixed_cost_s(n: int = 20000) -> float:
    """The median time of one tiny aten op (an add of two 1-element tensors), over 5 runs of ``n`` calls."""
    import torch

    a, b = torch.ones(1), torch.ones(1)
    runs = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(n):
            torch.add(a, b)
        runs.append((time.perf_counter() - t) / n)
    return statistics.median(runs)


def op_time(prof) -> tuple[float, int]:
    """(seconds inside ops that do work, how many such ops ran): self time of every profiled op whose name is a
    kernel's (WORK_PREFIXES), wrappers excluded; allocator and view ops counted in time but not as launches."""
    total, count = 0.0, 0
    for e in prof.profiler.function_events:
        if e.name.startswith(WORK_PREFIXES):
            total += e.self_cpu_time_total / 1e6
            count += not e.name.startswith(NOT_WORK)
    return total, count


def profile_side(args, side: str, roof: dict, fixed_s: float) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.set_num_threads(args.threads)
    args.side = side
    call = setup_side(args)
    tokens = call()  # warm-up: the compile for `compiled`
    walls = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        tokens = call()
        walls.append(time.perf_counter() - t)
    wall = statistics.median(walls)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        call()
    ops_s, n_ops = op_time(prof)
    rows = min(args.batch, args.prompts * args.samples)
    steps = tokens / rows  # decode steps a call (all rows run to the limit: --stop length)
    floor = 2 * call.matmul_params * tokens / roof["flops"]
    launch = n_ops * fixed_s
    kernels = max(ops_s - launch - floor, 0.0)
    python = max(wall - ops_s, 0.0)
    return {
        "side": side,
        "wall": wall,
        "tokens": tokens,
        "steps": steps,
        "ops": n_ops,
        "split": {"compute floor": floor, "kernels above floor": kernels, "launch": launch, "Python": python},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_decoding_args(ap, "tiny, 25m, smollm2-135m-instruct", threads=1, repeats=3)
    ap.add_argument("--sides", nargs="+", choices=["ours", "compiled"], default=["ours", "compiled"])
    ap.add_argument("--peak-json", help="a bench_matmul_peak.py --json result at --threads (else measured here)")
    ap.add_argument("--batch", type=int, default=128, help="rows decoded together")
    args = ap.parse_args()
    if args.stop != "length":
        raise SystemExit("--stop: only length (every row decodes --max-new-tokens, so steps = tokens / rows)")
    print(f"machine now: {protocol.quiet_now()}, {protocol.machine()}")
    roof = roofs(args)
    fixed = op_fixed_cost_s()
    print(f"float32 GEMM peak {roof['flops'] / 1e9:.0f} GFLOP/s, one tiny op {fixed * 1e6:.2f} us, {args.threads} "
          f"thread(s)")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        args.folder = build_folder(args.model, args.cache_dir, Path(tmp))
        results = [profile_side(args, side, roof, fixed) for side in args.sides]
    rows = min(args.batch, args.prompts * args.samples)
    print(f"\n== {args.model}: {args.prompts * args.samples} rows in batches of {rows}, {args.max_new_tokens} tokens, "
          f"{args.threads} thread(s); per decode step (all rows), ms and share of the wall time")  # fmt: skip
    for r in results:
        per = {k: v / r["steps"] * 1e3 for k, v in r["split"].items()}
        parts = ", ".join(f"{k} {v:.2f} ({r['split'][k] / r['wall']:.0%})" for k, v in per.items())
        print(f"  {r['side']:9} {r['wall'] / r['steps'] * 1e3:6.2f} ms a step ({r['tokens'] / r['wall']:.0f} tok/s, "
              f"{r['ops'] / r['steps']:.0f} ops a step): {parts}")  # fmt: skip


if __name__ == "__main__":
    main()
