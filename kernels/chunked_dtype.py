"""Per-token log-probs in chunked torch with 16-bit GEMMs: impl "chunked" on CUDA (cuBLAS, no Triton).

Same math as kernels/triton_logprobs.py, in torch GEMMs with a compute dtype (kernels/precision.py), so that it
runs (and is tested) on CPU tensors too; on CUDA its GEMMs are bf16/fp16 cuBLAS calls with float32 accumulation,
where the CPU path (kernels/chunked_logprobs.py) computes everything in float32. Between the GEMMs each tile goes
through the online-softmax fold of kernels/tiles.py: one Triton kernel on CUDA (kernels/triton_tiles.py: the tile
read once), plain torch ops elsewhere.

    forward, per [rows, vocabulary] tile:  z = (H_c W_c^T + b) / T in float32 (GEMM in the compute dtype),
        m' = max(m, max_v z),  s = s e^(m - m') + sum_v e^(z - m'),  c likewise with e (z - m'),  z_y picked
    backward, per chunk of rows, per vocabulary tile:  G = (1/T)[g onehot(y) - p (g + g_H (z - lse + H))] in
        the compute dtype (kernels/logit_grad.py; g_H, the entropy's upstream gradient, is 0 without it);
        dH[rows] += G W_c (float32 accumulator [rows, D]),  dW[cols] += G^T H_c (float32 [V, D]),  db[cols] += sum_n G

A frozen head (LoRA: W and b without gradient) takes :func:`frozen_head_forward` instead, which keeps
J = dlogp/dH * T (and the entropy's J_H) from the forward so that backward is a row scale (4NVD FLOPs in all
for logp, against 6NVD for the two passes above).

TRL 1.16's chunked path (trl/kernels/chunked_logprob.py) has the same passes; it accumulates dH in a
float32 [N, D], where this one keeps a float32 [rows, D] per chunk of rows.
"""

from __future__ import annotations

import torch

from grpoflow.kernels.precision import addmm_fp32, mm_fp32
from grpoflow.kernels.tile_state import MAX_FUSED_COLS, Accumulators, FoldState, new_state
from grpoflow.kernels.tiles import fold_tile, fused_available, grad_tile


def _rows_of(state: FoldState, rows: slice) -> FoldState:
    """The fold state of ``rows``: views, updated in place by the fold."""
    return FoldState(*(None if t is None else t[rows] for t in state))


def _max_cols(vocab_chunk: int, fused: bool) -> int:
    """The vocabulary tile width: the fused fold holds a row of the tile in registers (at most MAX_FUSED_COLS)."""
    return min(vocab_chunk, MAX_FUSED_COLS) if fused else vocab_chunk


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
    fused: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """logp, lse, entropy (or None), float32 [N]: per [row_chunk, vocab_chunk] tile a GEMM into float32, then the
    online-softmax fold of kernels/tiles.py (``fused``: the Triton fold, one read of the tile; default on CUDA).

        lse = m + log s,   logp = z_y - lse,   entropy = log s - c / s   (c = sum_v e^(z - m) (z - m))"""
    n, v = hidden.shape[0], weight.shape[0]
    fused = fused_available(hidden) if fused is None else fused
    vocab_chunk = _max_cols(vocab_chunk, fused)
    state = new_state(n, entropy, hidden.device)
    for c0 in range(0, v, vocab_chunk):
        c1 = min(c0 + vocab_chunk, v)
        w = weight[c0:c1].to(dtype)
        b = None if bias is None else bias[c0:c1]
        for r0 in range(0, n, row_chunk):
            rows = slice(r0, min(r0 + row_chunk, n))
            u = mm_fp32(hidden[rows].to(dtype), w.t())
            fold_tile(u, b, inv_t, y[rows] - c0, _rows_of(state, rows), None, fused=fused)
    log_s = torch.log(state.s)
    lse = state.m + log_s
    return state.z_y - lse, lse, None if state.c is None else log_s - state.c / state.s


