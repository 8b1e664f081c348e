"""Per-token log-probabilities (and entropy) of chosen tokens, from hidden states and the lm_head.

    z = (H W^T + b) / T                                   # [N, V], never built whole by the fused paths
    logp[n] = z[n, y_n] - logsumexp(z[n])
    entropy[n] = logsumexp(z[n]) - sum_v softmax(z[n])_v z[n, v]

:func:`token_logprobs` is the entry point the trainer uses. One function, three implementations of
the same math, chosen by ``impl``:

- ``"triton"`` (kernels/triton_logprobs.py): the fused kernel, tiled over rows, vocabulary and D;
- ``"chunked"`` (kernels/chunked_logprobs.py): the same algorithm in chunked torch, for CPUs;
- ``"reference"``: :func:`token_logprobs_reference`, materialized logits + log_softmax (tests, benchmarks);
- ``"auto"`` (default): triton for CUDA tensors, chunked otherwise.

The fused paths stream over the vocabulary in tiles, accumulating the logsumexp tile by tile, and never
hold more than one [rows, vocab tile] block of logits, in forward or backward. Their forward keeps
J = W_y - softmax(z) W [N, D] when H needs a gradient, so that backward is dH = (g / T) J; dW and db
are computed (by recomputing tiles) only when the head is trainable. The entropy is returned without
a gradient (GRPO uses it as a metric and a mask, as TRL does). Arithmetic is float32 whatever the
input dtype; logp and entropy are float32, gradients take their input's dtype.
"""

from __future__ import annotations

import torch

from grpoflow.kernels.chunked_logprobs import ChunkedTokenLogProbs

IMPLS = ("auto", "triton", "chunked", "reference")


def token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    bias: torch.Tensor | None = None,
    *,
    compute_entropy: bool = False,
    impl: str = "auto",
    chunk_size: int = 1024,
    vocab_chunk_size: int = 8192,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(targets) [..] and optionally entropy [..] for hidden [.., D], weight [V, D], targets [..] in [0, V).

    ``chunk_size`` (rows) and ``vocab_chunk_size`` size the tiles of the torch path; the Triton kernel
    has its own block sizes.
    """
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r}: expected one of {IMPLS}")
    if impl == "auto":
        impl = "triton" if hidden.is_cuda else "chunked"
    shape = targets.shape
    h = hidden.reshape(-1, hidden.shape[-1])
    y = targets.reshape(-1)
    keep_j = torch.is_grad_enabled() and hidden.requires_grad
    if impl == "reference":
        logp, ent = token_logprobs_reference(h, weight, y, temperature, bias)
        ent = ent.detach() if compute_entropy else None
    elif impl == "chunked":
        args = (temperature, compute_entropy, keep_j, chunk_size, vocab_chunk_size)
        logp, ent = ChunkedTokenLogProbs.apply(h, weight, bias, y, *args)
    else:
        # Imported on first use: triton reads TRITON_INTERPRET when the kernels are defined.
        from grpoflow.kernels.triton_logprobs import TritonTokenLogProbs

        b = None if bias is None else bias.contiguous()
        args = (temperature, compute_entropy, keep_j)
        logp, ent = TritonTokenLogProbs.apply(h.contiguous(), weight.contiguous(), b, y.contiguous(), *args)
    return logp.reshape(shape), None if ent is None else ent.reshape(shape)


def token_logprobs_reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Naive reference: the full logits, log_softmax, gather. For tests and benchmarks only."""
    logits = hidden.float() @ weight.float().t()
    if bias is not None:
        logits = logits + bias.float()
    logits = logits / temperature
    logsm = torch.log_softmax(logits, dim=-1)
    logp = logsm.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ent = -(logsm.exp() * logsm).sum(-1)
    return logp, ent
