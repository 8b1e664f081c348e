"""Per-token log-probs from hidden states and the lm_head: the fused Triton kernel (the GPU path).

Same algorithm and notation as kernels/chunked_logprobs.py (read its docstring for the derivation):

    z = (H W^T + b) / T,  lse = logsumexp(z),  logp = z_y - lse,  entropy = lse - sum_v p_v z_v
    forward:  over vocabulary tiles, m' = max(m, max_v z_v), r = exp(m - m'), e_v = exp(z_v - m'),
              s = r s + sum_v e_v,  a = r a + sum_v e_v W_v;  lse = m + log s,  J = W_y - a / s
    backward: dH = (g / T) J;  dW = sum_n (g_n / T) (onehot(y_n) - p_n)^T H_n,  db likewise (trainable head only)

Here the logsumexp keeps flash attention's running max m: in registers it costs nothing, unlike the
torch path's extra passes (which shift by the target logit instead).

Layout (Liger-Kernel's one-file shape): two kernels, their launchers, one torch.autograd.Function.

- ``_token_logprobs_forward_kernel``: one program per BLOCK_N rows, looping over the vocabulary in
  BLOCK_V tiles. Each logits tile [BLOCK_N, BLOCK_V] is reduced over D in BLOCK_D steps (D = 4096 does
  not fit one tile). The running max, sum, target logit and entropy sum stay in registers; the
  accumulator a [BLOCK_N, D] does not fit them at large D, so it lives in the float32 J output (global
  memory that only this program touches) and is rescaled and updated BLOCK_D columns at a time, with a
  block barrier between tiles; the epilogue turns it into J = W_y - a / s in place.
- ``_token_logprobs_backward_kernel`` (only when the head is trainable): one program per BLOCK_V
  vocabulary rows, looping over all rows in BLOCK_N blocks; it recomputes the logits tile and adds
  G^T H into its own rows of dW (float32, no atomics; a barrier between row blocks) and sum_n G into db.
- dH = (g / T) J is one elementwise torch op.

Dots take bf16/fp16 tiles on the GPU and accumulate in float32; the softmax tile is rounded to the
weight dtype before the P W and G^T H dots (as flash attention does). Float32 inputs use exact
("ieee") float32 dots, as torch matmuls do by default. Under TRITON_INTERPRET=1 every dot operand is
cast to float32 first: the interpreter multiplies bf16 tiles as raw bits otherwise.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# Read once: the kernels below are decorated (interpreted or compiled) when this module is imported.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# One config (sized for D = 4096 bf16 on Hopper-class GPUs); autotune with one config never benchmarks.
_CONFIGS = [triton.Config({"BLOCK_N": 64, "BLOCK_V": 128, "BLOCK_D": 64}, num_warps=8, num_stages=2)]


@triton.jit
def _dot(a, b, FP32_DOT: tl.constexpr):
    """a @ b accumulated in float32; a is rounded to b's dtype unless FP32_DOT casts both to float32."""
    if FP32_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a.to(b.dtype), b)


