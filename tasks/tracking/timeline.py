"""Where a `grpoflow run` spends its time outside the training loops: named instants of this process, and the
``startup/*``, ``stage/*``, ``stage_overhead/*`` and ``run/*`` seconds derived from them.

The CLI, the flow and the stages call :func:`mark` at fixed points (config loaded, heavy imports done, Prefect
server up, flow started, each stage's start and end, the SFT and GRPO loops' start, the generator built); the
flow turns them into metrics on the parent MLflow run (:func:`timeline_metrics`) and the CLI prints them.
Stages run in the flow's process (Prefect's thread runner), so their marks land here too; a GRPO stage launched
on several processes (torchrun) leaves its inner marks in those processes, and its loop start is then missing.

One process may run several runs: a test calls ``grpoflow run`` twice, the continuous flow runs a pipeline a
cycle. :func:`start_run` (the CLI's run and resume commands) and :func:`start_flow` (a flow after an earlier one
with no command between: a cycle) drop the earlier run's marks, so each run's times are its own; the process's
first run is timed from the process's start (its interpreter and imports are its start-up), a later one from its
own start (:func:`run_start`).
"""

from __future__ import annotations

import os
import time

_marks: dict[str, float] = {}
_started = False  # whether a run started in this process (start_run)
_run_start: float | None = None  # a later run's start (None: the process's)
IMPORTED_AT = time.time()  # imported first thing by grpoflow.flows (its __init__), so this is the interpreter's start
# plus site imports: well under a second
EXEC_GAP_S = 5.0


def process_start_time() -> float:
    """This process's start as epoch seconds: /proc/self/stat's starttime after boot (Linux), or the import of
    this module when that is more than EXEC_GAP_S earlier. starttime is when the process was forked, and a shell
    may exec the last command of a list into itself: in ``bash -c 'pip install ... && grpoflow run'`` the process
    is the shell's, started before pip, so its starttime would count the installation as the run's start-up.
    Elsewhere (no /proc): the import time."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, after "pid (comm)"
        with open("/proc/stat") as f:
            btime = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        forked = btime + start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return IMPORTED_AT
    return forked if IMPORTED_AT - forked <= EXEC_GAP_S else IMPORTED_AT


def mark(name: str) -> None:
    """Record ``name`` at the current time (the first time only: a resumed or repeated stage keeps its first)."""
    _marks.setdefault(name, time.time())


def marks() -> dict[str, float]:
    return dict(_marks)


def reset() -> None:
    global _started, _run_start
    _marks.clear()
    _started, _run_start = False, None


def start_run() -> None:
    """A run begins now: an earlier run's marks in this process are dropped, and a run after the process's first
    is timed from now."""
    global _started, _run_start
    _marks.clear()
    if _started:
        _run_start = time.time()
    _started = True


def start_flow() -> None:
    """Mark ``flow_start``. A flow after an earlier one with no :func:`start_run` between (the continuous flow's
    next cycle, a deployed run in a long-lived process) is a new run."""
    if "flow_start" in _marks or not _started:
        start_run()
    mark("flow_start")


def run_start() -> float:
    """When the current run began: the process's start (:func:`process_start_time`) for its first run, the run's
    own start for a later one."""
    return _run_start if _run_start is not None else process_start_time()


# (metric, from mark, to mark): "start" is the process start
SPANS = (
    ("startup/config_s", "start", "config_loaded"),  # interpreter, light imports, config validation
    ("startup/imports_s", "config_loaded", "imports_done"),  # the pipeline's heavy imports (torch, prefect, mlflow)
    ("startup/prefect_server_s", "imports_done", "prefect_server_up"),
    ("startup/flow_start_s", "prefect_server_up", "flow_start"),  # Prefect's flow-run creation
    ("startup/parent_run_s", "flow_start", "parent_run_open"),  # the workspace's config, the MLflow parent run
    ("startup/to_first_sft_loop_s", "start", "sft/loop_start"),
    ("startup/to_first_grpo_loop_s", "start", "grpo/loop_start"),
    ("startup/generator_s", "grpo/generator_start", "grpo/generator_up"),  # vLLM: the engine start
)


def timeline_metrics(m: dict[str, float], start: float, end: float, loops: dict[str, float]) -> dict[str, float]:
    """Seconds between marks ``m`` (epoch times, "start" = ``start``), up to ``end``:

    startup/<span>_s          SPANS, where both marks exist
    stage/<s>_s               stage <s>'s wall time (its end mark - its start mark), for every stage with both
    stage_overhead/<s>_s      stage/<s>_s - loops[<s>] for the stages with a training loop (sft, grpo)
    run/wall_s                end - start
    run/loop_s                sum of ``loops`` (each training loop's seconds)
    run/outside_loop_share    1 - run/loop_s / run/wall_s
    """
    at = {"start": start, **m}
    out = {k: at[b] - at[a] for k, a, b in SPANS if a in at and b in at}
    for s in (k.removeprefix("stage_start/") for k in m if k.startswith("stage_start/")):
        if f"stage_end/{s}" in at:
            out[f"stage/{s}_s"] = at[f"stage_end/{s}"] - at[f"stage_start/{s}"]
            if s in loops:
                out[f"stage_overhead/{s}_s"] = out[f"stage/{s}_s"] - loops[s]
    wall = end - start
    loop = sum(loops.values())
    out.update({"run/wall_s": wall, "run/loop_s": loop, "run/outside_loop_share": 1 - loop / wall if wall > 0 else 0})
    return {k: round(v, 3) for k, v in out.items()}
