"""Per-token log-probabilities (and entropy) of chosen tokens, from hidden states and the lm_head.

    z = (H W^T + b) / T                                   # [N, V], never built whole by the fused paths
    logp[n] = z[n, y_n] - logsumexp(z[n])
    entropy[n] = logsumexp(z[n]) - sum_v softmax(z[n])_v z[n, v]

:func:`token_logprobs` is the entry point the trainer uses. One function, three implementations of
the same math, chosen by ``impl``:

- ``"triton"`` (kernels/triton_logprobs.py): the Triton kernels (split-vocabulary logsumexp forward; backward
  as a fused G = dlogp/dz kernel and two cuBLAS GEMMs); CUDA tensors (or TRITON_INTERPRET=1 in tests);
- ``"chunked"``: chunked torch. On CPU kernels/chunked_logprobs.py (float32 arithmetic, tuned for CPUs); on
  other devices kernels/chunked_dtype.py (GEMMs in the compute dtype, float32 accumulation);
  Both chunked paths take a frozen-head route when the head (weight, bias) needs no gradient and hidden does
  (LoRA): the forward keeps J = W_y - E_p[W] [N, D] (and the entropy's J_H with ``entropy_grad``) and the
  backward is dH = (g J + g_H J_H) / T, a row scale: ~4NVD FLOPs in all for logp instead of 6NVD;
- ``"reference"``: :func:`token_logprobs_reference`, materialized logits + log_softmax (tests, benchmarks);
- ``"auto"`` (default): chunked for CPU tensors, and for any tensors when triton is not installed (it is a Linux-only
  dependency); for CUDA tensors the faster of triton and chunked at the call's
  shape, from a table of measured shapes (kernels/auto_table.py: the table the GPU check writes when
  ``GRPOFLOW_AUTO_TABLE`` names it, else the default shipped, which picks chunked everywhere until a device measured
  one). The table keys on (N, D, V, compute dtype, frozen or trainable head) and on the pass: a no-grad forward
  (old and reference log-probs) or a training forward + backward.

The compute dtype follows kernels/precision.py: under torch autocast on CUDA the autocast dtype (bf16
operands, float32 accumulation), else hidden's dtype on CUDA; the CPU path computes in float32 as before.
No path holds more than one chunk of the [N, V] logits. The entropy comes from the same pass over the vocabulary
as the logsumexp (running max m, s = sum e^(z-m), sum e^(z-m) z). By default it is returned without a gradient
(GRPO uses it as a metric and a mask, as TRL does); ``entropy_grad=True`` (the entropy bonus) gives it one,
dH/dz_v = -p_v (log p_v + H), formed tile by tile in the backward pass with the log-prob's (kernels/logit_grad.py).
:func:`label_nll` is the SFT loss (summed cross-entropy of labels, ignored positions skipped) on the same kernels.
logp and entropy are float32; gradients take their input's dtype. The GRPO config key grpo.logprob_impl
(auto | triton | chunked) picks ``impl`` for the trainer.
"""

from __future__ import annotations

import torch

from grpoflow.kernels.auto_table import choose
from grpoflow.kernels.chunked_dtype import ChunkedDtypeTokenLogProbs
from grpoflow.kernels.chunked_logprobs import ChunkedTokenLogProbs
from grpoflow.kernels.precision import active_autocast_dtype, kernel_dtype
from grpoflow.kernels.tile_state import MAX_FUSED_COLS
from grpoflow.kernels.tiles import triton_available

