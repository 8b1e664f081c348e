"""Issue 41 item 2: the entropy's gradient inside the fused kernels (chunked CPU, chunked 16-bit, Triton under
TRITON_INTERPRET=1) and the SFT loss on them, against the float32 reference (materialized logits), values and
gradients of H and of W (frozen and trainable head), every dtype."""

import pytest
import torch

from grpoflow.kernels.chunked_dtype import ChunkedDtypeTokenLogProbs
from grpoflow.kernels.logit_grad import logit_grad
from grpoflow.kernels.logprobs import label_nll, token_logprobs, token_logprobs_reference
from tests.kernels.test_logprob_precision import TOL
from tests.kernels.test_logprobs import TILES, make_inputs


def entropy_up(n: int, seed: int = 1) -> torch.Tensor:
    """The entropy's upstream gradient [n] (a bonus coefficient over a mask: 0 on every fourth row)."""
    up = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    up[::4] = 0.0
    return up


def params_of(h, w, b):
    return [t for t in (h, w, b) if t is not None and t.requires_grad]


def loss_grads(logp, ent, up, up_ent, params):
    return torch.autograd.grad((logp * up).sum() + (ent * up_ent).sum(), params)


def reference(h, w, b, y, temperature, up, up_ent):
    """logp, entropy and gradients of sum(up logp + up_ent H) from float32 copies through the full logits."""
    ref = [t.detach().float().requires_grad_(t.requires_grad) if t is not None else None for t in (h, w, b)]
    logp, ent = token_logprobs_reference(ref[0], ref[1], y, temperature, ref[2])
    return logp, ent, loss_grads(logp, ent, up, up_ent, params_of(*ref))


def assert_close_to_reference(got, want, dtype, tol=None):
    tol = tol or TOL[dtype]
    (logp, ent, grads), (rlogp, rent, rgrads) = got, want
    assert logp.dtype == ent.dtype == torch.float32 and ent.requires_grad
    torch.testing.assert_close(logp, rlogp, atol=tol["atol"], rtol=tol["rtol"])
    torch.testing.assert_close(ent, rent, atol=tol["atol"], rtol=tol["rtol"])
    assert len(grads) == len(rgrads)
    for g, r in zip(grads, rgrads):
        assert g.dtype == dtype
        torch.testing.assert_close(g.float(), r, atol=tol["grad_atol"], rtol=tol["rtol"])


def fused(impl, h, w, b, y, temperature, up, up_ent, **kwargs):
    logp, ent = token_logprobs(h, w, y, temperature, b, impl=impl, entropy_grad=True, **kwargs)
    return logp, ent, loss_grads(logp, ent, up, up_ent, params_of(h, w, b))


def test_logit_grad_is_the_autograd_gradient_of_logp_and_entropy():
    """The pure tile formula against autograd through log_softmax, on a tile holding part of the vocabulary."""
    g = torch.Generator().manual_seed(3)
    z = (torch.randn(6, 40, generator=g) * 3).requires_grad_()
    y = torch.randint(0, 40, (6,), generator=g)
    up, up_ent = torch.randn(6, generator=g), torch.randn(6, generator=g)
    logsm = torch.log_softmax(z, -1)
    ent = -(logsm.exp() * logsm).sum(-1)
    loss = (logsm.gather(1, y[:, None])[:, 0] * up).sum() + (ent * up_ent).sum()
    (want,) = torch.autograd.grad(loss, z, retain_graph=True)
    lse = torch.logsumexp(z, -1).detach()
    tiles = [
        logit_grad(z.detach()[:, c0 : c0 + 16].clone(), lse, y - c0, up, ent.detach(), up_ent)
        for c0 in range(0, 40, 16)
    ]
    torch.testing.assert_close(torch.cat(tiles, 1), want, atol=1e-5, rtol=1e-5)
    # without the entropy's term: the log-prob's gradient alone
    (want_lp,) = torch.autograd.grad((logsm.gather(1, y[:, None])[:, 0] * up).sum(), z)
    torch.testing.assert_close(logit_grad(z.detach().clone(), lse, y, up), want_lp, atol=1e-5, rtol=1e-5)


@pytest.fixture(params=["chunked", pytest.param("triton", marks=pytest.mark.triton_interpret)])
def impl(request):
    return request.param


