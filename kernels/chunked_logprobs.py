"""Per-token log-probs from hidden states and the lm_head, in chunked torch: the CPU path.

Notation: H [N, D] hidden states, W [V, D] head weight, b [V] bias, y [N] targets, T temperature,

    z = (H W^T + b) / T                           # [N, V]: only one [row_chunk, vocab_chunk] tile exists
    p = softmax(z),  lse = logsumexp(z),  logp = z_y - lse,  entropy = lse - sum_v p_v z_v

Forward: one streaming pass over the vocabulary in tiles (each tile visits every chunk of rows),
accumulating per row, with a shift m (below), the logsumexp sums of the flash-attention recurrence
(keys = values = W):

    e_v = exp(z_v - m),   a = sum_v e_v W_v,   s = sum_v e_v,   lse = m + log s

When H needs a gradient, the forward also keeps J = W_y - a / s [N, D] (same size as H), because

    d logp_n / d H_n = (W_{y_n} - sum_v p_nv W_v) / T = J_n / T

does not depend on the upstream gradient g; backward is then dH = (g / T) J with no recomputation.
The entropy comes from the same sums: sum_v p_v z_v = ((H/T) . a + sum_v e_v b_v / T) / s.

Each tile costs two GEMMs and one elementwise pass (exp), by augmenting both operands:

    H' = [H/T | 1 | -m]   [N, D+2]        W' = [W | b/T | 1]   [V, D+2]
    H' W'^T = z - m  (GEMM 1),            e W' = [a | sum e b/T | s]  (GEMM 2)

Unlike flash attention there is no running max (on CPU its max and subtract passes cost as much again
as the exp): the shift m is the target logit z_y (then logp = -log s exactly), and a row whose sums
overflow float32 (a logit about 88 above the target's, e.g. an unlikely padding target at a low
temperature; rare) is redone in two passes, shifted by its exact row max found in the first.

Only a trainable head (full fine-tuning; with LoRA it is frozen) needs g inside the vocabulary sum;
backward then recomputes each tile as p = exp(H' W'^T) with -lse in H''s shift column and accumulates

    dW = sum_n (g_n / T) (onehot(y_n) - p_n)^T H_n,       db = sum_n (g_n / T) (onehot(y_n) - p_n).

The entropy is returned without a gradient (a metric and a mask in GRPO, as in TRL) unless ``entropy_grad``
(the entropy bonus): then backward recomputes each tile and forms G = dL/d(H W^T + b) with the entropy's term
(kernels/logit_grad.py) in float32, through kernels/chunked_dtype.py's backward, and J is not kept, except for a
frozen head (the LoRA case), where the forward also keeps

    J_H = -sum_v p_v (z_v - lse + H) W_v = -(E_p[(z - m) W] - E_p[z - m] E_p[W])     [N, D]

from a third GEMM per tile, e (z - m) W' (same augmented operands), and backward is dH = (g J + g_H J_H) / T,
a row scale and no GEMM over the vocabulary (6NVD FLOPs in all, against 8NVD for recomputing). Arithmetic is
float32 whatever the input dtype (the augmented copies are float32). Tile buffers are allocated once
and reused: writing fresh float32 tiles costs about 3x writing reused ones on CPU (page faults).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from grpoflow.kernels.chunked_dtype import chunked_dtype_backward


def _view(buf: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """A contiguous [rows, cols] view of the front of the flat reusable buffer ``buf``."""
    return buf[: rows * cols].view(rows, cols)


def _augmented_hidden(hidden: torch.Tensor, inv_t: float) -> torch.Tensor:
    """H' = [H/T | 1 | -m] [N, D+2], float32, with the shift m left at 0."""
    n, d = hidden.shape
    h = torch.empty(n, d + 2, device=hidden.device)
    h[:, :d] = hidden
    h[:, :d] *= inv_t
    h[:, d] = 1.0
    h[:, d + 1] = 0.0
    return h


def _augmented_weight_tiles(
    weight: torch.Tensor, b_t: torch.Tensor | None, vocab_chunk: int
) -> Iterator[tuple[slice, torch.Tensor]]:
    """(vocabulary slice, W'[slice] = [W | b/T | 1] as float32 [c, D+2]) per tile, in one reused buffer."""
    v, d = weight.shape
    buf = torch.empty(min(vocab_chunk, v) * (d + 2), device=weight.device)
    for start in range(0, v, vocab_chunk):
        cols = slice(start, min(start + vocab_chunk, v))
        w = _view(buf, cols.stop - start, d + 2)
        w[:, :d] = weight[cols]
        w[:, d] = 0.0 if b_t is None else b_t[cols]
        w[:, d + 1] = 1.0
        yield cols, w


