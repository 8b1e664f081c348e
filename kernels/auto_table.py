"""Which implementation ``impl="auto"`` runs for a CUDA call, per shape: a table of measured shapes.

A table is a list of entries, each a measured shape and the faster implementation there, for the no-grad forward
(old and reference log-probs) and for the training forward + backward:

    {"source": "...", "device": "...", "entries": [
        {"N": 2048, "D": 896, "V": 151936, "dtype": "bfloat16", "head": "frozen",
         "fwd": "triton", "fwd_bwd": "chunked"},
        ...]}

A call takes the entry nearest to its (N, D, V) in log2 distance (|log2 N - log2 N'| + ..., so 2x off on one axis
counts as much as 2x on another), among the entries of its dtype and head when there are any (else among all):
shapes between the measured ones go with the nearer measured point, which is what a 4-point grid can say.

Where the table comes from: ``GRPOFLOW_AUTO_TABLE`` (:data:`ENV`), the path of a JSON table, when set (the GPU
check writes one beside its report: ``benchmarks/gpu_check.py`` prints the path and the export line); else
:data:`DEFAULT_TABLE`, shipped here. Until a device has measured one, the default follows the estimates of
docs/kernel-roofline.md: the chunked cuBLAS path (GEMMs, and one Triton kernel per logit tile between them) for
every shape, head and pass, ahead of the Triton kernel by 1.1-3x at the check's four shapes (the Triton kernel's
dots at 30-60% of cuBLAS and its H re-reads against the chunked path's 4-6 bytes per logit). CPU tensors never read
the table (``chunked``:
the Triton kernel runs on a CPU only under the interpreter). A table file that is not valid is an error naming
the file and the entry, raised on the first call that reads it (not a silent fall back to the default).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

ENV = "GRPOFLOW_AUTO_TABLE"
CHOICES = ("triton", "chunked")
MODES = ("fwd", "fwd_bwd")
HEADS = ("frozen", "trainable")
V_QWEN = 151936


def _default_entries() -> list[dict[str, Any]]:
    """The GPU check's timing shapes (N x D at Qwen's vocabulary, bf16, both heads), all chunked: the estimate."""
    out = []
    for n, d in ((2048, 896), (16384, 4096), (16384, 896), (2048, 4096)):
        for head in HEADS:
            out.append({"N": n, "D": d, "V": V_QWEN, "dtype": "bfloat16", "head": head, "fwd": "chunked"})
            out[-1]["fwd_bwd"] = "chunked"
    return out


DEFAULT_TABLE: dict[str, Any] = {
    "source": "default: no device has measured one yet (the chunked path everywhere, from docs/kernel-roofline.md's "
    "estimates)",
    "device": None,
    "entries": _default_entries(),
}

_cache: dict[tuple[str, float], dict[str, Any]] = {}


class AutoTableError(ValueError):
    """A table file that cannot be used; the message names the file and what is wrong in it."""


def validate(table: Any, where: str) -> dict[str, Any]:
    """``table`` itself when it is a valid table; else :class:`AutoTableError` naming ``where`` (its file) and the
    entry and key at fault."""
    if not isinstance(table, dict) or not isinstance(table.get("entries"), list) or not table["entries"]:
        raise AutoTableError(f"{where}: expected a JSON object with a non-empty list 'entries'")
    for i, e in enumerate(table["entries"]):
        if not isinstance(e, dict):
            raise AutoTableError(f"{where}: entries[{i}] is not an object")
        for key in ("N", "D", "V"):
            if not isinstance(e.get(key), int) or isinstance(e.get(key), bool) or e[key] <= 0:
                raise AutoTableError(f"{where}: entries[{i}].{key} must be a positive integer (got {e.get(key)!r})")
        if not isinstance(e.get("dtype"), str):
            raise AutoTableError(f"{where}: entries[{i}].dtype must be a string such as 'bfloat16'")
        if e.get("head", "frozen") not in HEADS:
            raise AutoTableError(f"{where}: entries[{i}].head must be one of {HEADS} (got {e.get('head')!r})")
        for mode in MODES:
            if e.get(mode) not in CHOICES:
                raise AutoTableError(f"{where}: entries[{i}].{mode} must be one of {CHOICES} (got {e.get(mode)!r})")
    return table


def load_table(path: str | os.PathLike) -> dict[str, Any]:
    """The table in the JSON file ``path``, validated (:class:`AutoTableError` naming the file otherwise)."""
    p = Path(path)
    try:
        raw = json.loads(p.read_text())
    except FileNotFoundError:
        raise AutoTableError(f"{p}: no such file (set by {ENV})") from None
    except (OSError, json.JSONDecodeError) as e:
        raise AutoTableError(f"{p}: not a readable JSON table ({e})") from None
    return validate(raw, str(p))


def active_table() -> dict[str, Any]:
    """The table ``auto`` reads now: the file named by ``GRPOFLOW_AUTO_TABLE``, else :data:`DEFAULT_TABLE`.
    A file is read once per (path, modification time), not per call."""
    path = os.environ.get(ENV)
    if not path:
        return DEFAULT_TABLE
    try:
        key = (path, os.stat(path).st_mtime)
    except OSError:
        return load_table(path)  # raises, naming the file
    if key not in _cache:
        _cache.clear()
        _cache[key] = load_table(path)
    return _cache[key]


def _distance(e: dict[str, Any], n: int, d: int, v: int) -> float:
    return sum(abs(math.log2(a) - math.log2(b)) for a, b in ((e["N"], n), (e["D"], d), (e["V"], v)))


def choose(n: int, d: int, v: int, dtype: str, head: str, mode: str, table: dict[str, Any] | None = None) -> str:
    """Return "triton" or "chunked" for ``n`` rows, hidden size ``d``, vocabulary ``v`` in ``dtype`` (e.g. "bfloat16"),
    a "frozen" or "trainable" head, ``mode`` "fwd" (no gradient) or "fwd_bwd": the nearest entry's choice
    (module docstring) in ``table`` (default :func:`active_table`)."""
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}: expected one of {MODES}")
    entries = (table or active_table())["entries"]
    same = [e for e in entries if e["dtype"] == dtype and e.get("head", "frozen") == head]
    pool = same or [e for e in entries if e["dtype"] == dtype] or entries
    best = min(pool, key=lambda e: _distance(e, max(n, 1), max(d, 1), max(v, 1)))
    return best[mode]


def table_from_timings(rows: list[dict[str, Any]], dtype: str, device: str, source: str) -> dict[str, Any]:
    """A table from the GPU check's comparison rows (N, D, V, head, faster_fwd, faster_fwd_bwd per shape); rows
    without both impls measured are left out. Validated, so the check never writes a table ``auto`` rejects."""
    entries = [
        {
            "N": r["N"],
            "D": r["D"],
            "V": r["V"],
            "dtype": dtype,
            "head": r["head"],
            "fwd": r["faster_fwd"],
            "fwd_bwd": r["faster_fwd_bwd"],
        }
        for r in rows
        if r.get("faster_fwd") in CHOICES and r.get("faster_fwd_bwd") in CHOICES
    ]
    return validate({"source": source, "device": device, "entries": entries}, f"the table measured on {device}")
