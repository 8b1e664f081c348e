"""grpoflow.kernels.token_logprobs: the chunked torch path and the Triton kernel (TRITON_INTERPRET=1 on CPU) against the
naive float32 reference (materialized logits + log_softmax), values and gradients."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from grpoflow.kernels.logprobs import token_logprobs


def make_inputs(n, d, v, *, bias=False, head_trainable=False, dtype=torch.float32, seed=0):
    """H [n, d], W [v, d] (logits of a few nats), b [v] or None, y [n], upstream grad g [n] (0 on every third row)."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(v, d, generator=g) * 2 / d**0.5).to(dtype).requires_grad_(head_trainable)
    b = torch.randn(v, generator=g).to(dtype).requires_grad_(head_trainable) if bias else None
    y = torch.randint(0, v, (n,), generator=g)
    up = torch.randn(n, generator=g)
    up[::3] = 0.0  # masked rows: no upstream gradient
    return h, w, b, y, up


def run(impl, h, w, b, y, temperature, up, **kwargs):
    """logp, entropy, and the gradients of sum(up * logp) w.r.t. whichever of H, W, b require grad."""
    logp, ent = token_logprobs(h, w, y, temperature, b, compute_entropy=True, impl=impl, **kwargs)
    params = [t for t in (h, w, b) if t is not None and t.requires_grad]
    return logp, ent, torch.autograd.grad((logp * up).sum(), params)


def assert_matches_reference(impl, inputs, temperature, atol=2e-5, rtol=1e-4, grad_atol=2e-5, **kwargs):
    h, w, b, y, up = inputs
    logp, ent, grads = run(impl, h, w, b, y, temperature, up, **kwargs)
    ref = [t.detach().float().requires_grad_(t.requires_grad) if t is not None else None for t in (h, w, b)]
    rlogp, rent, rgrads = run("reference", *ref[:3], y, temperature, up)
    assert logp.dtype == ent.dtype == torch.float32
    torch.testing.assert_close(logp, rlogp, atol=atol, rtol=rtol)
    torch.testing.assert_close(ent, rent, atol=atol, rtol=rtol)
    assert not ent.requires_grad
    assert len(grads) == len(rgrads)
    for got, want in zip(grads, rgrads):
        assert got.dtype == h.dtype
        torch.testing.assert_close(got.float(), want, atol=grad_atol, rtol=rtol)


# Small tiles for the torch path, so that chunks and tiles have ragged ends; the Triton kernel has its fixed
# blocks (BLOCK_N=64, BLOCK_V=128, BLOCK_D=64), which N=70, V=300 and D=80 cross with ragged ends (and 2
# vocabulary splits under the interpreter: kernels/triton_logprobs.py counts 2 SMs there).
TILES = {"chunked": {"chunk_size": 16, "vocab_chunk_size": 64}, "triton": {}}


@pytest.fixture(params=["chunked", pytest.param("triton", marks=pytest.mark.triton_interpret)])
def impl(request):
    """The fused implementations; the Triton kernel runs under TRITON_INTERPRET=1 (about 1000x slower: small shapes)."""
    return request.param


@pytest.mark.parametrize("n, d, v", [(70, 80, 300), (33, 8, 97), (5, 24, 50)])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("head_trainable", [False, True])
def test_matches_reference(impl, n, d, v, temperature, bias, head_trainable):
    inputs = make_inputs(n, d, v, bias=bias, head_trainable=head_trainable)
    assert_matches_reference(impl, inputs, temperature, **TILES[impl])


def test_head_only_gradient(impl):
    """A frozen backbone (H without grad) and a trainable head: no J is kept, dW/db come from the backward pass."""
    h, w, b, y, up = make_inputs(70, 80, 300, bias=True, head_trainable=True)
    assert_matches_reference(impl, (h.detach(), w, b, y, up), 0.8, **TILES[impl])