def _fold_vocab(
    h: torch.Tensor,
    weight: torch.Tensor,
    b_t: torch.Tensor | None,
    acc: torch.Tensor,
    row_chunk: int,
    vocab_chunk: int,
    acc_z: torch.Tensor | None = None,
) -> None:
    """acc += sum over vocabulary tiles of exp(H' W'^T) W'[:, -width:], in place: per tile a GEMM, exp, a GEMM.

    With ``acc_z`` [N, D+2] also acc_z += (e (z - m)) W' (a third GEMM per tile: the entropy's J_H)."""
    rc, vc = min(row_chunk, h.shape[0]), min(vocab_chunk, weight.shape[0])
    z_buf = h.new_empty(rc * vc)
    e_buf = h.new_empty(rc * vc) if acc_z is not None else None
    for _, w in _augmented_weight_tiles(weight, b_t, vocab_chunk):
        w_acc = w[:, w.shape[1] - acc.shape[1] :]
        for i in range(0, h.shape[0], row_chunk):
            rows = h[i : i + row_chunk]
            zm = torch.mm(rows, w.t(), out=_view(z_buf, rows.shape[0], w.shape[0]))  # z - m [n, c]
            if acc_z is None:
                acc[i : i + row_chunk].addmm_(zm.exp_(), w_acc)  # exp(z - m), in place
                continue
            e = torch.exp(zm, out=_view(e_buf, rows.shape[0], w.shape[0]))
            acc[i : i + row_chunk].addmm_(e, w_acc)
            acc_z[i : i + row_chunk].addmm_(zm.mul_(e), w)


def _row_max(h: torch.Tensor, weight: torch.Tensor, b_t: torch.Tensor | None, vocab_chunk: int) -> torch.Tensor:
    """max_v z_v [n] for rows h = H' whose shift column is 0 (the overflow path: rows are few)."""
    m = h.new_full((h.shape[0],), float("-inf"))
    for _, w in _augmented_weight_tiles(weight, b_t, vocab_chunk):
        torch.maximum(m, (h @ w.t()).amax(1), out=m)
    return m


def _refold_overflowed(
    h: torch.Tensor,
    weight: torch.Tensor,
    b_t: torch.Tensor | None,
    acc: torch.Tensor,
    row_chunk: int,
    vocab_chunk: int,
    acc_z: torch.Tensor | None = None,
) -> None:
    """Redo, shifted by their exact row max, the rows whose s (and so a) overflowed float32 or came close."""
    overflow = ~(acc[:, -1] < 2.0**100)  # also catches inf and NaN
    if not overflow.any():
        return
    h_o = h[overflow]
    h_o[:, -1] = 0.0
    h_o[:, -1] = -_row_max(h_o, weight, b_t, vocab_chunk)
    acc_o = acc.new_zeros(h_o.shape[0], acc.shape[1])
    acc_zo = None if acc_z is None else acc_z.new_zeros(h_o.shape[0], acc_z.shape[1])
    _fold_vocab(h_o, weight, b_t, acc_o, row_chunk, vocab_chunk, acc_zo)
    h[overflow], acc[overflow] = h_o, acc_o
    if acc_z is not None:
        acc_z[overflow] = acc_zo


def _forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    y: torch.Tensor,
    inv_t: float,
    entropy: bool,
    keep_j: bool,
    row_chunk: int,
    vocab_chunk: int,
    keep_jh: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """logp, lse, entropy (or None), J and J_H in hidden's dtype (or None), all rows [N].

    ``keep_jh`` (a frozen head with the entropy's gradient; implies ``entropy`` and ``keep_j``) also keeps
    J_H = -sum_v p_v (z_v - lse + H) W_v = -(E_p[(z - m) W] - E_p[z - m] E_p[W]), so that dH = (g J + g_H J_H) / T."""
    n, d = hidden.shape
    b_t = None if bias is None else bias.float() * inv_t
    h = _augmented_hidden(hidden, inv_t)
    z_y = (h[:, :d] * weight[y].float()).sum(1) + (0.0 if b_t is None else b_t[y])
    h[:, -1] = -z_y  # the shift m starts at the target logit
    acc = h.new_zeros(n, d + 2 if keep_j or entropy else 1)  # [a | sum e b/T | s], or s alone
    acc_z = h.new_zeros(n, d + 2) if keep_jh else None  # [sum e (z-m) W | sum e (z-m) b/T | sum e (z-m)]
    _fold_vocab(h, weight, b_t, acc, row_chunk, vocab_chunk, acc_z)
    _refold_overflowed(h, weight, b_t, acc, row_chunk, vocab_chunk, acc_z)
    s = acc[:, -1]
    log_s = torch.log(s) - (h[:, -1] + z_y)  # log s + (m - z_y): exactly log s while m = z_y
    lse = z_y + log_s
    mean_w = acc[:, :d].div_(s[:, None]) if keep_j or entropy else None  # sum_v p_v W_v
    ent = lse - (h[:, :d] * mean_w).sum(1) - acc[:, d] / s if entropy else None
    j = torch.sub(weight[y], mean_w).to(hidden.dtype) if keep_j else None
    jh = None
    if acc_z is not None:
        acc_z.div_(s[:, None])  # E_p[(z - m) W | (z - m) b/T | z - m]
        jh = torch.addcmul(acc_z[:, :d], acc_z[:, d + 1 :], mean_w, value=-1.0).neg_().to(hidden.dtype)
    return -log_s, lse, ent, j, jh


