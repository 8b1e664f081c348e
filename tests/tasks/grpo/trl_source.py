"""Run lines of TRL's own source where TRL computes something inline inside a long method.

TRL 1.16 computes the advantages and the vLLM importance-sampling ratio in the middle of
``GRPOTrainer._generate_and_score_completions`` (generation, reward calls and logging around them), so they
cannot be called alone, and running the whole method would need a model, a sampler and an accelerator. Instead
the lines are cut from ``inspect.getsource`` of TRL's installed method, between markers that name TRL's own
statements, dedented, compiled and executed in a namespace holding the tensors and a ``self`` with the
attributes they read. A TRL release that rewrites those lines makes the marker search fail loudly, never
silently compare against something else.
"""

from __future__ import annotations

import inspect
import textwrap
from typing import Any


def _lines(func) -> list[str]:
    return textwrap.dedent(inspect.getsource(func)).splitlines()


def _find(lines: list[str], marker: str, start: int = 0) -> int:
    for i in range(start, len(lines)):
        if lines[i].strip().startswith(marker):
            return i
    raise LookupError(f"TRL's source no longer has a line starting with {marker!r}")


def trl_span(func, first: str, last: str) -> str:
    """The lines from the first one starting with ``first`` to the next one starting with ``last``, dedented."""
    lines = _lines(func)
    i = _find(lines, first)
    j = _find(lines, last, i)
    return textwrap.dedent("\n".join(lines[i : j + 1]))


def trl_block(func, header: str) -> str:
    """The statement that starts with ``header`` (an ``if``/``for``... line) and its indented body, dedented."""
    lines = _lines(func)
    i = _find(lines, header)
    indent = len(lines[i]) - len(lines[i].lstrip())
    j = i + 1
    while j < len(lines) and (not lines[j].strip() or len(lines[j]) - len(lines[j].lstrip()) > indent):
        j += 1
    return textwrap.dedent("\n".join(lines[i:j]))


def run_trl(source: str, namespace: dict[str, Any]) -> dict[str, Any]:
    """Execute TRL's lines in ``namespace`` (updated in place, and returned)."""
    exec(compile(source, "<trl source>", "exec"), namespace)  # noqa: S102 - TRL's own, installed code
    return namespace