def test_chunked_default_tiles_match_reference():
    inputs = make_inputs(300, 40, 5000, bias=True, head_trainable=True)
    assert_matches_reference("chunked", inputs, 0.9)


@pytest.mark.triton_interpret
def test_triton_matches_chunked_torch():
    h, w, b, y, up = make_inputs(70, 80, 300, bias=True, head_trainable=True)
    got = run("triton", h, w, b, y, 0.9, up)
    want = run("chunked", h, w, b, y, 0.9, up, **TILES["chunked"])
    for a, e in zip(got[:2] + got[2], want[:2] + want[2]):
        torch.testing.assert_close(a, e, atol=2e-5, rtol=1e-4)


def test_bf16_inputs_accumulate_in_float32(impl):
    """Tolerance: logp/entropy as in float32 (exact upcasts); gradients 1e-2 relative (J, dH, dW are bf16)."""
    inputs = make_inputs(70, 80, 300, bias=True, head_trainable=True, dtype=torch.bfloat16)
    assert_matches_reference(impl, inputs, 0.8, rtol=1e-2, grad_atol=1e-2, **TILES[impl])


def test_overflowing_tiles_are_redone_at_the_row_max():
    """Logits hundreds of nats above the target's (a large head at T=0.1) overflow the target-logit shift."""
    h, w, b, y, up = make_inputs(20, 16, 90, head_trainable=True)
    with torch.no_grad():
        w[60:] *= 30.0
    y = y % 60
    kwargs = {"chunk_size": 8, "vocab_chunk_size": 32}
    assert_matches_reference("chunked", (h, w, b, y, up), 0.1, atol=1e-3, grad_atol=1e-4, **kwargs)


@pytest.mark.parametrize("entropy", [False, True])
def test_no_grad_forward_matches_reference(impl, entropy):
    h, w, b, y, _ = make_inputs(30, 16, 70, bias=True)
    with torch.no_grad():
        logp, ent = token_logprobs(h, w, y, 0.9, b, compute_entropy=entropy, impl=impl, **TILES[impl])
        rlogp, rent = token_logprobs(h, w, y, 0.9, b, compute_entropy=True, impl="reference")
    torch.testing.assert_close(logp, rlogp)
    if entropy:
        torch.testing.assert_close(ent, rent)
    else:
        assert ent is None


def test_leading_dims_are_kept_and_auto_is_chunked_on_cpu():
    h, w, _, y, _ = make_inputs(6, 8, 20)
    h3, y3 = h.detach().view(2, 3, 8), y.view(2, 3)
    logp, ent = token_logprobs(h3, w, y3)
    assert logp.shape == (2, 3) and ent is None and (logp <= 0).all()
    torch.testing.assert_close(logp, token_logprobs(h3, w, y3, impl="chunked")[0], rtol=0, atol=0)
    torch.testing.assert_close(logp, token_logprobs(h3, w, y3, impl="reference")[0])


def test_bad_impl_and_triton_on_cpu_fail_clearly(monkeypatch):
    from grpoflow.kernels import triton_logprobs

    h, w, _, y, _ = make_inputs(4, 8, 20)
    with pytest.raises(ValueError, match="impl='fast'"):
        token_logprobs(h, w, y, impl="fast")
    monkeypatch.setattr(triton_logprobs, "INTERPRET", False)  # whichever way this session imported it
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        token_logprobs(h, w, y, impl="triton")


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="this session runs them itself")
def test_triton_cases_pass_under_the_interpreter():
    """The ``triton_interpret`` tests of tests/kernels, in a pytest process started with TRITON_INTERPRET=1."""
    root = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "triton_interpret", "tests/kernels"]
    # the interpreter's tl.dot is numpy's matmul: on blocks this small, BLAS threads only spin
    env = {**os.environ, "TRITON_INTERPRET": "1", "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
    assert " passed" in out.stdout and "skipped" not in out.stdout, out.stdout[-2000:]