def _grad_weight(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    y: torch.Tensor,
    lse: torch.Tensor,
    g_t: torch.Tensor,
    inv_t: float,
    row_chunk: int,
    vocab_chunk: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """dW [V, D] and db [V] (float32) for upstream g_t = g / T, recomputing each tile as p = exp(H' W'^T)."""
    n, d = hidden.shape
    h = _augmented_hidden(hidden, inv_t)
    h[:, -1] = -lse  # so that H' W'^T = z - lse = log p
    b_t = None if bias is None else bias.float() * inv_t
    dw = torch.zeros(weight.shape, device=weight.device)
    db = torch.zeros(weight.shape[0], device=weight.device)
    hg = h[:, : d + 1] * g_t[:, None]  # [(g/T) H/T | g/T]
    z_buf = h.new_empty(min(row_chunk, n) * min(vocab_chunk, weight.shape[0]))
    dw_buf = h.new_empty(min(vocab_chunk, weight.shape[0]) * (d + 1))
    for cols, w in _augmented_weight_tiles(weight, b_t, vocab_chunk):
        dw_aug = _view(dw_buf, w.shape[0], d + 1).zero_()  # [sum_n (g/T) p H/T | sum_n (g/T) p]
        for i in range(0, n, row_chunk):
            rows = h[i : i + row_chunk]
            p = torch.mm(rows, w.t(), out=_view(z_buf, rows.shape[0], w.shape[0])).exp_()  # [n, c]
            dw_aug.addmm_(p.t(), hg[i : i + row_chunk])
        torch.mul(dw_aug[:, :d], -1.0 / inv_t, out=dw[cols])
        torch.neg(dw_aug[:, d], out=db[cols])
    # the onehot part: dW_y += (g/T) H, db_y += g/T
    dw.index_add_(0, y, g_t[:, None] * hidden.float())
    db.index_add_(0, y, g_t)
    return dw, db


class ChunkedTokenLogProbs(torch.autograd.Function):
    """(logp [N], entropy [N] or None) of hidden [N, D], weight [V, D], bias [V] or None, targets [N].

    Gradients flow to logp, and to the entropy with ``entropy_grad`` (else it is marked non-differentiable).
    J is kept when ``keep_j``; with ``entropy_grad`` only for a frozen head (weight and bias without grad), together
    with J_H: the frozen-head path, about 4NVD FLOPs for logp (two GEMMs per tile in the forward, none in the
    backward: dH = (g/T) J) and 6NVD with the entropy's gradient (a third forward GEMM; dH = (g J + g_H J_H) / T),
    where recomputing the logits in the backward costs 8NVD. A trainable head recomputes every tile in backward."""

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
        row_chunk: int,
        vocab_chunk: int,
        entropy_grad: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        inv_t = 1.0 / temperature
        frozen = not (ctx.needs_input_grad[1] or (bias is not None and ctx.needs_input_grad[2]))
        keep_jh = keep_j and entropy_grad and frozen
        keep_j = keep_j and (keep_jh or not entropy_grad)
        args = (inv_t, compute_entropy or entropy_grad, keep_j, row_chunk, vocab_chunk, keep_jh)
        logp, lse, ent, j, jh = _forward(hidden, weight, bias, targets, *args)
        recompute = entropy_grad and not keep_jh
        ctx.save_for_backward(hidden, weight, bias, targets, lse, j, jh, ent if recompute else None)
        ctx.inv_t, ctx.row_chunk, ctx.vocab_chunk = inv_t, row_chunk, vocab_chunk
        ctx.recompute = recompute
        if ent is not None and not entropy_grad:
            ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, grad_logp: torch.Tensor, grad_entropy: torch.Tensor | None):
        hidden, weight, bias, targets, lse, j, jh, ent = ctx.saved_tensors
        g_t = grad_logp.float() * ctx.inv_t
        ge_t = None if grad_entropy is None else grad_entropy.float() * ctx.inv_t
        dh = dw = db = None
        if ctx.recompute:
            need = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2])
            chunks = (ctx.row_chunk, ctx.vocab_chunk)
            dh, dw, db = chunked_dtype_backward(
                hidden, weight, bias, targets, lse, g_t, ctx.inv_t, torch.float32, need, *chunks, ent=ent, ge_t=ge_t
            )
            dw = None if dw is None else dw.to(weight.dtype)
            db = None if db is None else db.to(bias.dtype)
            return dh, dw, db, None, None, None, None, None, None, None
        if ctx.needs_input_grad[0]:
            dh = j * g_t[:, None]  # a row scale: no GEMM over the vocabulary
            if jh is not None and ge_t is not None:
                dh = dh.addcmul_(jh, ge_t[:, None])
            dh = dh.to(hidden.dtype)
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            args = (ctx.inv_t, ctx.row_chunk, ctx.vocab_chunk)
            dw, db = _grad_weight(hidden, weight, bias, targets, lse, g_t, *args)
            dw = dw.to(weight.dtype) if ctx.needs_input_grad[1] else None
            db = db.to(bias.dtype) if ctx.needs_input_grad[2] else None
        return dh, dw, db, None, None, None, None, None, None, None
