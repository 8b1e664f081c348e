"""Per-token log-probabilities (and entropy) of chosen tokens, from hidden states and lm_head.

    logits = H @ W^T (+ b), scaled by 1/temperature           # [N, V], never built whole here
    logp[n] = logits[n, y_n] - logsumexp(logits[n, :])
    entropy[n] = logsumexp(logits[n]) - sum_v softmax(logits[n])_v * logits[n, v]

:func:`token_logprobs` is the entry point the trainer uses. On CPU it runs the rows in chunks,
each under activation checkpointing, so peak memory holds one chunk of logits in forward and
in backward (recomputed). The Triton kernel that also tiles the vocabulary is the kernels
issue; :func:`token_logprobs_reference` (materialized logits + log_softmax) is for tests.
All arithmetic is done in float32 whatever the input dtype.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint


def _chunk(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, y: torch.Tensor, inv_t: float, entropy: bool):
    logits = h.float() @ w.float().t()  # [n, V]
    if b is not None:
        logits = logits + b.float()
    logits = logits * inv_t
    lse = torch.logsumexp(logits, dim=-1)  # [n]
    logp = logits.gather(-1, y.unsqueeze(-1)).squeeze(-1) - lse
    if not entropy:
        return logp, None
    probs = torch.softmax(logits, dim=-1)
    ent = lse - (probs * logits).sum(-1)
    return logp, ent


def token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    bias: torch.Tensor | None = None,
    *,
    compute_entropy: bool = False,
    chunk_size: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(targets) [..] and optionally entropy [..] for hidden [.., D], weight [V, D], targets [..]."""
    shape = targets.shape
    h = hidden.reshape(-1, hidden.shape[-1])
    y = targets.reshape(-1)
    inv_t = 1.0 / temperature
    need_grad = torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)
    logps, ents = [], []
    for start in range(0, h.shape[0], chunk_size):
        args = (h[start : start + chunk_size], weight, bias, y[start : start + chunk_size], inv_t, compute_entropy)
        if need_grad:
            lp, ent = checkpoint(_chunk, *args, use_reentrant=False)
        else:
            lp, ent = _chunk(*args)
        logps.append(lp)
        if compute_entropy:
            ents.append(ent)
    logp = torch.cat(logps).reshape(shape)
    ent = torch.cat(ents).reshape(shape) if compute_entropy else None
    return logp, ent


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
