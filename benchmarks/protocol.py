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
  cores and CPU model, threads, load.

A side's process prints its measurements as one JSON line prefixed ``BENCH_RESULT `` (:func:`emit`); the time
its process started is passed to it in ``$BENCH_T0`` (epoch seconds) so it can report time to first step.

Benchmarks that time one call (a decoding round, a loss step) build their sides with :func:`measure_calls` (set-up,
first call with its memory peak, then the timed calls, with ``--threads`` torch threads) inside
:func:`side_main`, and run and report them with :func:`alternate`, :func:`print_calls` and :func:`compare`.
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
from collections.abc import Callable
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


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), so a row says which machine it was measured on: hosts with the same
    core count differ (the matmul peak, AMX or not)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return " ".join(line.split(":", 1)[1].split())
    except OSError:
        pass
    import platform

    return platform.processor() or "unknown CPU"


def machine() -> str:
    """The cores column of a results row: the CPUs a benchmark can use and their model."""
    return f"{cores()} ({cpu_name()})"


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
    """Per-round ratios ours / peer (of a rate: higher is better for ours; :func:`compare` also passes times and
    memory peaks, labelled as such), their median, min, max and spread ((max - min) / median)."""
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
        f"| {date} | {commit()} | `{command_line()}` | {machine()} | {threads} | {before:.2f} | {other:.2f} | "
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


# ------------------------------------------------------------------ call-timing sides (one call measured repeatedly)
def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))


