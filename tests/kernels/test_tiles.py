"""What the 16-bit chunked path does with each logit tile (kernels/tiles.py): the Triton routes
(kernels/triton_tiles.py, taken on CUDA) against the torch ones: the forward's online-softmax fold tile after tile,
the backward's gradient tile, and the chunked path's forwards and backward through them against the float32
reference, every dtype. Then what the fusion is for: between a tile's GEMMs no torch op touches the [rows, cols]
tile (the kernels read it once and write their 16-bit result once), where the torch routes run about ten ops over
it."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from grpoflow.kernels.chunked_dtype import chunked_dtype_backward, chunked_dtype_forward, frozen_head_forward
from grpoflow.kernels.logprobs import token_logprobs_reference
from grpoflow.kernels.tile_state import Accumulators, FoldState, new_state
from grpoflow.kernels.tiles import fold_tile, fold_tile_torch, grad_tile, grad_tile_torch
from tests.kernels.test_entropy_grad import entropy_up
from tests.kernels.test_logprob_precision import TOL
from tests.kernels.test_logprobs import make_inputs

pytestmark = pytest.mark.triton_interpret
ROWS, COLS = 16, 64  # ragged tiles at N=70, V=300


def tiles(seed, rows=5, cols=(48, 37, 64)):
    """Raw logit tiles of growing scale (so the running max grows and the rescale matters) except on rows 0, 2 and 4
    (their max is in the first tile), targets spread over all tiles (and one row's target in none), a bias per
    tile."""
    g = torch.Generator().manual_seed(seed)
    us = [torch.randn(rows, c, generator=g) * (2.0 + 3 * i) for i, c in enumerate(cols)]
    bs = [torch.randn(c, generator=g) for c in cols]
    us[0][::2, 0] += 60.0  # rows 0, 2, 4 peak in the first tile: their max never grows after it
    y = torch.randint(0, sum(cols), (rows,), generator=g)
    y[-1] = sum(cols) + 5
    return us, bs, y, cols


def copy_state(state: FoldState) -> FoldState:
    return FoldState(*(None if t is None else t.clone() for t in state))


@pytest.mark.parametrize("e_dtype", [None, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("entropy", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_triton_fold_matches_the_torch_fold_tile_after_tile(e_dtype, entropy, bias):
    """Three tiles of growing scale (each row's max grows on some tiles and not on others); the state, r, δ, e,
    e (z - m') and the rescaled accumulators a, b (random, as after earlier GEMMs) agree tile after tile."""
    us, bs, y, cols = tiles(1)
    fused = new_state(5, entropy, torch.device("cpu"))
    plain = copy_state(fused)
    g = torch.Generator().manual_seed(2)
    acc_f = Accumulators(torch.zeros(5, 1500), torch.zeros(5, 1500) if entropy else None)  # D = 1500: 2 blocks
    acc_t = Accumulators(*(None if t is None else t.clone() for t in acc_f))
    grew = []
    c0 = 0
    for u, b, c in zip(us, bs, cols):
        args = (None if not bias else b, 0.7, y - c0)
        got = fold_tile(u.clone(), *args, fused, e_dtype, True, acc_f, fused=True)
        want = fold_tile_torch(u.clone(), *args, plain, e_dtype, True, acc_t)
        for name, a, w in zip(("r", "shift", "e", "ezm"), got, want):
            if name == "ezm" and not entropy or e_dtype is None and name in ("e", "ezm"):
                assert a is None and w is None, name
                continue
            assert a.dtype == w.dtype, name
            tol = {"atol": 1e-6, "rtol": 1e-5} if a.dtype == torch.float32 else {}
            torch.testing.assert_close(a, w, **tol, msg=name)
        for name, a, w in [*zip(FoldState._fields, fused, plain), *zip(("a", "b"), acc_f, acc_t)]:
            if w is None:
                assert a is None
                continue
            torch.testing.assert_close(a, w, atol=1e-5, rtol=1e-5, msg=name)
        grew.append(got.r < 1)
        for t in (t for t in acc_f if t is not None):  # what the tile's GEMMs would add: the next rescale's input
            t.add_(torch.randn(t.shape, generator=g))
        acc_t = Accumulators(*(None if t is None else t.clone() for t in acc_f))
        c0 += c
    assert torch.isfinite(fused.s).all() and (fused.z_y[:-1] != 0).all() and (fused.z_y[-1] == 0)
    grew = torch.stack(grew[1:])  # after the first tile: rows whose max grew and rows whose max stayed, both seen
    assert grew.any() and not grew.all(), grew


def test_triton_fold_refuses_a_tile_wider_than_a_row_of_registers():
    from grpoflow.kernels.tile_state import MAX_FUSED_COLS
    from grpoflow.kernels.triton_tiles import fold_tile_triton

    u = torch.zeros(1, MAX_FUSED_COLS + 1)
    with pytest.raises(ValueError, match=f"at most {MAX_FUSED_COLS} columns"):
        fold_tile_triton(u, None, 1.0, torch.zeros(1, dtype=torch.long), new_state(1, False, u.device), None)


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("bias", [False, True])
def test_forwards_through_the_triton_fold_match_the_reference(dtype, bias):
    """chunked_dtype_forward (no-grad passes, trainable head) and frozen_head_forward (with J and J_H) with
    ``fused=True``: logp, entropy and J/J_H against the float32 reference and the torch fold."""
    h, w, b, y, up = make_inputs(70, 80, 300, bias=bias, dtype=dtype)
    h = h.detach()
    rlogp, rent = token_logprobs_reference(h.float(), w.float(), y, 0.7, None if b is None else b.float())
    tol = TOL[dtype]
    logp, lse, ent = chunked_dtype_forward(h, w, b, y, 1 / 0.7, True, dtype, ROWS, COLS, fused=True)
    torch.testing.assert_close(logp, rlogp, atol=tol["atol"], rtol=tol["rtol"])
    torch.testing.assert_close(ent, rent, atol=tol["atol"], rtol=tol["rtol"])
    got = frozen_head_forward(h, w, b, y, 1 / 0.7, True, True, dtype, ROWS, COLS, fused=True)
    want = frozen_head_forward(h, w, b, y, 1 / 0.7, True, True, dtype, ROWS, COLS, fused=False)
    torch.testing.assert_close(got[0], rlogp, atol=tol["atol"], rtol=tol["rtol"])
    torch.testing.assert_close(got[2], rent, atol=tol["atol"], rtol=tol["rtol"])
    for name, a, e in zip(("J", "J_H"), got[3:], want[3:]):
        assert a.dtype == dtype, name
        torch.testing.assert_close(a.float(), e.float(), atol=tol["grad_atol"], rtol=tol["rtol"], msg=name)


# Ops that allocate or alias and move no data (the interpreter's launch wraps each argument in new_empty + set_).
NO_DATA = {"empty", "empty_strided", "new_empty", "set_", "detach", "alias", "view", "t", "transpose"}


class TileTouches(TorchDispatchMode):
    """Names of the torch ops that read or write a tensor with exactly ``numel`` elements (a whole tile)."""

    def __init__(self, numel):
        super().__init__()
        self.numel, self.ops = numel, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        flat = [*args, *(kwargs or {}).values(), *(out if isinstance(out, tuple | list) else (out,))]
        name = func.overloadpacket.__name__
        if name not in NO_DATA and any(isinstance(t, torch.Tensor) and t.numel() == self.numel for t in flat):
            self.ops.append(name)
        return out


@pytest.mark.parametrize("pass_", ["no_grad", "frozen", "frozen_jh", "backward"])
def test_only_the_gemms_touch_the_tile_when_fused(pass_):
    """One row chunk of 16 x one vocabulary tile of 64 (D = 80, so no [rows, D] tensor has the tile's size). Fused,
    the torch ops over the tile are the GEMM that writes it and, for a frozen head, the GEMMs that read e (and
    e (z - m)); the torch fold adds its ten elementwise passes and reductions on top (4 bytes read and written per
    element each, where the fused fold reads 4 and writes 2 once: docs/kernel-roofline.md)."""
    h, w, b, y, _ = make_inputs(16, 80, 64, bias=True)
    h = h.detach()
    counts = {}
    for fused in (True, False):
        with TileTouches(16 * 64) as seen:
            if pass_ == "no_grad":
                chunked_dtype_forward(h, w, b, y, 1 / 0.7, True, torch.float32, 16, 64, fused=fused)
            elif pass_ == "backward":
                lse, g_t = torch.full((16,), 5.0), torch.ones(16)
                args = (h, w.detach(), b.detach(), y, lse, g_t, 1 / 0.7, torch.float32, (True, True, True), 16, 64)
                chunked_dtype_backward(*args, fused=fused)
            else:
                keep_jh = pass_ == "frozen_jh"
                frozen_head_forward(h, w, b, y, 1 / 0.7, True, keep_jh, torch.float32, 16, 64, fused=fused)
        counts[fused] = seen.ops
    gemms = {
        "no_grad": ["mm"],
        "frozen": ["mm", "addmm_"],
        "frozen_jh": ["mm", "addmm_", "addmm_"],
        "backward": ["mm", "addmm_", "addmm_", "sum"],  # u; dH += G W, dW += G^T H, db = column sums of G
    }[pass_]
    assert sorted(counts[True]) == sorted(gemms), (counts[True], counts[False])
    assert len(counts[False]) >= len(gemms) + 5, counts[False]


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("ent_grad", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_triton_grad_tile_matches_the_torch_one(out_dtype, ent_grad, bias):
    """A tile of 5 rows x 1100 columns (two column blocks of the kernel, the second ragged); targets inside the
    tile, before it and after it; upstream gradients with zeros (masked rows)."""
    g = torch.Generator().manual_seed(3)
    u = torch.randn(5, 1100, generator=g) * 3
    b = torch.randn(1100, generator=g) if bias else None
    lse = torch.logsumexp(((u + (0 if b is None else b)) / 0.7), 1) + torch.rand(5, generator=g)  # a wider vocabulary
    y_local = torch.tensor([3, 1099, -4, 1500, 700])
    g_t = torch.randn(5, generator=g)
    g_t[1] = 0.0
    ent, ge_t = (torch.rand(5, generator=g) * 3, torch.randn(5, generator=g)) if ent_grad else (None, None)
    args = (b, 1 / 0.7, lse, y_local, g_t, ent, ge_t, out_dtype)
    got = grad_tile(u.clone(), *args, fused=True)
    want = grad_tile_torch(u.clone(), *args)
    assert got.dtype == want.dtype == out_dtype
    tol = {"atol": 1e-6, "rtol": 1e-5} if out_dtype == torch.float32 else {}
    torch.testing.assert_close(got, want, **tol)
    assert got[0, 3] > 0 or g_t[0] <= 0  # the target's onehot term is there


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("entropy_grad", [False, True])
def test_backward_through_the_triton_gradient_matches_the_reference(dtype, entropy_grad):
    """chunked_dtype_backward with ``fused=True``, a trainable head with a bias: dH, dW and db against the float32
    reference's gradients."""
    h, w, b, y, up = make_inputs(70, 80, 300, bias=True, head_trainable=True, dtype=dtype)
    up_ent = entropy_up(70) if entropy_grad else None
    inv_t = 1 / 0.7
    with torch.no_grad():
        _, lse, ent = chunked_dtype_forward(h, w, b, y, inv_t, True, dtype, ROWS, COLS, fused=True)
    ge_t = None if up_ent is None else up_ent * inv_t
    need = (True, True, True)
    args = (h.detach(), w.detach(), b.detach(), y, lse, up * inv_t, inv_t, dtype, need, ROWS, COLS)
    dh, dw, db = chunked_dtype_backward(*args, ent=ent if entropy_grad else None, ge_t=ge_t, fused=True)
    ref = [t.detach().float().requires_grad_() for t in (h, w, b)]
    rlogp, rent = token_logprobs_reference(ref[0], ref[1], y, 0.7, ref[2])
    loss = (rlogp * up).sum() + ((rent * up_ent).sum() if up_ent is not None else 0.0)
    rdh, rdw, rdb = torch.autograd.grad(loss, ref)
    tol = TOL[dtype]
    for name, got, want in (("dH", dh, rdh), ("dW", dw, rdw), ("db", db, rdb)):
        scale = want.abs().max()
        torch.testing.assert_close(got.float() / scale, want / scale, atol=tol["grad_atol"], rtol=0, msg=name)
