"""The benchmark protocol every speed comparison here follows (docs/benchmarks.md):

- quiet machine: the 1-minute load average must be below ``--max-load`` (1.0) before each round; the round
  waits up to ``--wait`` seconds for it, then the benchmark stops, unless ``--allow-contended``, which runs
  anyway and marks the round (and the result) "contended". During a round the cores busy with *other*
  processes are measured too (/proc/stat's non-idle time less the round's own CPU time); above
  ``--max-other-cores`` (0.5) the round is marked contended as well;
- each side of a round runs in a fresh process (:func:`spawn`), so neither inherits the other's warm caches,
  thread pools or allocator state; its whole-process wall time and peak resident memory (max RSS of the
  process and its waited-for children, from ``wait4``) are recorded;
- sides alternate (ours, peer, ours, peer, ...) for at least 2 rounds; each round's ratio and the spread of
  the ratios are printed (:func:`ratios`);
- the result ends with a row to paste into benchmarks/RESULTS.md (:func:`results_row`): date, commit, command,
  cores, threads, load.

A side's process prints its measurements as one JSON line prefixed ``BENCH_RESULT `` (:func:`emit`); the time
its process started is passed to it in ``$BENCH_T0`` (epoch seconds) so it can report time to first step.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULT_PREFIX = "BENCH_RESULT "
T0_ENV = "BENCH_T0"


# ------------------------------------------------------------------ load and busy cores
def cpu_sample() -> tuple[int, int]:
    """(idle + iowait, total) jiffies of all CPUs from /proc/stat's first line (guest time is inside user)."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    return values[3] + values[4], sum(values[:8])


def busy_cores(before: tuple[int, int], after: tuple[int, int], cores: int) -> float:
    """Cores busy on average between two :func:`cpu_sample`'s: (1 - d_idle / d_total) x cores."""
    d_total = after[1] - before[1]
    return 0.0 if d_total <= 0 else (1 - (after[0] - before[0]) / d_total) * cores


def cores() -> int:
    """CPUs this process may run on (its affinity), which is what its threads can use."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def load1() -> float:
    return os.getloadavg()[0]


def quiet_now(seconds: float = 1.0) -> dict:
    """The 1-minute load average and the cores busy over the next ``seconds`` (this process sleeping)."""
    a = cpu_sample()
    time.sleep(seconds)
    return {"load1": round(load1(), 2), "busy_cores": round(busy_cores(a, cpu_sample(), cores()), 2)}


class LoadWatch:
    """Samples the 1-minute load average every second while a round runs (a daemon thread) and /proc/stat at
    its start and end; :meth:`stop` returns the round's max load and the cores busy with other processes."""

    def __init__(self):
        self.loads: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            self.loads.append(load1())

    def start(self) -> LoadWatch:
        self.t0, self.cpu0 = time.perf_counter(), cpu_sample()
        self._thread.start()
        return self

    def stop(self, own_cpu_seconds: float) -> dict:
        self._stop.set()
        self._thread.join()
        wall = time.perf_counter() - self.t0
        busy = busy_cores(self.cpu0, cpu_sample(), cores())
        return {
            "load1_max": round(max(self.loads, default=load1()), 2),
            "busy_cores": round(busy, 2),
            # what the round itself kept busy (its user + system CPU time over its wall time) is not contention
            "other_cores": round(max(busy - own_cpu_seconds / max(wall, 1e-9), 0.0), 2),
        }


# ------------------------------------------------------------------ the gate
def add_protocol_args(ap: argparse.ArgumentParser, rounds: int = 2) -> None:
    g = ap.add_argument_group("protocol (docs/benchmarks.md)")
    g.add_argument("--rounds", type=int, default=rounds, help=f"alternating rounds, at least 2 ({rounds})")
    g.add_argument("--max-load", type=float, default=1.0, help="1-minute load average allowed before a round (1.0)")
    g.add_argument(
        "--max-other-cores", type=float, default=0.5, help="cores other processes may keep busy during a round (0.5)"
    )
    g.add_argument("--wait", type=float, default=300.0, help="seconds to wait for a quiet machine before a round")
    g.add_argument(
        "--allow-contended", action="store_true", help="run on a busy machine anyway; the result is marked contended"
    )


def check_rounds(args: argparse.Namespace) -> None:
    if args.rounds < 2:
        raise SystemExit(f"--rounds {args.rounds}: the protocol needs at least 2 alternating rounds")


def wait_for_quiet(args: argparse.Namespace, label: str) -> dict:
    """Block until the load average is below --max-load (at most --wait s). Returns the state before the round,
    ``contended`` True when it never got quiet and --allow-contended lets it run; exits otherwise."""
    deadline = time.monotonic() + args.wait
    while True:
        state = quiet_now()
        if state["load1"] < args.max_load:
            return state | {"contended": False}
        if time.monotonic() >= deadline:
            break
        time.sleep(min(10.0, max(deadline - time.monotonic(), 0.0)))
    if args.allow_contended:
        print(f"{label}: load {state['load1']} >= --max-load {args.max_load}: running anyway, marked contended")
        return state | {"contended": True}
    raise SystemExit(
        f"{label}: load average {state['load1']} (busy cores {state['busy_cores']}) stayed >= --max-load "
        f"{args.max_load} for {args.wait:.0f} s; measure on a quiet machine, or pass --allow-contended to run anyway "
        "(the result is then marked contended)"
    )


