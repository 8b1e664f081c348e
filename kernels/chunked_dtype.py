"""Per-token log-probs in chunked torch with 16-bit GEMMs: impl "chunked" on CUDA (cuBLAS, no Triton).

Same math as kernels/triton_logprobs.py, in plain torch ops with a compute dtype (kernels/precision.py),
so that it runs (and is tested) on CPU tensors too; on CUDA its GEMMs are bf16/fp16 cuBLAS calls with
float32 accumulation, where the CPU path (kernels/chunked_logprobs.py) computes everything in float32.

    forward, per [rows, vocabulary] tile:  z = (H_c W_c^T + b) / T in float32 (GEMM in the compute dtype),
        m' = max(m, max_v z),  s = s e^(m - m') + sum_v e^(z - m'),  ez likewise with e z,  z_y picked
    backward, per chunk of rows, per vocabulary tile:  G = (g/T)(onehot(y) - exp(z - lse)) in the compute
        dtype;  dH[rows] += G W_c (float32 accumulator [rows, D]),  dW[cols] += G^T H_c (float32 [V, D]),
        db[cols] += sum_n G

TRL 1.16's chunked path (trl/kernels/chunked_logprob.py) has the same passes; it accumulates dH in a
float32 [N, D], where this one keeps a float32 [rows, D] per chunk of rows.
"""

from __future__ import annotations

import torch

from grpoflow.kernels.precision import addmm_fp32, mm_fp32


def _tile_logits(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, inv_t: float) -> torch.Tensor:
    """z = (h w^T + b) / T in float32, from a GEMM of h's dtype with a float32 result."""
    z = mm_fp32(h, w.t())
    if b is not None:
        z += b.float()
    return z.mul_(inv_t)


def chunked_dtype_forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    y: torch.Tensor,
    inv_t: float,
    entropy: bool,
    dtype: torch.dtype,
    row_chunk: int,
    vocab_chunk: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """logp, lse, entropy (or None), float32 [N]."""
    n, v = hidden.shape[0], weight.shape[0]
    m = torch.full((n,), float("-inf"), device=hidden.device)
    s, z_y, ez = torch.zeros(n, device=hidden.device), torch.zeros(n, device=hidden.device), None
    ez = torch.zeros(n, device=hidden.device) if entropy else None
    for c0 in range(0, v, vocab_chunk):
        c1 = min(c0 + vocab_chunk, v)
        w = weight[c0:c1].to(dtype)
        b = None if bias is None else bias[c0:c1]
        for r0 in range(0, n, row_chunk):
            rows = slice(r0, min(r0 + row_chunk, n))
            z = _tile_logits(hidden[rows].to(dtype), w, b, inv_t)
            m_new = torch.maximum(m[rows], z.amax(1))
            r = torch.exp(m[rows] - m_new)
            e = torch.exp(z - m_new[:, None])
            s[rows] = s[rows] * r + e.sum(1)
            if ez is not None:
                ez[rows] = ez[rows] * r + (e * z).sum(1)
            m[rows] = m_new
            local = y[rows] - c0
            inside = (local >= 0) & (local < c1 - c0)
            picked = z.gather(1, local.clamp(0, c1 - c0 - 1)[:, None]).squeeze(1)
            z_y[rows] = torch.where(inside, picked, z_y[rows])
    lse = m + torch.log(s)
    return z_y - lse, lse, None if ez is None else lse - ez / s


def chunked_dtype_backward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    y: torch.Tensor,
    lse: torch.Tensor,
    g_t: torch.Tensor,
    inv_t: float,
    dtype: torch.dtype,
    need: tuple[bool, bool, bool],
    row_chunk: int,
    vocab_chunk: int,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """dH (hidden's dtype), dW and db (float32) for upstream g_t = g / T; ``need`` = (dH, dW, db) wanted."""
    n, d = hidden.shape
    v = weight.shape[0]
    dh = torch.empty_like(hidden) if need[0] else None
    dw = torch.zeros(v, d, device=weight.device) if need[1] else None
    db = torch.zeros(v, device=weight.device) if need[2] else None
    for r0 in range(0, n, row_chunk):
        rows = slice(r0, min(r0 + row_chunk, n))
        h = hidden[rows].to(dtype)
        dh_acc = torch.zeros(h.shape, device=hidden.device) if dh is not None else None
        for c0 in range(0, v, vocab_chunk):
            c1 = min(c0 + vocab_chunk, v)
            w = weight[c0:c1].to(dtype)
            z = _tile_logits(h, w, None if bias is None else bias[c0:c1], inv_t)
            grad = torch.exp(z.sub_(lse[rows, None])).neg_()  # -p
            local = y[rows] - c0
            inside = (local >= 0) & (local < c1 - c0)
            # onehot(y) - p: adds 1 at each row's target when it falls in this tile, 0 elsewhere (masked arithmetic:
            # indexing by ``inside`` would be a nonzero, a device-to-host sync per tile)
            grad.scatter_add_(1, local.clamp(0, c1 - c0 - 1)[:, None], inside[:, None].to(grad.dtype))
            grad = grad.mul_(g_t[rows, None]).to(dtype)
            if dh_acc is not None:
                addmm_fp32(dh_acc, grad, w)
            if dw is not None:
                addmm_fp32(dw[c0:c1], grad.t(), h)
            if db is not None:
                db[c0:c1] += grad.sum(0, dtype=torch.float32)
        if dh is not None:
            dh[rows] = dh_acc
    return dh, dw, db


class ChunkedDtypeTokenLogProbs(torch.autograd.Function):
    """(logp [N], entropy [N] or None) of hidden [N, D], weight [V, D], bias [V] or None, targets [N], with
    GEMMs in ``dtype``. Gradients flow to logp only and take their input's dtype."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, compute_entropy, dtype, row_chunk, vocab_chunk):
        inv_t = 1.0 / temperature
        args = (inv_t, compute_entropy, dtype, row_chunk, vocab_chunk)
        logp, lse, ent = chunked_dtype_forward(hidden, weight, bias, targets, *args)
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.args = (inv_t, dtype)
        ctx.chunks = (row_chunk, vocab_chunk)
        if ent is not None:
            ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, grad_logp: torch.Tensor, grad_entropy: torch.Tensor | None):
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        need = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2])
        if not any(need):
            return (None,) * 9
        g_t = grad_logp.float() * ctx.args[0]
        dh, dw, db = chunked_dtype_backward(hidden, weight, bias, targets, lse, g_t, *ctx.args, need, *ctx.chunks)
        dw = None if dw is None else dw.to(weight.dtype)
        db = None if db is None else db.to(bias.dtype)
        return dh, dw, db, None, None, None, None, None, None
