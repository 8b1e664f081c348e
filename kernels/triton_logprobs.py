"""Per-token log-probs from hidden states and the lm_head: the Triton path (the GPU default).

Notation as in kernels/chunked_logprobs.py: H [N, D], W [V, D], b [V], y [N], T,

    z = (H W^T + b) / T,  lse = logsumexp(z),  logp = z_y - lse,  entropy = lse - sum_v p_v z_v
    dlogp_n / dz_nv = onehot(y_n)_v - p_nv,   dH_n / dz_nv = -p_nv (log p_nv + H_n)   (H: the entropy)
    G = (1/T)[g onehot(y) - p (g + g_H (z - lse + H))]   [N, V]   (g_H = 0 unless the entropy has a gradient;
                                                                    kernels/logit_grad.py)
    dH = G W,   dW = G^T H,   db = sum_n G_n

Design (docs/kernel-roofline.md has the FLOP and byte counts behind it):

- forward, ``_forward_kernel``: the logsumexp only. Grid (row block, vocabulary split): each program
  streams its split of the vocabulary in BLOCK_V tiles (each tile's logits reduced over D in BLOCK_D steps
  by tl.dot, float32 accumulation) and keeps flash attention's running max m, sum s, target logit z_y and
  sum e*z in registers; it writes these four partials per row, and :func:`merge_partials` combines the
  splits (a log-sum-exp merge over a few [N] vectors). Splits are picked from N so that small N still
  gives >= 2 programs per SM. Nothing of size [N, D] or [N, V] is written.
- backward, per chunk of rows (so that the chunk's G fits ``G_BUDGET_BYTES``): ``_grad_logits_kernel``
  recomputes the logits tile by tile and writes G in the compute dtype; then dH[chunk] = G W and
  dW += G^T H[chunk] are two cuBLAS GEMMs (their accumulators live in registers over the vocabulary and
  over the chunk's rows), db the column sums of G. Recomputing the logits costs 2NVD FLOPs more than
  keeping J = dlogp/dH from the forward, but keeping J needs an [N, D] accumulator that no register file
  holds at D = 4096: that design paid a float32 [BLOCK_N, D] round trip per vocabulary tile instead.

Launch and tiling: every program index goes through :func:`_grouped` (GROUP_N row blocks walk one vocabulary
index together, then the next: programs in flight share H row blocks and W tiles in L2, the GEMM "GROUP_M" order);
BLOCK_N is fixed (128 on CUDA, 64 under the interpreter) and BLOCK_V x BLOCK_D, warps and stages are autotuned per
(V, D, exact dots) from CONFIGS (logit tiles BLOCK_N x BLOCK_V of 128x128 or 128x256, BLOCK_D 32 to 128, 3-4
stages; the autotuner skips configs that overflow shared memory, e.g. with float32 operands; one small config under
the interpreter, which has no timing to tune by); every pointer offset of a row or column index times a stride is
int64 (W's offsets pass 2^31 once V * D >= 2^31, e.g. V=151936 at D=16384).

Dot operands take the compute dtype (kernels/precision.py: the autocast dtype on CUDA) with float32
accumulation; float32 operands use exact ("ieee") dots, as torch matmuls do by default. Under
TRITON_INTERPRET=1 every dot operand is cast to float32: the interpreter multiplies bf16 as raw bits.
Every launch enters its tensors' device context (kernels/launch.py).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from grpoflow.kernels.launch import launch
from grpoflow.kernels.precision import addmm_fp32, mm_into

# Read once: the kernels below are decorated (interpreted or compiled) when this module is imported.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# Rows per program: fixed (the forward's vocabulary splits and partial buffers are sized from it before launch);
# the vocabulary and reduction tiles, warps and pipeline stages are autotuned per (V, D) on CUDA.
BLOCK_N = 64 if INTERPRET else 128
V_ROUND = 128 if INTERPRET else 256  # a forward split is a whole number of the largest BLOCK_V tiles
GROUP_N = 8  # row blocks per launch group (the grouped order below)
PROGRAMS_PER_SM = 2
_CUDA_CONFIGS = [
    triton.Config({"BLOCK_V": bv, "BLOCK_D": bd}, num_warps=8, num_stages=st)
    for bv, bd, st in ((128, 64, 3), (128, 64, 4), (256, 64, 3), (256, 32, 4), (128, 128, 3))
]
# The interpreter is ~1000x slower and has no timing to tune by: one small config (the tests' ragged shapes
# N=70, V=300, D=80 cross its 64 x 128 x 64 blocks).
_INTERPRET_CONFIGS = [triton.Config({"BLOCK_V": 128, "BLOCK_D": 64}, num_warps=4, num_stages=1)]
CONFIGS = _INTERPRET_CONFIGS if INTERPRET else _CUDA_CONFIGS
G_BUDGET_BYTES = 1 << 30  # the backward's [rows, V] tile of G: 1 GiB (the bf16 head itself is 1.2 GB at D=4096)
_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _logits_tile(
    H, W, B, rows, row_ok, cols, col_ok, D, stride_h, stride_w, inv_t,
    HAS_BIAS: tl.constexpr, DOT_DTYPE: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """z = (H[rows] W[cols]^T + b[cols]) / T as a float32 [BLOCK_N, BLOCK_V] tile; operands in DOT_DTYPE."""
    z = tl.zeros([BLOCK_N, BLOCK_V], dtype=tl.float32)
    h_rows = H + rows.to(tl.int64)[:, None] * stride_h  # int64: row * stride passes 2^31 at V * D >= 2^31
    w_rows = W + cols.to(tl.int64)[:, None] * stride_w
    for d0 in range(0, D, BLOCK_D):
        ks = d0 + tl.arange(0, BLOCK_D)
        k_ok = ks < D
        h = tl.load(h_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_rows + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        if IEEE:
            z += tl.dot(h.to(DOT_DTYPE), tl.trans(w.to(DOT_DTYPE)), input_precision="ieee")
        else:
            z += tl.dot(h.to(DOT_DTYPE), tl.trans(w.to(DOT_DTYPE)))
    if HAS_BIAS:
        z += tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    return z * inv_t


@triton.jit
def _grouped(pid, num_n, num_v, GROUP_N: tl.constexpr):
    """(row block, vocabulary index) of program ``pid`` in the grouped order: consecutive programs walk a group of
    GROUP_N row blocks down one vocabulary index, then the next index. Programs in flight together then share a
    few H row blocks and a few W tiles, which stay in L2 (row-major order would stream every W tile per row block)."""
    per_group = GROUP_N * num_v
    first = (pid // per_group) * GROUP_N
    size = tl.minimum(num_n - first, GROUP_N)
    local = pid % per_group
    return first + local % size, local // size


@triton.autotune(configs=CONFIGS, key=["V", "D", "IEEE"])
@triton.jit
def _forward_kernel(
    H, W, B, Y, M_OUT, S_OUT, ZY_OUT, EZ_OUT, N, V, D, V_SPLIT, stride_h, stride_w, inv_t,
    HAS_BIAS: tl.constexpr, ENTROPY: tl.constexpr, DOT_DTYPE: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, GROUP_N: tl.constexpr,
):  # fmt: skip
    """Program (row block, split), grouped (:func:`_grouped`): partials m, s, z_y, sum e*z of its rows over its
    vocabulary split."""
    pid_n, split = _grouped(tl.program_id(0), tl.cdiv(N, BLOCK_N), tl.cdiv(V, V_SPLIT), GROUP_N)
    rows = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    y = tl.load(Y + rows, mask=row_ok, other=0)
    m = tl.full([BLOCK_N], float("-inf"), dtype=tl.float32)
    s = tl.zeros([BLOCK_N], dtype=tl.float32)
    z_y = tl.zeros([BLOCK_N], dtype=tl.float32)
    ez = tl.zeros([BLOCK_N], dtype=tl.float32)  # sum_v e_v z_v at scale m
    v_start = split.to(tl.int64) * V_SPLIT
    v_end = tl.minimum(v_start + V_SPLIT, V)
    for v0 in range(v_start, v_end, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V).to(tl.int64)
        col_ok = cols < v_end
        z = _logits_tile(
            H, W, B, rows, row_ok, cols, col_ok, D, stride_h, stride_w, inv_t,
            HAS_BIAS, DOT_DTYPE, IEEE, BLOCK_N, BLOCK_V, BLOCK_D,
        )  # fmt: skip
        z = tl.where(col_ok[None, :], z, 0.0)
        z_y += tl.sum(tl.where(cols[None, :] == y[:, None], z, 0.0), axis=1)
        m_new = tl.maximum(m, tl.max(tl.where(col_ok[None, :], z, float("-inf")), axis=1))
        r = tl.exp(m - m_new)  # 0 on the first tile
        e = tl.where(col_ok[None, :], tl.exp(z - m_new[:, None]), 0.0)
        s = s * r + tl.sum(e, axis=1)
        if ENTROPY:
            ez = ez * r + tl.sum(e * z, axis=1)
        m = m_new
    out = split.to(tl.int64) * N + rows
    tl.store(M_OUT + out, m, mask=row_ok)
    tl.store(S_OUT + out, s, mask=row_ok)
    tl.store(ZY_OUT + out, z_y, mask=row_ok)
    if ENTROPY:
        tl.store(EZ_OUT + out, ez, mask=row_ok)


@triton.autotune(configs=CONFIGS, key=["V", "D", "IEEE"])
@triton.jit
def _grad_logits_kernel(
    H, W, B, Y, LSE, G_T, ENT, GE_T, G_OUT, N, V, D, stride_h, stride_w, inv_t,
    HAS_BIAS: tl.constexpr, ENT_GRAD: tl.constexpr, DOT_DTYPE: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, GROUP_N: tl.constexpr,
):  # fmt: skip
    """Program (row block, vocabulary tile): G = (1/T)[g onehot(y) - p (g + g_H (z - lse + H))] with
    p = exp(z - lse), stored in G_OUT's dtype; the g_H term only when ENT_GRAD (ENT: H, GE_T: g_H / T).
    Programs run in the grouped order (:func:`_grouped`)."""
    pid_n, pid_v = _grouped(tl.program_id(0), tl.cdiv(N, BLOCK_N), tl.cdiv(V, BLOCK_V), GROUP_N)
    rows = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = pid_v.to(tl.int64) * BLOCK_V + tl.arange(0, BLOCK_V)
    row_ok = rows < N
    col_ok = cols < V
    z = _logits_tile(
        H, W, B, rows, row_ok, cols, col_ok, D, stride_h, stride_w, inv_t,
        HAS_BIAS, DOT_DTYPE, IEEE, BLOCK_N, BLOCK_V, BLOCK_D,
    )  # fmt: skip
    lse = tl.load(LSE + rows, mask=row_ok, other=0.0)
    g_t = tl.load(G_T + rows, mask=row_ok, other=0.0)  # g / T
    y = tl.load(Y + rows, mask=row_ok, other=-1)
    onehot = (cols[None, :] == y[:, None]).to(tl.float32)
    log_p = z - lse[:, None]
    coef = g_t[:, None]
    if ENT_GRAD:
        ent = tl.load(ENT + rows, mask=row_ok, other=0.0)
        ge_t = tl.load(GE_T + rows, mask=row_ok, other=0.0)  # g_H / T
        coef = coef + ge_t[:, None] * (log_p + ent[:, None])
    grad = g_t[:, None] * onehot - tl.exp(log_p) * coef
    mask = row_ok[:, None] & col_ok[None, :]
    tl.store(G_OUT + rows[:, None] * V + cols[None, :], grad.to(G_OUT.dtype.element_ty), mask=mask)


def vocab_splits(n: int, v: int, sms: int, block_n: int = BLOCK_N, block_v: int = V_ROUND) -> tuple[int, int]:
    """(splits, columns per split) of the forward grid: cdiv(n, block_n) row blocks x splits programs.

    splits = min(cdiv(PROGRAMS_PER_SM * sms, row blocks), cdiv(v, block_v)), then each split takes
    V_SPLIT = block_v * cdiv(cdiv(v, splits), block_v) columns (a whole number of tiles) and the count is
    recomputed as cdiv(v, V_SPLIT), so that no split is empty. E.g. on an H200 (132 SMs), V=151936, BLOCK_N=128:
    at N=2048 16 row blocks x 17 splits = 272 programs; at N=16384: 128 x 3."""
    row_blocks = triton.cdiv(n, block_n)
    splits = max(1, min(triton.cdiv(PROGRAMS_PER_SM * sms, row_blocks), triton.cdiv(v, block_v)))
    v_split = block_v * triton.cdiv(triton.cdiv(v, splits), block_v)
    return triton.cdiv(v, v_split), v_split


def merge_partials(
    m: torch.Tensor, s: torch.Tensor, z_y: torch.Tensor, ez: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(logp, lse, entropy or None) [N] from per-split partials [splits, N] (each split non-empty):

    M = max_k m_k,  c_k = exp(m_k - M),  S = sum_k c_k s_k,  lse = M + log S,
    logp = sum_k z_y,k - lse (exactly one split holds the target),  entropy = lse - (sum_k c_k ez_k) / S."""
    top = m.amax(0)
    c = torch.exp(m - top)
    total = (c * s).sum(0)
    lse = top + torch.log(total)
    ent = None if ez is None else lse - (c * ez).sum(0) / total
    return z_y.sum(0) - lse, lse, ent