@triton.jit
def _logits_tile(
    H,
    W,
    B,
    rows,
    row_ok,
    cols,
    col_ok,
    D,
    stride_h,
    stride_w,
    inv_t,
    HAS_BIAS: tl.constexpr,
    FP32_DOT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """z = (H[rows] W[cols]^T + b[cols]) / T as a float32 [BLOCK_N, BLOCK_V] tile, D reduced in BLOCK_D steps."""
    z = tl.zeros([BLOCK_N, BLOCK_V], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        ks = d0 + tl.arange(0, BLOCK_D)
        k_ok = ks < D
        h = tl.load(H + rows[:, None] * stride_h + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(W + cols[:, None] * stride_w + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        z += _dot(h, tl.trans(w), FP32_DOT)
    if HAS_BIAS:
        z += tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    return z * inv_t


@triton.autotune(configs=_CONFIGS, key=[])
@triton.jit
def _token_logprobs_forward_kernel(
    H,
    W,
    B,
    Y,
    LOGP,
    LSE,
    ENT,
    J,
    N,
    V,
    D,
    stride_h,
    stride_w,
    inv_t,
    HAS_BIAS: tl.constexpr,
    ENTROPY: tl.constexpr,
    KEEP_J: tl.constexpr,
    FP32_DOT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    y = tl.load(Y + rows, mask=row_ok, other=0)
    m = tl.full([BLOCK_N], float("-inf"), dtype=tl.float32)
    s = tl.zeros([BLOCK_N], dtype=tl.float32)
    z_y = tl.zeros([BLOCK_N], dtype=tl.float32)
    ez = tl.zeros([BLOCK_N], dtype=tl.float32)  # sum_v e_v z_v at scale m
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        col_ok = cols < V
        z = _logits_tile(
            H,
            W,
            B,
            rows,
            row_ok,
            cols,
            col_ok,
            D,
            stride_h,
            stride_w,
            inv_t,
            HAS_BIAS,
            FP32_DOT,
            BLOCK_N,
            BLOCK_V,
            BLOCK_D,
        )
        z = tl.where(col_ok[None, :], z, 0.0)
        z_y += tl.sum(tl.where(cols[None, :] == y[:, None], z, 0.0), axis=1)
        m_new = tl.maximum(m, tl.max(tl.where(col_ok[None, :], z, float("-inf")), axis=1))
        r = tl.exp(m - m_new)  # 0 on the first tile
        e = tl.where(col_ok[None, :], tl.exp(z - m_new[:, None]), 0.0)
        s = s * r + tl.sum(e, axis=1)
        if ENTROPY:
            ez = ez * r + tl.sum(e * z, axis=1)
        if KEEP_J:  # a = r a + e W[cols], BLOCK_D columns at a time, in J's float32 storage
            for d0 in range(0, D, BLOCK_D):
                ks = d0 + tl.arange(0, BLOCK_D)
                k_ok = ks < D
                a_ptrs = J + rows[:, None] * D + ks[None, :]
                a_mask = row_ok[:, None] & k_ok[None, :]
                w = tl.load(W + cols[:, None] * stride_w + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
                a = tl.load(a_ptrs, mask=a_mask, other=0.0) * r[:, None] + _dot(e, w, FP32_DOT)
                tl.store(a_ptrs, a, mask=a_mask)
            tl.debug_barrier()  # the next tile reads what this one stored, maybe from other threads
        m = m_new
    lse = m + tl.log(s)
    tl.store(LOGP + rows, z_y - lse, mask=row_ok)
    tl.store(LSE + rows, lse, mask=row_ok)
    if ENTROPY:
        tl.store(ENT + rows, lse - ez / s, mask=row_ok)
    if KEEP_J:  # J = W_y - a / s
        for d0 in range(0, D, BLOCK_D):
            ks = d0 + tl.arange(0, BLOCK_D)
            mask = row_ok[:, None] & (ks < D)[None, :]
            a_ptrs = J + rows[:, None] * D + ks[None, :]
            w_y = tl.load(W + y[:, None] * stride_w + ks[None, :], mask=mask, other=0.0).to(tl.float32)
            tl.store(a_ptrs, w_y - tl.load(a_ptrs, mask=mask, other=0.0) / s[:, None], mask=mask)


@triton.autotune(configs=_CONFIGS, key=[])
@triton.jit
def _token_logprobs_backward_kernel(
    H,
    W,
    B,
    Y,
    LSE,
    G,
    DW,
    DB,
    N,
    V,
    D,
    stride_h,
    stride_w,
    inv_t,
    HAS_BIAS: tl.constexpr,
    BIAS_GRAD: tl.constexpr,
    FP32_DOT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    cols = tl.program_id(0).to(tl.int64) * BLOCK_V + tl.arange(0, BLOCK_V)
    col_ok = cols < V
    db = tl.zeros([BLOCK_V], dtype=tl.float32)
    for n0 in range(0, N, BLOCK_N):
        rows = (n0 + tl.arange(0, BLOCK_N)).to(tl.int64)
        row_ok = rows < N
        z = _logits_tile(
            H,
            W,
            B,
            rows,
            row_ok,
            cols,
            col_ok,
            D,
            stride_h,
            stride_w,
            inv_t,
            HAS_BIAS,
            FP32_DOT,
            BLOCK_N,
            BLOCK_V,
            BLOCK_D,
        )
        lse = tl.load(LSE + rows, mask=row_ok, other=0.0)
        g_t = tl.load(G + rows, mask=row_ok, other=0.0)  # g / T; 0 on padding rows
        y = tl.load(Y + rows, mask=row_ok, other=-1)
        onehot = (cols[None, :] == y[:, None]).to(tl.float32)
        grad = g_t[:, None] * (onehot - tl.exp(z - lse[:, None]))  # (g/T)(onehot - p) [BLOCK_N, BLOCK_V]
        grad = tl.where(col_ok[None, :], grad, 0.0)
        if BIAS_GRAD:
            db += tl.sum(grad, axis=0)
        for d0 in range(0, D, BLOCK_D):  # dW[cols] += grad^T H[rows], BLOCK_D columns at a time
            ks = d0 + tl.arange(0, BLOCK_D)
            k_ok = ks < D
            h = tl.load(H + rows[:, None] * stride_h + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            dw_ptrs = DW + cols[:, None] * D + ks[None, :]
            dw_mask = col_ok[:, None] & k_ok[None, :]
            dw = tl.load(dw_ptrs, mask=dw_mask, other=0.0) + _dot(tl.trans(grad), h, FP32_DOT)
            tl.store(dw_ptrs, dw, mask=dw_mask)
        tl.debug_barrier()  # the next row block reads what this one stored, maybe from other threads
    if BIAS_GRAD:
        tl.store(DB + cols, db, mask=col_ok)


def _fp32_dot(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    return INTERPRET or torch.float32 in (hidden.dtype, weight.dtype)


def _check_device(hidden: torch.Tensor) -> None:
    if not hidden.is_cuda and not INTERPRET:
        raise ValueError(
            f"the Triton log-prob kernel needs CUDA tensors (got {hidden.device}); on CPU use impl='chunked', "
            "or set TRITON_INTERPRET=1 before triton is imported (tests)"
        )


def token_logprobs_forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    inv_t: float,
    entropy: bool,
    keep_j: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Launch the forward kernel: logp, lse, entropy (or None), J in hidden's dtype (or None)."""
    _check_device(hidden)
    n, d = hidden.shape
    logp = torch.empty(n, device=hidden.device, dtype=torch.float32)
    lse = torch.empty_like(logp)
    ent = torch.empty_like(logp) if entropy else None
    j = torch.zeros(n, d, device=hidden.device, dtype=torch.float32) if keep_j else None
    _token_logprobs_forward_kernel[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)](
        hidden,
        weight,
        weight if bias is None else bias,  # never read without a bias
        targets,
        logp,
        lse,
        lse if ent is None else ent,
        lse if j is None else j,
        n,
        weight.shape[0],
        d,
        hidden.stride(0),
        weight.stride(0),
        inv_t,
        HAS_BIAS=bias is not None,
        ENTROPY=entropy,
        KEEP_J=keep_j,
        FP32_DOT=_fp32_dot(hidden, weight),
    )
    return logp, lse, ent, None if j is None else j.to(hidden.dtype)


def token_logprobs_grad_weight(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    lse: torch.Tensor,
    g_t: torch.Tensor,
    inv_t: float,
    bias_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Launch the backward kernel: dW [V, D] and db [V] (float32, or None) for upstream g_t = g / T."""
    v, d = weight.shape
    dw = torch.zeros(v, d, device=weight.device, dtype=torch.float32)
    db = torch.empty(v, device=weight.device, dtype=torch.float32) if bias_grad else None
    _token_logprobs_backward_kernel[lambda meta: (triton.cdiv(v, meta["BLOCK_V"]),)](
        hidden,
        weight,
        weight if bias is None else bias,
        targets,
        lse,
        g_t,
        dw,
        dw if db is None else db,
        hidden.shape[0],
        v,
        d,
        hidden.stride(0),
        weight.stride(0),
        inv_t,
        HAS_BIAS=bias is not None,
        BIAS_GRAD=bias_grad,
        FP32_DOT=_fp32_dot(hidden, weight),
    )
    return dw, db


class TritonTokenLogProbs(torch.autograd.Function):
    """(logp [N], entropy [N] or None) of hidden [N, D], weight [V, D], bias [V] or None, targets [N].

    Inputs must be contiguous. Gradients flow to logp only; entropy is marked non-differentiable.
    """

    @staticmethod
    def forward(
        ctx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        temperature: float,
        compute_entropy: bool,
        keep_j: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        inv_t = 1.0 / temperature
        logp, lse, ent, j = token_logprobs_forward(hidden, weight, bias, targets, inv_t, compute_entropy, keep_j)
        ctx.save_for_backward(hidden, weight, bias, targets, lse, j)
        ctx.inv_t = inv_t
        if ent is not None:
            ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, grad_logp: torch.Tensor, grad_entropy: torch.Tensor | None):
        hidden, weight, bias, targets, lse, j = ctx.saved_tensors
        g_t = grad_logp.float().contiguous() * ctx.inv_t
        dh = dw = db = None
        if ctx.needs_input_grad[0]:
            dh = (j * g_t[:, None]).to(hidden.dtype)
        bias_grad = bias is not None and ctx.needs_input_grad[2]
        if ctx.needs_input_grad[1] or bias_grad:
            dw, db = token_logprobs_grad_weight(hidden, weight, bias, targets, lse, g_t, ctx.inv_t, bias_grad)
            dw = dw.to(weight.dtype) if ctx.needs_input_grad[1] else None
            db = None if db is None else db.to(bias.dtype)
        return dh, dw, db, None, None, None, None