def peak_above_start(fn: Callable[[], object]) -> tuple[object, float]:
    """(``fn()``'s value, MiB the resident set rose above its start at its highest while ``fn()`` ran): VmHWM
    after the call less VmRSS before it, the high-water mark reset first (5 to /proc/self/clear_refs; Linux) and
    freed heap memory handed back (malloc_trim), so an earlier call's free lists neither hide nor inflate it. CPU
    tensors are plain malloc blocks (the large ones mmap'ed, unmapped on free): no caching allocator in between."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the peak may be hidden by reused free blocks
        pass
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    start = _status_kib("VmRSS")
    value = fn()
    return value, (_status_kib("VmHWM") - start) / 1024


def measure_calls(setup: Callable[[], Callable[[], float | None]], repeats: int, threads: int) -> dict:
    """One side's measurement, in its own process: ``setup()`` (loading, inputs) returns the call to time; the
    first call (thread pools, autograd, allocator warm-up) is timed apart with its memory peak
    (:func:`peak_above_start`), then ``repeats`` timed calls. A call may return its work (e.g. tokens produced).

    Fields: setup_s (process start to the call ready: imports and loading), first_call_s, first_peak_mib,
    call_s (each timed call), median_s, work (each timed call's, when it returns one), threads."""
    import torch

    torch.set_num_threads(threads)
    call = setup()
    setup_s = since_process_start()
    t = time.perf_counter()
    first_work, first_peak = peak_above_start(call)
    first_s = time.perf_counter() - t
    seconds, work = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        w = call()
        seconds.append(time.perf_counter() - t)
        work.append(w)
    return {
        "setup_s": round(setup_s, 3),
        "first_call_s": round(first_s, 4),
        "first_peak_mib": round(first_peak, 1),
        "first_work": first_work,
        "call_s": [round(x, 5) for x in seconds],
        "median_s": statistics.median(seconds) if seconds else float("nan"),
        "work": work if any(w is not None for w in work) else None,
        "threads": torch.get_num_threads(),
    }


def side_main(measure: Callable[[], dict]) -> None:
    """The body of a side process: ``measure()``'s dict, or its error (the parent prints it), as the JSON line."""
    try:
        result = measure()
    except Exception as e:
        import traceback

        traceback.print_exc()
        text = str(e).strip()
        emit({"error": f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"})
        raise SystemExit(1) from None
    emit(result)


def _call_line(run: SideRun) -> str:
    d = run.result
    return (f"median {d['median_s']:.4f} s a call, first call {d['first_call_s']:.3f} s, "
            f"process {run.process_wall_s:.1f} s")  # fmt: skip


def alternate(
    args: argparse.Namespace,
    sides: list[str],
    argv: Callable[[str], list[str]],
    describe: Callable[[SideRun], str] = _call_line,
) -> list[SideRun]:
    """``--rounds`` rounds visiting ``sides`` in turn, each side a fresh process (``argv(side)``) after the gate;
    prints one line per side as it ends (``describe(run)``: by default a call-timing side's median and first call)."""
    check_rounds(args)
    runs = []
    for rnd in range(args.rounds):
        for side in sides:
            run = spawn(side, rnd, argv(side), args)
            runs.append(run)
            line = f"FAILED {run.error.splitlines()[-1][:300]}" if run.error else describe(run)
            print(f"round {rnd} {side}: {line}", flush=True)
    return runs


def alternate_on_folder(
    args: argparse.Namespace, sides: list[str], script: str, folder_of: Callable[[Path], str]
) -> list[SideRun]:
    """The parent of a benchmark whose sides load one model folder: the machine's state printed, the folder built
    (``folder_of(tmp)``, in a temporary directory that outlives the rounds), then :func:`alternate` over ``sides``,
    each side ``script`` with every option the parent got plus ``--folder`` and ``--side``, so all do the same
    work."""
    check_rounds(args)
    print(f"machine now: {quiet_now()}, {machine()}")
    with tempfile.TemporaryDirectory() as tmp:
        shared = [*sys.argv[1:], "--folder", folder_of(Path(tmp))]
        return alternate(args, sides, lambda side: [sys.executable, script, *shared, "--side", side])


def rate(d: dict) -> float | None:
    """Work per second of a side's timed calls (total work / total seconds), None when its calls report none."""
    work, secs = d.get("work"), sum(d.get("call_s", []))
    return sum(work) / secs if work and secs > 0 else None


def print_calls(runs: list[SideRun], unit: str = "") -> None:
    """The call-timing table: start-up (set-up s, first call s and its peak) apart from the timed calls (median s,
    and the rate of ``unit``s when the calls report work), the whole process (process s) and its max RSS."""
    rate_head = f" {unit + '/s':>11}" if unit else ""
    print(f"\n{'round':>5} {'side':14} {'threads':>7} {'setup s':>8} {'first s':>8} {'first peak MiB':>14} "
          f"{'median s':>9}{rate_head} {'process s':>9} {'max RSS MiB':>11}")  # fmt: skip
    for r in runs:
        if r.error:
            print(f"{r.round:5d} {r.side:14} FAILED: {r.error.splitlines()[-1][:160]}")
            continue
        d = r.result
        rate_col = f" {rate(d) or float('nan'):11.1f}" if unit else ""
        print(f"{r.round:5d} {r.side:14} {d['threads']:7d} {d['setup_s']:8.2f} {d['first_call_s']:8.3f} "
              f"{d['first_peak_mib']:14.1f} {d['median_s']:9.4f}{rate_col} {r.process_wall_s:9.1f} "
              f"{r.max_rss_mib:11.1f}")  # fmt: skip


def compare(runs: list[SideRun], side: str, baseline: str, key: Callable[[dict], float | None], label: str) -> dict:
    """Per-round ratios key(side) / key(baseline) over the rounds both ran, printed with their spread (a rate:
    higher is better for ``side``; for times pass the baseline's time over the side's, a speed-up)."""
    by = {(r.round, r.side): key(r.result) for r in runs if not r.error}
    both = sorted({k for k, s in by if s == side and by[k, s] is not None and by.get((k, baseline)) is not None})
    ratio = ratios([by[k, side] for k in both], [by[k, baseline] for k in both])
    if ratio["per_round"]:
        print(f"ratio {label} per round: {ratio['per_round']}; median {ratio['median']:.3f}x, min {ratio['min']:.3f}x, "
              f"max {ratio['max']:.3f}x, spread {ratio['spread']:.1%}")  # fmt: skip
    else:
        print(f"ratio {label}: none (a side failed in every round)")
    return ratio