def backward_chunk_rows(n: int, v: int, itemsize: int, budget: int | None = None, block_n: int = BLOCK_N) -> int:
    """Rows per backward chunk: the most whole BLOCK_N blocks whose [rows, v] G fits ``budget`` bytes
    (default G_BUDGET_BYTES), at least one block, at most all of n. E.g. V=151936 in bf16: 3456 rows (BLOCK_N=128)."""
    rows = max(block_n, (budget or G_BUDGET_BYTES) // (v * itemsize) // block_n * block_n)
    return min(rows, block_n * triton.cdiv(n, block_n))


def _grad_grid(n: int, v: int):
    """The backward kernel's 1-D grid for the autotuned BLOCK_V: every (row block, vocabulary tile) program."""
    return lambda meta: (triton.cdiv(n, BLOCK_N) * triton.cdiv(v, meta["BLOCK_V"]),)


def _sm_count(device: torch.device) -> int:
    """The device's SM count; 2 under the interpreter (so that the tests' small N still splits the vocabulary)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 2


def _dot_args(dtype: torch.dtype) -> dict:
    dot = torch.float32 if INTERPRET else dtype
    return {"DOT_DTYPE": _TL_DTYPES[dot], "IEEE": dot == torch.float32}


def _check_device(hidden: torch.Tensor) -> None:
    if not hidden.is_cuda and not INTERPRET:
        raise ValueError(
            f"the Triton log-prob kernel needs CUDA tensors (got {hidden.device}); on CPU use impl='chunked' "
            "(grpo.logprob_impl: chunked or auto), or set TRITON_INTERPRET=1 before triton is imported (tests)"
        )


def token_logprobs_forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    inv_t: float,
    entropy: bool,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Launch the forward kernel and merge its splits: logp, lse, entropy (or None), float32 [N]."""
    _check_device(hidden)
    n, d = hidden.shape
    v = weight.shape[0]
    splits, v_split = vocab_splits(n, v, _sm_count(hidden.device))
    parts = torch.empty(4 if entropy else 3, splits, n, device=hidden.device, dtype=torch.float32)
    launch(
        _forward_kernel, (triton.cdiv(n, BLOCK_N) * splits,), hidden.device,
        hidden, weight, weight if bias is None else bias, targets, parts[0], parts[1], parts[2], parts[-1],
        n, v, d, v_split, hidden.stride(0), weight.stride(0), inv_t,
        HAS_BIAS=bias is not None, ENTROPY=entropy, **_dot_args(dtype), BLOCK_N=BLOCK_N, GROUP_N=GROUP_N,
    )  # fmt: skip
    return merge_partials(parts[0], parts[1], parts[2], parts[3] if entropy else None)


def token_logprobs_backward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    lse: torch.Tensor,
    g_t: torch.Tensor,
    inv_t: float,
    dtype: torch.dtype,
    need: tuple[bool, bool, bool],
    ent: torch.Tensor | None = None,
    ge_t: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """dH (hidden's dtype), dW and db (float32) for upstream g_t = g / T; ``need`` = (dH, dW, db) wanted.

    With ``ent`` (H [N]) and ``ge_t`` (its upstream gradient over T [N]) the entropy's gradient is added."""
    ent_grad = ent is not None and ge_t is not None
    n, d = hidden.shape
    v = weight.shape[0]
    w_c = weight.to(dtype)  # the GEMM operand: no copy when the head is already in the compute dtype
    dh = torch.empty_like(hidden) if need[0] else None
    dw = torch.zeros(v, d, device=weight.device, dtype=torch.float32) if need[1] else None
    db = torch.zeros(v, device=weight.device, dtype=torch.float32) if need[2] else None
    rows = backward_chunk_rows(n, v, torch.empty((), dtype=dtype).element_size())
    g_buf = torch.empty(min(rows, n) * v, device=hidden.device, dtype=dtype)
    for r0 in range(0, n, rows):
        r1 = min(r0 + rows, n)
        g = g_buf[: (r1 - r0) * v].view(r1 - r0, v)
        h = hidden[r0:r1]
        grid = _grad_grid(r1 - r0, v)
        launch(
            _grad_logits_kernel, grid, hidden.device,
            h, weight, weight if bias is None else bias, targets[r0:r1], lse[r0:r1], g_t[r0:r1],
            ent[r0:r1] if ent_grad else lse[r0:r1], ge_t[r0:r1] if ent_grad else g_t[r0:r1], g,
            r1 - r0, v, d, hidden.stride(0), weight.stride(0), inv_t,
            HAS_BIAS=bias is not None, ENT_GRAD=ent_grad, **_dot_args(dtype), BLOCK_N=BLOCK_N, GROUP_N=GROUP_N,
        )  # fmt: skip
        if dh is not None:
            mm_into(dh[r0:r1], g, w_c)
        if dw is not None:
            addmm_fp32(dw, g.t(), h.to(dtype))
        if db is not None:
            db += g.sum(0, dtype=torch.float32)
    return dh, dw, db


class TritonTokenLogProbs(torch.autograd.Function):
    """(logp [N], entropy [N] or None) of hidden [N, D], weight [V, D], bias [V] or None, targets [N].

    Inputs contiguous; ``dtype`` is the compute dtype (kernels/precision.py): tiles are cast to it on load,
    so a float32 head is never copied in the forward. Gradients flow to logp, and to the entropy with
    ``entropy_grad`` (the entropy bonus; else it is marked non-differentiable). Gradients take their input's
    dtype (dW of a float32 master weight stays float32)."""

    @staticmethod
    def forward(
        ctx, hidden, weight, bias, targets, temperature: float, compute_entropy: bool, dtype: torch.dtype,
        entropy_grad: bool = False,
    ):  # fmt: skip
        inv_t = 1.0 / temperature
        args = (inv_t, compute_entropy or entropy_grad, dtype)
        logp, lse, ent = token_logprobs_forward(hidden, weight, bias, targets, *args)
        ctx.save_for_backward(hidden, weight, bias, targets, lse, ent.contiguous() if entropy_grad else None)
        ctx.inv_t, ctx.dtype = inv_t, dtype
        if ent is not None and not entropy_grad:
            ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, grad_logp: torch.Tensor, grad_entropy: torch.Tensor | None):
        hidden, weight, bias, targets, lse, ent = ctx.saved_tensors
        need = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2])
        if not any(need):
            return (None,) * 8
        g_t = grad_logp.float().contiguous() * ctx.inv_t
        ge_t = None if ent is None or grad_entropy is None else grad_entropy.float().contiguous() * ctx.inv_t
        dh, dw, db = token_logprobs_backward(
            hidden, weight, bias, targets, lse, g_t, ctx.inv_t, ctx.dtype, need, ent=ent, ge_t=ge_t
        )
        dw = None if dw is None else dw.to(weight.dtype)
        db = None if db is None else db.to(bias.dtype)
        return dh, dw, db, None, None, None, None, None
