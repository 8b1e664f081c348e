"""Rich progress bars for long stage work (one bar per loop, with live metrics beside it)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

console = Console(stderr=True)


def _fmt(info: dict) -> str:
    return "  ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in info.items())


@contextlib.contextmanager
def progress_bar(description: str, total: int) -> Iterator[Callable[..., None]]:
    """Yield ``advance(n=1, **metrics)``; GRPOFLOW_PROGRESS=0 turns the bars off."""
    disable = os.environ.get("GRPOFLOW_PROGRESS", "1") == "0"
    with Progress(
        SpinnerColumn(),
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        TextColumn("{task.fields[info]}"),
        console=console,
        disable=disable,
    ) as bar:
        task_id = bar.add_task(description, total=total, info="")

        def advance(n: int = 1, **info) -> None:
            bar.update(task_id, advance=n, info=_fmt(info))

        yield advance
