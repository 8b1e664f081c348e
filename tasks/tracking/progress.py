"""Progress of long stage work: a rich bar on a terminal, plain log lines anywhere else.

A container's log, a Prefect worker, ``grpoflow run ... > log`` or a Kubernetes pod have no terminal: rich
draws nothing live there, so a 20-minute GRPO stage would say nothing until it ended. There the same
``advance`` writes a log line (logger ``grpoflow.progress``) at the first step, then at most every
``GRPOFLOW_PROGRESS_EVERY_S`` seconds (default 30), and at the last step:

    grpo 5/20 (25%)  3:02 elapsed, ~9:06 left  reward=1.23  loss=0.0114
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator

log = logging.getLogger("grpoflow.progress")


def _fmt(info: dict) -> str:
    return "  ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in info.items())


def _clock(seconds: float) -> str:
    m, s = divmod(int(round(seconds)), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def progress_line(description: str, done: int, total: int, elapsed: float, rate_done: int, info: dict) -> str:
    """One progress line. The time left is ``elapsed / rate_done * (total - done)``: the pace of the work done
    in this process (``rate_done`` units; a resumed run's earlier units are not in it)."""
    pct = f" ({100 * done / total:.0f}%)" if total else ""
    left = f", ~{_clock(elapsed / rate_done * (total - done))} left" if rate_done > 0 and done < total else ""
    extra = f"  {_fmt(info)}" if info else ""
    return f"{description} {done}/{total}{pct}  {_clock(elapsed)} elapsed{left}{extra}"


@contextlib.contextmanager
def _log_lines(description: str, total: int, start: int) -> Iterator[Callable[..., None]]:
    every = float(os.environ.get("GRPOFLOW_PROGRESS_EVERY_S", "30"))
    t0 = time.perf_counter()
    state = {"done": start, "last": None}

    def advance(n: int = 1, **info) -> None:
        state["done"] += n
        now, done = time.perf_counter(), state["done"]
        if state["last"] is None or now - state["last"] >= every or done >= total:
            state["last"] = now
            log.info(progress_line(description, done, total, now - t0, done - start, info))

    yield advance


def _terminal_console():
    """A rich console on stderr when stderr is a terminal (or Jupyter), else None; None also where rich is not
    installed (imported here, not at module level: the trainer runs without rich, as benchmarks/gpu_check.py does
    on a bare GPU machine)."""
    try:
        from rich.console import Console
    except ImportError:
        return None
    console = Console(stderr=True)
    return console if console.is_terminal or console.is_jupyter else None


@contextlib.contextmanager
def progress_bar(description: str, total: int, start: int = 0) -> Iterator[Callable[..., None]]:
    """Yield ``advance(n=1, **metrics)`` over ``total`` units, ``start`` of them done already (a resumed run).
    GRPOFLOW_PROGRESS=0 turns progress off; without a terminal (or without rich) it is log lines (see the module
    docstring)."""
    if os.environ.get("GRPOFLOW_PROGRESS", "1") == "0":
        yield lambda *a, **k: None
        return
    console = _terminal_console()
    if console is None:
        with _log_lines(description, total, start) as advance:
            yield advance
        return
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    with Progress(
        SpinnerColumn(),
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        TextColumn("{task.fields[info]}"),
        console=console,
    ) as bar:
        task_id = bar.add_task(description, total=total, completed=start, info="")

        def advance(n: int = 1, **info) -> None:
            bar.update(task_id, advance=n, info=_fmt(info))

        yield advance