def frozen_head_forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    y: torch.Tensor,
    inv_t: float,
    entropy: bool,
    keep_jh: bool,
    dtype: torch.dtype,
    row_chunk: int,
    vocab_chunk: int,
    fused: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """logp, lse, entropy (or None) float32 [N], and J, J_H (or None) in hidden's dtype [N, D]: the forward of a
    frozen head (W and b without gradient, H with), whose backward is then a row scale, no GEMM:

        dH = (g / T) J + (g_H / T) J_H,    J = W_y - E_p[W],    J_H = -(E_p[(z - m) W] - E_p[z - m] E_p[W])

    (J_H = -sum_v p_v (z_v - lse + H) W_v, kernels/logit_grad.py's entropy term times W; only with ``keep_jh``).
    Per chunk of rows, per vocabulary tile: u = H_c W_c^T (GEMM 1, float32), the fold of kernels/tiles.py (running
    m, s, c, z_y; e = exp(z - m) in the compute dtype; ``fused``: the Triton fold, default on CUDA), then
    a = r a + e W_c (GEMM 2, [rows, D], float32 accumulator) and with ``keep_jh`` b = r (b - δ a) + e (z - m) W_c
    (GEMM 3). Cost: 4NVD FLOPs for logp (6NVD with J_H) and no backward GEMM, where recomputing the logits in the
    backward costs 6NVD (2NVD forward, 2NVD logits again, 2NVD for G W). Tiles are [row_chunk, vocab_chunk]:
    nothing of size [N, V] exists."""
    n, d = hidden.shape
    v = weight.shape[0]
    dev = hidden.device
    fused = fused_available(hidden) if fused is None else fused
    vocab_chunk = _max_cols(vocab_chunk, fused)
    logp, lse = torch.empty(n, device=dev), torch.empty(n, device=dev)
    ent = torch.empty(n, device=dev) if entropy or keep_jh else None
    j = torch.empty_like(hidden)
    jh = torch.empty_like(hidden) if keep_jh else None
    for r0 in range(0, n, row_chunk):
        rows = slice(r0, min(r0 + row_chunk, n))
        h, yr = hidden[rows].to(dtype), y[rows]
        k = h.shape[0]
        state = new_state(k, ent is not None, dev)
        a = torch.zeros(k, d, device=dev)
        b = torch.zeros(k, d, device=dev) if keep_jh else None
        for c0 in range(0, v, vocab_chunk):
            c1 = min(c0 + vocab_chunk, v)
            w = weight[c0:c1].to(dtype)
            u = mm_fp32(h, w.t())
            b_c = None if bias is None else bias[c0:c1]
            f = fold_tile(u, b_c, inv_t, yr - c0, state, dtype, keep_jh, Accumulators(a, b), fused)  # rescales a, b
            if b is not None:
                addmm_fp32(b, f.ezm, w)
            addmm_fp32(a, f.e, w)
        log_s = torch.log(state.s)
        lse[rows] = state.m + log_s
        logp[rows] = state.z_y - lse[rows]
        if ent is not None:
            mean_zm = state.c / state.s  # E_p[z - m]
            ent[rows] = log_s - mean_zm  # lse - E_p[z]
        mean_w = a.div_(state.s[:, None])  # E_p[W]
        j[rows] = weight[yr].to(dtype).float() - mean_w  # W_y as the GEMMs saw it
        if jh is not None:
            jh[rows] = torch.addcmul(b.div_(state.s[:, None]), mean_zm[:, None], mean_w, value=-1.0).neg_()
    return logp, lse, ent, j, jh


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
    ent: torch.Tensor | None = None,
    ge_t: torch.Tensor | None = None,
    fused: bool | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """dH (hidden's dtype), dW and db (float32) for upstream g_t = g / T; ``need`` = (dH, dW, db) wanted.

    With ``ent`` (H [N]) and ``ge_t`` (its upstream gradient over T [N]) the entropy's gradient is added. Per tile:
    u = H_c W_c^T (GEMM, float32), G in the compute dtype (kernels/tiles.py grad_tile; ``fused``: the Triton
    route, one read of u, default on CUDA), then the GEMMs dH += G W_c and dW += G^T H_c."""
    fused = fused_available(hidden) if fused is None else fused
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
            u = mm_fp32(h, w.t())
            ent_r = None if ent is None else ent[rows]
            ge_r = None if ge_t is None else ge_t[rows]
            b = None if bias is None else bias[c0:c1]
            grad = grad_tile(u, b, inv_t, lse[rows], y[rows] - c0, g_t[rows], ent_r, ge_r, dtype, fused)
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
    GEMMs in ``dtype``. Gradients take their input's dtype; the entropy carries one only with ``entropy_grad``
    (the entropy bonus), else it is marked non-differentiable. A frozen head (weight and bias without gradient,
    hidden with) takes :func:`frozen_head_forward`: J (and J_H with ``entropy_grad``) kept, backward a row scale.
    ``keep_j`` (the caller's ``torch.is_grad_enabled()``: forward always runs with grad disabled, so it cannot tell
    for itself) allows that path; False under no_grad, where forming J would double the forward's GEMMs for nothing."""

    @staticmethod
    def forward(
        ctx, hidden, weight, bias, targets, temperature, compute_entropy, dtype, row_chunk, vocab_chunk,
        entropy_grad=False, keep_j=True,
    ):  # fmt: skip
        inv_t = 1.0 / temperature
        needs = ctx.needs_input_grad
        ctx.frozen = keep_j and needs[0] and not needs[1] and not (bias is not None and needs[2])
        if ctx.frozen:
            args = (inv_t, compute_entropy or entropy_grad, entropy_grad, dtype, row_chunk, vocab_chunk)
            logp, lse, ent, j, jh = frozen_head_forward(hidden, weight, bias, targets, *args)
            ctx.save_for_backward(j, jh)
        else:
            args = (inv_t, compute_entropy or entropy_grad, dtype, row_chunk, vocab_chunk)
            logp, lse, ent = chunked_dtype_forward(hidden, weight, bias, targets, *args)
            ctx.save_for_backward(hidden, weight, bias, targets, lse, ent if entropy_grad else None)
        ctx.args = (inv_t, dtype)
        ctx.chunks = (row_chunk, vocab_chunk)
        if ent is not None and not entropy_grad:
            ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, grad_logp: torch.Tensor, grad_entropy: torch.Tensor | None):
        g_t = grad_logp.float() * ctx.args[0]
        if ctx.frozen:  # dH = (g J + g_H J_H) / T: a row scale, no GEMM over the vocabulary
            j, jh = ctx.saved_tensors
            dh = j * g_t[:, None]
            if jh is not None and grad_entropy is not None:
                dh = dh.addcmul_(jh, grad_entropy.float()[:, None], value=ctx.args[0])
            return (dh.to(j.dtype),) + (None,) * 10
        hidden, weight, bias, targets, lse, ent = ctx.saved_tensors
        need = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2])
        if not any(need):
            return (None,) * 11
        ge_t = None if ent is None or grad_entropy is None else grad_entropy.float() * ctx.args[0]
        dh, dw, db = chunked_dtype_backward(
            hidden, weight, bias, targets, lse, g_t, *ctx.args, need, *ctx.chunks, ent=ent, ge_t=ge_t
        )
        dw = None if dw is None else dw.to(weight.dtype)
        db = None if db is None else db.to(bias.dtype)
        return dh, dw, db, None, None, None, None, None, None, None, None
