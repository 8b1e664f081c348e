import pytest
import torch

from kernels.logprobs import token_logprobs, token_logprobs_reference


@pytest.mark.parametrize("n, d, v, chunk", [(7, 16, 50, 3), (32, 8, 97, 1024), (5, 4, 11, 1)])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("with_bias", [False, True])
def test_chunked_matches_reference_values_and_grads(n, d, v, chunk, temperature, with_bias):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(n, d, generator=g, requires_grad=True)
    w = torch.randn(v, d, generator=g, requires_grad=True)
    b = torch.randn(v, generator=g, requires_grad=True) if with_bias else None
    y = torch.randint(0, v, (n,), generator=g)

    lp, ent = token_logprobs(h, w, y, temperature, b, compute_entropy=True, chunk_size=chunk)
    rlp, rent = token_logprobs_reference(h, w, y, temperature, b)
    torch.testing.assert_close(lp, rlp)
    torch.testing.assert_close(ent, rent)

    upstream = torch.randn(n, generator=g)
    params = [h, w] + ([b] if b is not None else [])
    grads = torch.autograd.grad((lp * upstream).sum() + ent.sum(), params)
    ref_grads = torch.autograd.grad((rlp * upstream).sum() + rent.sum(), params)
    for a, r in zip(grads, ref_grads):
        torch.testing.assert_close(a, r, rtol=1e-4, atol=1e-5)


def test_shapes_are_kept_and_bf16_accumulates_in_float32():
    g = torch.Generator().manual_seed(1)
    h = torch.randn(2, 3, 8, generator=g).bfloat16()
    w = torch.randn(20, 8, generator=g).bfloat16()
    y = torch.randint(0, 20, (2, 3), generator=g)
    lp, ent = token_logprobs(h, w, y)
    assert lp.shape == (2, 3) and ent is None and lp.dtype == torch.float32
    ref, _ = token_logprobs_reference(h.float(), w.float(), y)
    torch.testing.assert_close(lp, ref)
    assert (lp <= 0).all()
