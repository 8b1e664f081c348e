"""The fold's state and results, shared by kernels/tiles.py (torch route and dispatch) and kernels/triton_tiles.py
(the Triton route), so that neither imports the other's module for its types: the running per-row sums
(:class:`FoldState`), a frozen head's [rows, D] accumulators (:class:`Accumulators`) and one tile's result
(:class:`Folded`). kernels/tiles.py's docstring has the fold's formulas."""

from __future__ import annotations

from typing import NamedTuple

import torch

MAX_FUSED_COLS = 16384  # the Triton fold holds one row of the tile in registers: at most this many columns


class FoldState(NamedTuple):
    """The running per-row sums of the fold, float32 [rows] each (views into the caller's [N] vectors are fine:
    they are updated in place). ``c`` is None when no entropy is wanted."""

    m: torch.Tensor
    s: torch.Tensor
    c: torch.Tensor | None
    z_y: torch.Tensor


class Accumulators(NamedTuple):
    """A frozen head's float32 [rows, D] sums: a = sum_v e_v W_v and b = sum_v e_v (z_v - m) W_v (or None)."""

    a: torch.Tensor
    b: torch.Tensor | None


class Folded(NamedTuple):
    """What one tile's fold returns: r and δ float32 [rows]; e and e (z - m') in the requested dtype [rows, cols]
    (None unless asked for)."""

    r: torch.Tensor
    shift: torch.Tensor
    e: torch.Tensor | None
    ezm: torch.Tensor | None


def new_state(rows: int, entropy: bool, device: torch.device) -> FoldState:
    """The state before the first tile: m = -inf, s = c = z_y = 0."""
    zeros = lambda: torch.zeros(rows, device=device)  # noqa: E731
    return FoldState(torch.full((rows,), float("-inf"), device=device), zeros(), zeros() if entropy else None, zeros())