@pytest.mark.parametrize("head_trainable", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_entropy_gradient_matches_reference(impl, head_trainable, bias, temperature):
    """Ragged N=70, V=300, D=80 (tiles of 16 x 64 rows x columns in chunked torch; Triton's fixed blocks)."""
    h, w, b, y, up = make_inputs(70, 80, 300, bias=bias, head_trainable=head_trainable)
    up_ent = entropy_up(70)
    got = fused(impl, h, w, b, y, temperature, up, up_ent, **TILES[impl])
    assert_close_to_reference(got, reference(h, w, b, y, temperature, up, up_ent), torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_trainable", [False, True])
def test_entropy_gradient_16bit_inputs(impl, dtype, head_trainable):
    """16-bit hidden and head: the CPU chunked path computes in float32, the Triton path with 16-bit G."""
    h, w, b, y, up = make_inputs(70, 80, 300, bias=True, head_trainable=head_trainable, dtype=dtype)
    up_ent = entropy_up(70)
    got = fused(impl, h, w, b, y, 0.8, up, up_ent, **TILES[impl])
    assert_close_to_reference(got, reference(h, w, b, y, 0.8, up, up_ent), dtype)


def test_head_only_entropy_gradient(impl):
    """A frozen backbone (H without grad), a trainable head and bias: dW and db carry the entropy's term."""
    h, w, b, y, up = make_inputs(70, 80, 300, bias=True, head_trainable=True)
    h = h.detach()
    up_ent = entropy_up(70)
    got = fused(impl, h, w, b, y, 0.8, up, up_ent, **TILES[impl])
    assert_close_to_reference(got, reference(h, w, b, y, 0.8, up, up_ent), torch.float32)


def test_entropy_bonus_changes_the_gradient(impl):
    """The entropy's term is really there: with it the gradient differs from the log-prob's alone."""
    h, w, b, y, up = make_inputs(33, 8, 97, head_trainable=True)
    _, _, with_ent = fused(impl, h, w, b, y, 1.0, up, entropy_up(33), **TILES[impl])
    _, _, without = fused(impl, h, w, b, y, 1.0, up, torch.zeros(33), **TILES[impl])
    assert (with_ent[0] - without[0]).abs().max() > 1e-3
    assert (with_ent[1] - without[1]).abs().max() > 1e-3


def test_entropy_alone_has_a_gradient(impl):
    """Only the entropy used (no log-prob term): its gradient matches the reference's."""
    h, w, b, y, _ = make_inputs(33, 8, 97, head_trainable=True)
    up_ent = entropy_up(33)
    got = fused(impl, h, w, b, y, 0.9, torch.zeros(33), up_ent, **TILES[impl])
    logp, ent = token_logprobs(h, w, y, 0.9, impl=impl, entropy_grad=True, **TILES[impl])
    grads = torch.autograd.grad((ent * up_ent).sum(), [h, w])
    for g, r in zip(grads, got[2]):
        torch.testing.assert_close(g, r, atol=1e-6, rtol=1e-5)
    assert_close_to_reference(got, reference(h, w, b, y, 0.9, torch.zeros(33), up_ent), torch.float32)


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("head_trainable", [False, True])
def test_chunked_dtype_path_entropy_gradient(dtype, head_trainable):
    """The CUDA "chunked" path on CPU tensors: GEMMs and G in ``dtype``, float32 accumulation."""
    h, w, b, y, up = make_inputs(70, 80, 300, bias=True, head_trainable=head_trainable, dtype=dtype)
    up_ent = entropy_up(70)
    logp, ent = ChunkedDtypeTokenLogProbs.apply(h, w, b, y, 0.7, False, dtype, 16, 64, True)
    got = (logp, ent, loss_grads(logp, ent, up, up_ent, params_of(h, w, b)))
    assert_close_to_reference(got, reference(h, w, b, y, 0.7, up, up_ent), dtype)


def test_without_entropy_grad_the_entropy_stays_a_constant(impl):
    h, w, b, y, _ = make_inputs(33, 8, 97)
    _, ent = token_logprobs(h, w, y, 1.0, compute_entropy=True, impl=impl, **TILES[impl])
    assert not ent.requires_grad


def sft_reference(hidden, weight, bias, labels):
    """The SFT loss before: float32 logits of the labelled positions, cross_entropy summed."""
    keep = labels != -100
    logits = hidden[keep].float() @ weight.float().t() + (0.0 if bias is None else bias.float())
    return torch.nn.functional.cross_entropy(logits, labels[keep], reduction="sum")


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("head_trainable", [False, True])
def test_label_nll_is_the_cross_entropy_of_the_labelled_positions(impl, dtype, head_trainable):
    """[B=3, T=25] labels with ignored (-100) prompt positions and padding; gradients of H, W and b."""
    h, w, b, y, _ = make_inputs(75, 80, 300, bias=True, head_trainable=head_trainable, dtype=dtype)
    hidden = h.detach().view(3, 25, 80).requires_grad_()
    labels = y.view(3, 25).clone()
    labels[0, :10] = -100
    labels[1, 20:] = -100
    labels[2, ::3] = -100
    loss = label_nll(hidden, w, labels, b, impl=impl)
    params = params_of(hidden, w, b)
    grads = torch.autograd.grad(loss, params)
    ref_params = [p.detach().float().requires_grad_() for p in params]
    rw = ref_params[1] if head_trainable else w.detach().float()
    rb = ref_params[2] if head_trainable else b.detach().float()
    want = sft_reference(ref_params[0], rw, rb, labels)
    rgrads = torch.autograd.grad(want, ref_params)
    tol = TOL[dtype]
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, want, atol=1e-3, rtol=1e-5)
    for g, r, p in zip(grads, rgrads, params):
        assert g.dtype == p.dtype
        torch.testing.assert_close(g.float(), r, atol=tol["grad_atol"], rtol=tol["rtol"])
    assert grads[0][0, :9].abs().max() == 0  # ignored positions get no gradient


def test_label_nll_with_nothing_labelled_is_a_differentiable_zero():
    h, w, _, y, _ = make_inputs(5, 8, 20, head_trainable=True)
    loss = label_nll(h, w, torch.full_like(y, -100))
    loss.backward()
    assert loss.item() == 0.0 and h.grad.abs().max() == 0 and w.grad.abs().max() == 0