IMPLS = ("auto", "triton", "chunked", "reference")
CPU_VOCAB_CHUNK = 8192  # the CPU path's vocabulary tile (benchmarks/bench_logprob_chunks.py)
DTYPE_VOCAB_CHUNK = MAX_FUSED_COLS  # the 16-bit path's: the widest tile the fused fold takes


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
    vocab_chunk_size: int | None = None,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(targets) [..] and optionally entropy [..] for hidden [.., D], weight [V, D], targets [..] in [0, V).

    ``chunk_size`` (rows) and ``vocab_chunk_size`` size the tiles of the chunked paths; the Triton kernel
    has its own block sizes. ``vocab_chunk_size`` None: 8192 on the CPU path (CPU_VOCAB_CHUNK); 16384 on the 16-bit
    path (DTYPE_VOCAB_CHUNK, the widest tile kernels/triton_tiles.py folds: its [rows, D] accumulators are rescaled
    once per tile, 16 D / vocab_chunk_size bytes per logit, docs/kernel-roofline.md).
    ``entropy_grad`` implies ``compute_entropy`` and makes the entropy differentiable.
    """
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r}: expected one of {IMPLS}")
    shape = targets.shape
    h = hidden.reshape(-1, hidden.shape[-1])
    y = targets.reshape(-1)
    dtype = kernel_dtype(hidden.device.type, hidden.dtype, active_autocast_dtype(hidden.device.type))
    if impl == "auto":
        impl = auto_impl(h, weight, dtype or hidden.dtype)
    if impl == "reference":
        logp, ent = token_logprobs_reference(h, weight, y, temperature, bias)
        ent = ent if entropy_grad else ent.detach() if compute_entropy else None
    elif impl == "chunked" and dtype is None:  # CPU: the float32 path, unchanged
        keep_j = torch.is_grad_enabled() and hidden.requires_grad
        args = (temperature, compute_entropy, keep_j, chunk_size, vocab_chunk_size or CPU_VOCAB_CHUNK, entropy_grad)
        logp, ent = ChunkedTokenLogProbs.apply(h, weight, bias, y, *args)
    elif impl == "chunked":
        keep_j = torch.is_grad_enabled() and hidden.requires_grad
        vocab_chunk = vocab_chunk_size or DTYPE_VOCAB_CHUNK
        args = (temperature, compute_entropy, dtype, chunk_size, vocab_chunk, entropy_grad, keep_j)
        logp, ent = ChunkedDtypeTokenLogProbs.apply(h, weight, bias, y, *args)
    else:
        # Imported on first use: triton reads TRITON_INTERPRET when the kernels are defined.
        try:
            from grpoflow.kernels.triton_logprobs import TritonTokenLogProbs
        except ImportError as e:
            if e.name is None or e.name.partition(".")[0] != "triton":
                raise
            raise ImportError(
                "impl='triton' needs the triton package, which is not installed (pyproject installs it on Linux "
                "only); use impl='chunked' or 'auto' (grpo.logprob_impl: chunked or auto)",
                name="triton",
            ) from e

        b = None if bias is None else bias.contiguous()
        args = (temperature, compute_entropy, dtype or hidden.dtype, entropy_grad)
        logp, ent = TritonTokenLogProbs.apply(h.contiguous(), weight.contiguous(), b, y.contiguous(), *args)
    return logp.reshape(shape), None if ent is None else ent.reshape(shape)


def auto_impl(hidden: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> str:
    """What ``impl="auto"`` runs for hidden [N, D] and weight [V, D] computing in ``dtype``: chunked off CUDA or
    without triton; on CUDA the table's choice (kernels/auto_table.py) for this shape, dtype, head (trainable when
    the weight needs a gradient) and pass (forward + backward when autograd will differentiate the result)."""
    grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    n, d = hidden.shape
    head = "trainable" if weight.requires_grad else "frozen"
    return route(hidden.is_cuda, triton_available(), n, d, weight.shape[0], dtype, head, "fwd_bwd" if grad else "fwd")


def route(cuda: bool, has_triton: bool, n: int, d: int, v: int, dtype: torch.dtype, head: str, mode: str) -> str:
    """``auto``'s decision from plain facts (so it is testable without a GPU): "chunked" off CUDA (``cuda``
    false) or when triton is not installed (``has_triton`` false), else the table's choice for the shape."""
    if not cuda or not has_triton:
        return "chunked"
    return choose(n, d, v, str(dtype).removeprefix("torch."), head, mode)


def label_nll(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    impl: str = "auto",
) -> torch.Tensor:
    """Summed next-token cross-entropy of ``labels`` [..] under logits hidden [.., D] W^T + b, through the fused
    kernels: the [tokens, V] logits are never built.

        loss = sum_{n : labels_n != ignore_index} -log p(labels_n | hidden_n) = -sum_n logp_n   (a float32 scalar)

    Positions labelled ``ignore_index`` are dropped before the kernel (neither computed nor given a gradient);
    with none left the loss is a 0 that still depends on ``hidden`` and ``weight`` (so backward runs)."""
    keep = labels != ignore_index
    h = hidden[keep]
    if h.shape[0] == 0:
        return (hidden.sum() * 0.0 + weight.sum() * 0.0).float()
    logp, _ = token_logprobs(h, weight, labels[keep], 1.0, bias, impl=impl)
    return -logp.sum()


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
