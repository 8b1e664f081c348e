"""Time per program of the code_tests reward on HumanEval: the 164 canonical solutions (all must pass) and a
broken variant of each (``return None``: all must fail), one program per reward call, wall clock: the median
(robust to other load on a shared machine) and the mean.

    PYTHONPATH=.pkg python benchmarks/bench_code_sandbox.py
"""

from __future__ import annotations

import json
import statistics
import time

from grpoflow.tasks.config import CodeRewardConfig
from grpoflow.tasks.dataio.sources import humaneval_rows
from grpoflow.tasks.rewards.code import CodeTests


def main() -> None:
    rows = humaneval_rows()
    reward = CodeTests(CodeRewardConfig(timeout_s=30, workers=1))
    reward.check_isolation()  # the one-off probe is not timed
    good = [f"```python\n{r['prompt']}{r['canonical_solution']}```" for r in rows]
    broken = [f"```python\n{r['prompt']}    return None\n```" for r in rows]
    out = {}
    for name, completions in (("canonical", good), ("broken", broken)):
        scores, times = [], []
        for r, c in zip(rows, completions):
            t0 = time.perf_counter()
            scores += reward(["p"], [c], answer=[r["answer"]], question=[r["prompt"]])
            times.append(1000 * (time.perf_counter() - t0))
        failing = [r["task_id"] for r, s in zip(rows, scores) if s != (1.0 if name == "canonical" else 0.0)]
        out[name] = {
            "programs": len(rows),
            "passed": sum(s == 1.0 for s in scores),
            "median_ms": round(statistics.median(times), 1),
            "mean_ms": round(statistics.mean(times), 1),
            "unexpected": failing,
        }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