# ------------------------------------------------------------------ one side, in its own process
@dataclass
class SideRun:
    """One side of one round: what its process reported plus what the parent measured around it."""

    side: str
    round: int
    result: dict = field(default_factory=dict)  # the side's own JSON (empty when it failed)
    error: str | None = None
    process_wall_s: float = 0.0  # spawn to exit: imports, loading, engine start, the loop, teardown
    max_rss_mib: float = 0.0  # peak resident memory of the process (and its waited-for children)
    cpu_s: float = 0.0
    before: dict = field(default_factory=dict)
    during: dict = field(default_factory=dict)
    contended: bool = False


def spawn(side: str, rnd: int, argv: list[str], args: argparse.Namespace, env: dict | None = None) -> SideRun:
    """Run ``argv`` (a Python command line) as a fresh process after the quiet-machine gate, watching the load;
    its stdout's ``BENCH_RESULT`` line is its result, its stderr tail the error when it fails."""
    before = wait_for_quiet(args, f"round {rnd} {side}")
    environ = dict(os.environ, **(env or {}))
    t0 = time.time()
    environ[T0_ENV] = repr(t0)
    watch = LoadWatch().start()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(argv, env=environ, stdout=out, stderr=err, text=True)
        _, status, usage = os.wait4(proc.pid, 0)  # reaped here (not by Popen) for its own rusage
        proc.returncode = code = os.waitstatus_to_exitcode(status)
        out.seek(0), err.seek(0)
        stdout, stderr = out.read(), err.read()
    wall = time.time() - t0
    cpu = usage.ru_utime + usage.ru_stime
    run = SideRun(side, rnd, process_wall_s=round(wall, 2), cpu_s=round(cpu, 2), before=before)
    run.max_rss_mib = round(usage.ru_maxrss / 1024, 1)  # Linux: KiB
    run.during = watch.stop(cpu)
    run.contended = before["contended"] or run.during["other_cores"] > args.max_other_cores
    lines = [ln for ln in stdout.splitlines() if ln.startswith(RESULT_PREFIX)]
    if lines:
        run.result = json.loads(lines[-1][len(RESULT_PREFIX) :])
    if code != 0 or not lines or run.result.get("error"):
        head = run.result.get("error") or f"exit {code}"
        run.error = f"{stderr.strip()[-3000:]}\n{head}"  # the traceback's tail, then the one-line cause
    return run


def emit(result: dict) -> None:
    """A side process's last word: its measurements as one JSON line the parent picks out of stdout."""
    print(RESULT_PREFIX + json.dumps(result), flush=True)


def since_process_start() -> float:
    """Seconds since the parent spawned this process ($BENCH_T0); since now when run by hand."""
    t0 = float(os.environ.get(T0_ENV, time.time()))
    return time.time() - t0


# ------------------------------------------------------------------ ratios and the results row
def ratios(ours: list[float], peer: list[float]) -> dict:
    """Per-round ratios ours / peer (of a rate: higher is better for ours), their median, min, max and spread
    ((max - min) / median)."""
    rs = [a / b for a, b in zip(ours, peer, strict=True) if b > 0]
    if not rs:
        return {"per_round": [], "median": float("nan"), "min": float("nan"), "max": float("nan"), "spread": 0.0}
    med = statistics.median(rs)
    return {
        "per_round": [round(r, 3) for r in rs],
        "median": round(med, 3),
        "min": round(min(rs), 3),
        "max": round(max(rs), 3),
        "spread": round((max(rs) - min(rs)) / med, 3) if med else 0.0,
    }


def commit() -> str:
    """The repository's short commit, with "+dirty" when the working tree has changes."""
    try:
        sha = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain"], capture_output=True, text=True)
        return sha.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except OSError:
        return "unknown"


def command_line() -> str:
    return "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0], REPO), *sys.argv[1:]])


RESULTS_HEADER = (
    "| date (UTC) | commit | command | cores | threads (train/decode) | load before (max) | other cores during (max) "
    "| contended | result | per-round ratios | spread |\n|---|---|---|---:|---|---:|---:|---|---|---|---:|"
)


def results_row(runs: list[SideRun], threads: str, result: str, ratio: dict) -> str:
    """One RESULTS.md row (RESULTS_HEADER's columns) for a finished comparison."""
    before = max((r.before.get("load1", 0.0) for r in runs), default=0.0)
    other = max((r.during.get("other_cores", 0.0) for r in runs), default=0.0)
    contended = "yes" if any(r.contended for r in runs) else "no"
    per_round = ", ".join(f"{x:.2f}" for x in ratio["per_round"]) or "-"
    date = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M")
    return (
        f"| {date} | {commit()} | `{command_line()}` | {cores()} | {threads} | {before:.2f} | {other:.2f} | "
        f"{contended} | {result} | {per_round} | {ratio['spread']:.1%} |"
    )


def print_rounds(runs: list[SideRun]) -> None:
    """The protocol's per-round table: load and other cores before/during, wall time, peak RSS, contended."""
    print(f"\n{'round':>5} {'side':12} {'load before':>11} {'load max':>8} {'other cores':>11} "
          f"{'process s':>9} {'max RSS MiB':>11}  contended")  # fmt: skip
    for r in runs:
        print(
            f"{r.round:5d} {r.side:12} {r.before.get('load1', 0):11.2f} {r.during.get('load1_max', 0):8.2f} "
            f"{r.during.get('other_cores', 0):11.2f} {r.process_wall_s:9.1f} {r.max_rss_mib:11.1f}  "
            f"{'yes' if r.contended else 'no'}" + (f"  FAILED: {r.error.splitlines()[-1][:160]}" if r.error else "")
        )


def to_json(runs: list[SideRun]) -> list[dict]:
    return [asdict(r) for r in runs]
