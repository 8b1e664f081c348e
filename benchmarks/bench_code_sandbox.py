"""Time per program of the code_tests reward on HumanEval: the 164 canonical solutions (all must pass) and a
broken variant of each (``return None``: all must fail), one program per reward call, wall clock: the median
(robust to other load on a shared machine) and the mean.

    python benchmarks/bench_code_sandbox.py                     # the current code, one process
    python benchmarks/bench_code_sandbox.py --compare-cap       # grpo.code_reward.cpus 1 (the default) against 256

``--compare-cap`` follows the protocol (benchmarks/protocol.py: quiet machine before each round, each side a fresh
process, sides alternating for --rounds rounds, each round's ratio). Both sides do the same work: each run gets its
own cgroup with a CPU quota written, 1 CPU on one side and 256 (a quota no run reaches) on the other, so the ratio
is the cost of the cap binding, not of writing it. A HumanEval program and its judge are single-threaded and run
one after the other, so the cap is expected to cost nothing; the benchmark checks that.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import protocol  # noqa: E402

from grpoflow.tasks.config import CodeRewardConfig  # noqa: E402
from grpoflow.tasks.dataio.sources import humaneval_rows  # noqa: E402
from grpoflow.tasks.rewards.code import CodeTests  # noqa: E402

SIDES = {"capped": 1.0, "uncapped": 256.0}  # grpo.code_reward.cpus of each side


def measure(cpus: float) -> dict:
    rows = humaneval_rows()
    reward = CodeTests(CodeRewardConfig(timeout_s=30, workers=1, cpus=cpus))
    mode = reward.check_isolation()  # the one-off probe is not timed
    good = [f"```python\n{r['prompt']}{r['canonical_solution']}```" for r in rows]
    broken = [f"```python\n{r['prompt']}    return None\n```" for r in rows]
    out: dict = {"cpus": cpus, "isolation": mode}
    for name, completions in (("canonical", good), ("broken", broken)):
        scores, times = [], []
        for r, c in zip(rows, completions, strict=True):
            t0 = time.perf_counter()
            scores += reward(["p"], [c], answer=[r["answer"]], question=[r["prompt"]])
            times.append(1000 * (time.perf_counter() - t0))
        failing = [
            r["task_id"] for r, s in zip(rows, scores, strict=True) if s != (1.0 if name == "canonical" else 0.0)
        ]
        out[name] = {
            "programs": len(rows),
            "passed": sum(s == 1.0 for s in scores),
            "median_ms": round(statistics.median(times), 1),
            "mean_ms": round(statistics.mean(times), 1),
            "unexpected": failing,
        }
    return out


def _describe(run: protocol.SideRun) -> str:
    d = run.result
    return (f"canonical median {d['canonical']['median_ms']} ms ({d['canonical']['passed']} passed), broken "
            f"{d['broken']['median_ms']} ms ({d['broken']['passed']} passed), {d['isolation']}")  # fmt: skip


def compare_cap(args: argparse.Namespace) -> None:
    print(f"machine now: {protocol.quiet_now()}, {protocol.machine()}")
    argv = lambda side: [sys.executable, __file__, "--side", str(SIDES[side])]  # noqa: E731
    runs = protocol.alternate(args, list(SIDES), argv, _describe)
    protocol.print_rounds(runs)
    ok = {(r.round, r.side): r.result for r in runs if not r.error}
    result = []
    for kind in ("canonical", "broken"):
        ratio = protocol.compare(  # a ratio of times: above 1, the cap slows a program
            runs, "capped", "uncapped", lambda d, k=kind: d[k]["median_ms"], f"{kind}: capped/uncapped median ms"
        )
        med = {s: [ok[k][kind]["median_ms"] for k in ok if k[1] == s] for s in SIDES}
        result.append(f"{kind}: median ms capped {med['capped']} / uncapped {med['uncapped']}, "
                      f"ratio {ratio['median']:.3f}")  # fmt: skip
    print("RESULTS.md row:\n" + protocol.results_row(runs, "1/1", "; ".join(result), ratio))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compare-cap", action="store_true", help="grpo.code_reward.cpus 1 against 256 (the protocol)")
    ap.add_argument("--side", type=float, default=None, help=argparse.SUPPRESS)
    protocol.add_protocol_args(ap)
    args = ap.parse_args()
    if args.side is not None:
        return protocol.side_main(lambda: measure(args.side))
    if args.compare_cap:
        return compare_cap(args)
    print(json.dumps(measure(CodeRewardConfig().cpus), indent=1))


if __name__ == "__main__":
    main()
