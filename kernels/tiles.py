"""What the chunked 16-bit path (kernels/chunked_dtype.py) does with each [rows, vocabulary chunk] tile of raw
logits between its GEMMs: the forward's online-softmax fold (:func:`fold_tile`) and the backward's gradient
(:func:`grad_tile`).

The fold. Per row, with the running state (m, s, c, z_y) over the vocabulary tiles seen so far and this tile's raw GEMM
output u = h W_c^T (float32):

    z  = (u + b_c) / T
    m' = max(m, max_v z),   r = e^(m - m'),   δ = m' - m  (0 while m = -inf: the first tile)
    e  = e^(z - m')                                        (the next GEMM's operand, in the compute dtype)
    s' = r s + sum_v e                                     (sum of e^(z - m) over every tile so far)
    c' = r (c - δ s) + sum_v e (z - m')                    (sum of e^(z - m) (z - m); only with the entropy)
    z_y' = z_y of this tile when the target falls in it, else z_y

so that at the end lse = m + log s, logp = z_y - lse and the entropy lse - E_p[z] = log s - c / s. A frozen head's
forward also keeps [rows, D] accumulators of e W (a) and e (z - m) W (b): the fold rescales them to the new max,

    a' = r a,   b' = r (b - δ a)                           (before the caller adds this tile's e W_c, e (z - m') W_c)

which changes nothing in a row whose max did not grow (r = 1, δ = 0): the Triton route skips those rows, so the
[rows, D] accumulators are read and written only for rows whose running max grew in this tile (a few tiles of a
row's whole vocabulary), where the torch route rescales every row every tile.

The gradient. Per tile, with the rows' lse and entropy H over the whole vocabulary (from the forward) and the
upstream g_t = g / T, g_H / T (kernels/logit_grad.py has the derivation):

    G = (1/T)[g onehot(y) - p (g + g_H (z - lse + H))],   p = e^(z - lse)   (in the compute dtype)

Each has two implementations with the same semantics: plain torch (:func:`fold_tile_torch`, :func:`grad_tile_torch`:
CPU tensors, and anywhere without triton) and kernels/triton_tiles.py (CUDA, and CPU under TRITON_INTERPRET=1 in
tests), which reads the float32 tile once and writes its 16-bit result once: 4 + 2 bytes per tile element (4 + 4
for the fold with the entropy's e (z - m')), where the torch ops read and write the float32 tile about ten times
(docs/kernel-roofline.md counts both). :func:`fold_tile` and :func:`grad_tile` pick the Triton route for CUDA
tensors when triton is installed (:func:`fused_available`), else the torch one.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from grpoflow.kernels.logit_grad import logit_grad
from grpoflow.kernels.tile_state import Accumulators, Folded, FoldState


def fold_tile_torch(
    u: torch.Tensor,
    bias: torch.Tensor | None,
    inv_t: float,
    y_local: torch.Tensor,
    state: FoldState,
    e_dtype: torch.dtype | None,
    want_ezm: bool = False,
    acc: Accumulators | None = None,
) -> Folded:
    """The fold (module docstring) in torch ops; ``u`` (float32 [rows, cols]) is overwritten. ``y_local`` [rows]:
    each row's target minus the tile's first column (outside [0, cols) when the target is in another tile).
    ``e_dtype`` None: e is not returned (a forward without gradients needs only the sums). ``acc``: rescaled in
    place to the new max."""
    m, s, c, z_y = state
    if bias is not None:
        u += bias.float()
    z = u.mul_(inv_t)
    cols = z.shape[1]
    inside = (y_local >= 0) & (y_local < cols)
    picked = z.gather(1, y_local.clamp(0, cols - 1)[:, None]).squeeze(1)
    z_y.copy_(torch.where(inside, picked, z_y))
    m_new = torch.maximum(m, z.amax(1))
    r = torch.exp(m - m_new)  # 0 on the first tile
    shift = torch.where(torch.isfinite(m), m_new - m, 0.0)
    zm = z.sub_(m_new[:, None])
    e = torch.exp(zm)
    ezm = None
    if c is not None:
        ezm = zm.mul_(e)  # e (z - m'), in place: z is not needed after this
        c.copy_(r * (c - shift * s) + ezm.sum(1))
    s.copy_(s * r + e.sum(1))
    m.copy_(m_new)
    if acc is not None:
        if acc.b is not None:
            acc.b.addcmul_(acc.a, shift[:, None], value=-1.0).mul_(r[:, None])
        acc.a.mul_(r[:, None])
    e_out = None if e_dtype is None else e.to(e_dtype)
    ezm_out = ezm.to(e_dtype) if want_ezm and ezm is not None and e_dtype is not None else None
    return Folded(r, shift, e_out, ezm_out)


@functools.cache
def triton_available() -> bool:
    """Whether the triton package can be found (without importing it: importing triton reads TRITON_INTERPRET).
    pyproject.toml installs triton on Linux only; elsewhere ``auto`` runs the chunked path, with the torch fold."""
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):
        return False


def fused_available(u: torch.Tensor) -> bool:
    """Whether :func:`fold_tile` and :func:`grad_tile` take the Triton route for this tile: CUDA tensors with triton
    installed."""
    return u.is_cuda and triton_available()


def fold_tile(
    u: torch.Tensor,
    bias: torch.Tensor | None,
    inv_t: float,
    y_local: torch.Tensor,
    state: FoldState,
    e_dtype: torch.dtype | None,
    want_ezm: bool = False,
    acc: Accumulators | None = None,
    fused: bool | None = None,
) -> Folded:
    """One tile's fold (module docstring): the Triton fold when ``fused`` (default: :func:`fused_available`),
    else :func:`fold_tile_torch`. Both update ``state`` (and rescale ``acc``) in place and return the same things."""
    if fused is None:
        fused = fused_available(u)
    if fused:
        from grpoflow.kernels.triton_tiles import fold_tile_triton  # imports triton: only on this route

        return fold_tile_triton(u, bias, inv_t, y_local, state, e_dtype, want_ezm, acc)
    return fold_tile_torch(u, bias, inv_t, y_local, state, e_dtype, want_ezm, acc)


def grad_tile_torch(
    u: torch.Tensor,
    bias: torch.Tensor | None,
    inv_t: float,
    lse: torch.Tensor,
    y_local: torch.Tensor,
    g_t: torch.Tensor,
    ent: torch.Tensor | None,
    ge_t: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """G of the module docstring in torch ops (kernels/logit_grad.py), in ``out_dtype``; ``u`` (the raw float32
    tile) is overwritten."""
    if bias is not None:
        u += bias.float()
    return logit_grad(u.mul_(inv_t), lse, y_local, g_t, ent, ge_t).to(out_dtype)


def grad_tile(
    u: torch.Tensor,
    bias: torch.Tensor | None,
    inv_t: float,
    lse: torch.Tensor,
    y_local: torch.Tensor,
    g_t: torch.Tensor,
    ent: torch.Tensor | None,
    ge_t: torch.Tensor | None,
    out_dtype: torch.dtype,
    fused: bool | None = None,
) -> torch.Tensor:
    """One tile's G [rows, cols] in ``out_dtype`` (module docstring): the Triton route when ``fused`` (default:
    :func:`fused_available`), else :func:`grad_tile_torch`. ``ent`` and ``ge_t`` both given: the entropy's term."""
    if fused is None:
        fused = fused_available(u)
    if fused:
        from grpoflow.kernels.triton_tiles import grad_tile_triton

        return grad_tile_triton(u, bias, inv_t, lse, y_local, g_t, ent, ge_t, out_dtype)
    return grad_tile_torch(u, bias, inv_t, lse, y_local, g_t, ent, ge_t, out_dtype)
