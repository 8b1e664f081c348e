"""Issue 41 item 3, the chunked half: a frozen head (W and b without gradient, H with: the LoRA case) keeps
J = W_y - E_p[W] (and with the entropy's gradient J_H = -sum_v p_v (log p_v + H) W_v) from the forward, so that
the backward is dH = (g J + g_H J_H) / T, a row scale with no GEMM over the vocabulary. Both chunked paths (the
CPU float32 path and the 16-bit path impl "chunked" takes on CUDA, run here on CPU tensors) against the float32
reference, every dtype, with and without the entropy's gradient, T != 1, with and without a bias."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from grpoflow.kernels.chunked_dtype import ChunkedDtypeTokenLogProbs
from grpoflow.kernels.logprobs import token_logprobs, token_logprobs_reference
from tests.kernels.test_entropy_grad import entropy_up
from tests.kernels.test_logprob_precision import TOL
from tests.kernels.test_logprobs import make_inputs

MATMULS = {"mm", "addmm", "addmm_", "bmm", "baddbmm", "baddbmm_", "matmul", "mv", "addmv", "addmv_", "dot", "linear"}
ROWS, COLS = 16, 64  # ragged tiles at N=70, V=300


class CountMatmuls(TorchDispatchMode):
    """Records the name of every matrix product dispatched while active."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in MATMULS:
            self.calls.append(name)
        return func(*args, **(kwargs or {}))


def forward(path, h, w, b, y, temperature, entropy_grad):
    """(logp, entropy) of the chunked CPU path (through token_logprobs) or the 16-bit path in h's dtype (told the
    grad mode, as token_logprobs tells it)."""
    if path == "cpu":
        kwargs = {"chunk_size": ROWS, "vocab_chunk_size": COLS}
        return token_logprobs(h, w, y, temperature, b, compute_entropy=True, entropy_grad=entropy_grad, **kwargs)
    keep_j = torch.is_grad_enabled()
    return ChunkedDtypeTokenLogProbs.apply(h, w, b, y, temperature, True, h.dtype, ROWS, COLS, entropy_grad, keep_j)


def loss_of(logp, ent, up, up_ent):
    return (logp * up).sum() + ((ent * up_ent).sum() if up_ent is not None else 0.0)


@pytest.fixture(params=["cpu", "dtype"])
def path(request):
    return request.param


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("entropy_grad", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_frozen_head_values_and_dh_match_reference(path, dtype, entropy_grad, bias):
    h, w, b, y, up = make_inputs(70, 80, 300, bias=bias, dtype=dtype)
    up_ent = entropy_up(70) if entropy_grad else None
    logp, ent = forward(path, h, w, b, y, 0.7, entropy_grad)
    (dh,) = torch.autograd.grad(loss_of(logp, ent, up, up_ent), [h])
    rh = h.detach().float().requires_grad_()
    rw, rb = w.float(), None if b is None else b.float()
    rlogp, rent = token_logprobs_reference(rh, rw, y, 0.7, rb)
    (rdh,) = torch.autograd.grad(loss_of(rlogp, rent, up, up_ent), [rh])
    tol = TOL[dtype]
    assert logp.dtype == ent.dtype == torch.float32 and ent.requires_grad == entropy_grad
    torch.testing.assert_close(logp, rlogp, atol=tol["atol"], rtol=tol["rtol"])
    torch.testing.assert_close(ent, rent, atol=tol["atol"], rtol=tol["rtol"])
    assert dh.dtype == dtype
    torch.testing.assert_close(dh.float(), rdh, atol=tol["grad_atol"], rtol=tol["rtol"])


@pytest.mark.parametrize("entropy_grad", [False, True])
def test_frozen_head_backward_runs_no_matmul(path, entropy_grad):
    """The backward of the frozen path dispatches no matrix product at all; the trainable head's does (so the counter
    sees the GEMMs it is meant to see)."""
    up_ent = entropy_up(70) if entropy_grad else None
    for trainable, want_none in ((False, True), (True, False)):
        h, w, b, y, up = make_inputs(70, 80, 300, bias=True, head_trainable=trainable)
        logp, ent = forward(path, h, w, b, y, 0.7, entropy_grad)
        loss = loss_of(logp, ent, up, up_ent)
        with CountMatmuls() as counted:
            torch.autograd.grad(loss, [h])
        assert (counted.calls == []) == want_none, counted.calls


@pytest.mark.parametrize("entropy_grad", [False, True])
def test_frozen_dtype_path_saves_only_j(entropy_grad):
    """What the frozen 16-bit path keeps for backward: J (and J_H), each [N, D] like H; not H, W or any [N, V]."""
    h, w, b, y, _ = make_inputs(70, 80, 300, bias=True)
    logp, _ = forward("dtype", h, w, b, y, 0.7, entropy_grad)
    shapes = [tuple(t.shape) for t in logp.grad_fn.saved_tensors if t is not None]
    assert shapes == [(70, 80)] * (2 if entropy_grad else 1)


def test_frozen_dtype_forward_costs_two_gemms_per_tile_and_one_without_grad():
    """Per [16, 64] tile: logits and e W (the frozen path); under no_grad the logits alone (J is not formed)."""
    tiles = 5 * 5  # ceil(70 / 16) row chunks x ceil(300 / 64) vocabulary tiles
    h, w, b, y, _ = make_inputs(70, 80, 300, bias=True)
    with CountMatmuls() as counted:
        forward("dtype", h, w, b, y, 0.7, False)
    assert len(counted.calls) == 2 * tiles
    with torch.no_grad(), CountMatmuls() as counted:
        forward("dtype", h, w, b, y, 0.7, False)
    assert len(counted.calls) == tiles


def test_frozen_cpu_path_entropy_gradient_survives_overflowing_rows():
    """Logits hundreds of nats above the target's (a large head at T=0.1): the redone rows carry J_H too."""
    h, w, _, y, up = make_inputs(20, 16, 90)
    with torch.no_grad():
        w[60:] *= 30.0
    y = y % 60
    up_ent = entropy_up(20)
    logp, ent = token_logprobs(h, w, y, 0.1, entropy_grad=True, chunk_size=8, vocab_chunk_size=32)
    (dh,) = torch.autograd.grad(loss_of(logp, ent, up, up_ent), [h])
    rh = h.detach().requires_grad_()
    rlogp, rent = token_logprobs_reference(rh, w, y, 0.1)
    (rdh,) = torch.autograd.grad(loss_of(rlogp, rent, up, up_ent), [rh])
    torch.testing.assert_close(logp, rlogp, atol=1e-3, rtol=1e-4)
    torch.testing.assert_close(ent, rent, atol=1e-3, rtol=1e-4)
    # dH runs to ~450 here (|W| ~ 15 at T = 0.1): float32 rounding of J_H's E_p[(z - m) W] - E_p[z - m] E_p[W]
    # is ~3e-3 absolute against a float64 reference (the recomputing path errs ~7e-2 on the same rows)
    torch.testing.assert_close(dh, rdh, atol=2e-5 * rdh.abs().max().item(), rtol=1e-4)
