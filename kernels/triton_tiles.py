"""kernels/tiles.py's two tile operations as Triton kernels, each reading the float32 tile once and writing its
16-bit result once: the forward's online-softmax fold (e, and e (z - m'), in the next GEMM's dtype) and the
backward's gradient G.

The fold: one program per row. The row's columns (at most kernels/tiles.py's MAX_FUSED_COLS) are loaded into
registers in one piece, so the row max, e, the sums and the target's logit come from that single read; the
per-row state (m, s, c, z_y) is read and written in place, r and δ written for the caller's accumulators.
The gradient: elementwise, programs of (row, GRAD_BLOCK columns). Pointer offsets of a row times a stride are
int64. Under TRITON_INTERPRET=1 (tests on CPU) the same kernels run on CPU tensors. Launched on their tensors'
device (kernels/launch.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from grpoflow.kernels.launch import launch
from grpoflow.kernels.tile_state import MAX_FUSED_COLS, Accumulators, Folded, FoldState


@triton.jit
def _fold_kernel(
    U, B, Y, M, S, C, ZY, R, SHIFT, E, EZM, A, BACC, cols, D, stride_u, stride_e, stride_acc, inv_t,
    HAS_BIAS: tl.constexpr, ENTROPY: tl.constexpr, WRITE_E: tl.constexpr, WRITE_EZM: tl.constexpr,
    RESCALE: tl.constexpr, RESCALE_B: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Row ``program_id``: z = (u + b) / T, then m', r, δ, e, s', c', z_y' of kernels/tiles.py, one read of u; with
    RESCALE the row's accumulators a' = r a (and b' = r (b - δ a)), only when its max grew (r < 1 after a first
    tile: a row whose max stayed is neither read nor written)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < cols
    z = tl.load(U + row * stride_u + offs, mask=ok, other=0.0)
    if HAS_BIAS:
        z += tl.load(B + offs, mask=ok, other=0.0).to(tl.float32)
    z = z * inv_t
    m = tl.load(M + row)
    s = tl.load(S + row)
    m_new = tl.maximum(m, tl.max(tl.where(ok, z, float("-inf")), axis=0))
    r = tl.exp(m - m_new)  # 0 on the first tile (m = -inf)
    shift = tl.where(m > float("-inf"), m_new - m, 0.0)
    zm = z - m_new
    e = tl.where(ok, tl.exp(zm), 0.0)
    t = tl.load(Y + row)
    z_t = tl.sum(tl.where(ok & (offs == t), z, 0.0), axis=0)
    inside = (t >= 0) & (t < cols)
    tl.store(ZY + row, tl.where(inside, z_t, tl.load(ZY + row)))
    if ENTROPY:
        ezm = tl.where(ok, e * zm, 0.0)
        c = tl.load(C + row)
        tl.store(C + row, r * (c - shift * s) + tl.sum(ezm, axis=0))
        if WRITE_EZM:
            tl.store(EZM + row * stride_e + offs, ezm.to(EZM.dtype.element_ty), mask=ok)
    if WRITE_E:
        tl.store(E + row * stride_e + offs, e.to(E.dtype.element_ty), mask=ok)
    tl.store(S + row, s * r + tl.sum(e, axis=0))
    tl.store(M + row, m_new)
    tl.store(R + row, r)
    tl.store(SHIFT + row, shift)
    if RESCALE:
        if (r < 1.0) & (m > float("-inf")):  # on the first tile the accumulators are still zero
            for d0 in range(0, D, BLOCK_D):
                d = d0 + tl.arange(0, BLOCK_D)
                d_ok = d < D
                a = tl.load(A + row * stride_acc + d, mask=d_ok, other=0.0)
                if RESCALE_B:
                    b = tl.load(BACC + row * stride_acc + d, mask=d_ok, other=0.0)
                    tl.store(BACC + row * stride_acc + d, r * (b - shift * a), mask=d_ok)
                tl.store(A + row * stride_acc + d, r * a, mask=d_ok)


ACC_BLOCK = 1024  # accumulator columns a fold program rescales per step


def _warps(block: int) -> int:
    """Warps per program: one row of ``block`` float32 values spread at about 32 per thread."""
    return max(1, min(16, block // (32 * 32)))


def fold_tile_triton(
    u: torch.Tensor,
    bias: torch.Tensor | None,
    inv_t: float,
    y_local: torch.Tensor,
    state: FoldState,
    e_dtype: torch.dtype | None,
    want_ezm: bool = False,
    acc: Accumulators | None = None,
) -> Folded:
    """kernels/tiles.py's fold_tile_torch, fused: same arguments, same in-place state (and accumulator) update, same
    results (``u`` is left as it was)."""
    rows, cols = u.shape
    if cols > MAX_FUSED_COLS:
        raise ValueError(f"the fused fold takes at most {MAX_FUSED_COLS} columns a tile, got {cols}")
    if u.dtype != torch.float32 or u.stride(1) != 1:
        raise ValueError(f"the fused fold takes a row-major float32 tile, got {u.dtype} with strides {u.stride()}")
    for name, vec in zip(("m", "s", "z_y"), (state.m, state.s, state.z_y)):
        if vec.dtype != torch.float32 or not vec.is_contiguous():
            raise ValueError(f"fold state {name} must be a contiguous float32 vector")
    entropy = state.c is not None
    r, shift = torch.empty(rows, device=u.device), torch.empty(rows, device=u.device)
    write_e = e_dtype is not None
    write_ezm = write_e and want_ezm and entropy
    e = torch.empty(rows, cols, device=u.device, dtype=e_dtype) if write_e else None
    ezm = torch.empty(rows, cols, device=u.device, dtype=e_dtype) if write_ezm else None
    y = y_local.contiguous()
    block = triton.next_power_of_2(cols)
    a = b = u  # unused pointers without accumulators
    if acc is not None:
        a, b = acc.a, acc.b if acc.b is not None else acc.a
        if any(t.dtype != torch.float32 or t.stride() != (a.shape[1], 1) or t.shape != a.shape for t in (a, b)):
            raise ValueError("the fused fold's accumulators must be contiguous float32 [rows, D] tensors")
    d = a.shape[1] if acc is not None else 0
    args = (
        u, bias if bias is not None else u, y, state.m, state.s, state.c if entropy else state.s, state.z_y, r, shift,
        e if write_e else u, ezm if write_ezm else u, a, b, cols, d, u.stride(0), cols, max(d, 1), inv_t,
    )  # fmt: skip
    meta = dict(HAS_BIAS=bias is not None, ENTROPY=entropy, WRITE_E=write_e, WRITE_EZM=write_ezm, BLOCK=block)
    meta.update(RESCALE=acc is not None, RESCALE_B=acc is not None and acc.b is not None, BLOCK_D=ACC_BLOCK)
    launch(_fold_kernel, (rows,), u.device, *args, num_warps=_warps(block), **meta)
    return Folded(r, shift, e, ezm)


GRAD_BLOCK = 1024  # columns per program of the gradient kernel


@triton.jit
def _grad_kernel(
    U, B, LSE, Y, G_T, ENT, GE_T, G, cols, stride_u, stride_g, inv_t,
    HAS_BIAS: tl.constexpr, ENT_GRAD: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Program (row, column block): G = (1/T)[g onehot(y) - p (g + g_H (z - lse + H))], p = e^(z - lse)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < cols
    z = tl.load(U + row * stride_u + offs, mask=ok, other=0.0)
    if HAS_BIAS:
        z += tl.load(B + offs, mask=ok, other=0.0).to(tl.float32)
    log_p = z * inv_t - tl.load(LSE + row)
    g_t = tl.load(G_T + row)
    coef = g_t
    if ENT_GRAD:
        coef = g_t + tl.load(GE_T + row) * (log_p + tl.load(ENT + row))
    grad = -(tl.exp(log_p) * coef) + tl.where(offs == tl.load(Y + row), g_t, 0.0)
    tl.store(G + row * stride_g + offs, grad.to(G.dtype.element_ty), mask=ok)


def grad_tile_triton(
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
    """kernels/tiles.py's grad_tile_torch, fused: same arguments and result (``u`` is left as it was)."""
    rows, cols = u.shape
    if u.dtype != torch.float32 or u.stride(1) != 1:
        raise ValueError(f"the fused gradient takes a row-major float32 tile, got {u.dtype} with strides {u.stride()}")
    ent_grad = ent is not None and ge_t is not None
    g = torch.empty(rows, cols, device=u.device, dtype=out_dtype)
    vecs = [t.contiguous() for t in (lse, y_local, g_t)]
    ent_args = (ent.contiguous(), ge_t.contiguous()) if ent_grad else (vecs[0], vecs[0])
    args = (u, bias if bias is not None else u, *vecs, *ent_args, g, cols, u.stride(0), cols, inv_t)
    grid = (rows, triton.cdiv(cols, GRAD_BLOCK))
    meta = dict(HAS_BIAS=bias is not None, ENT_GRAD=ent_grad, BLOCK=GRAD_BLOCK)
    launch(_grad_kernel, grid, u.device, *args, num_warps=4, **meta)
    return g
