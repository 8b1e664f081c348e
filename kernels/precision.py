"""Which dtype the log-prob kernels compute in, and GEMMs that accumulate in float32 whatever their operands.

The rule (TRL 1.16 casts the same way in trl/kernels/chunked_logprob.py):

    compute dtype = autocast dtype      if torch autocast is enabled for the tensors' device type (CUDA)
                  = hidden's dtype      otherwise on CUDA (weight and bias are cast to it)
                  = None (no cast)      on CPU (and any non-CUDA device): the chunked CPU path computes in
                                        float32 whatever it receives

Under full fine-tuning in bf16 the head is a float32 master weight and the final RMSNorm returns float32
hidden states, so without the rule the kernels would run float32 ("ieee") dots where the rest of the
forward runs bf16 tensor-core GEMMs; with it they take bf16 operands and accumulate in float32.
"""

from __future__ import annotations

import torch

HALF = (torch.float16, torch.bfloat16)


def kernel_dtype(device_type: str, hidden_dtype: torch.dtype, autocast_dtype: torch.dtype | None) -> torch.dtype | None:
    """The dtype the kernel's inputs are cast to (None: leave them as they are).

    ``autocast_dtype`` is torch.get_autocast_dtype(device_type) when autocast is enabled for ``device_type``,
    else None (see :func:`active_autocast_dtype`)::

        cpu (any non-CUDA type)   -> None            (float32 arithmetic inside the CPU path, as before)
        cuda, autocast enabled    -> autocast_dtype  (bf16 operands, float32 accumulation)
        cuda, no autocast         -> hidden_dtype
    """
    if device_type != "cuda":
        return None
    return autocast_dtype if autocast_dtype is not None else hidden_dtype


def active_autocast_dtype(device_type: str) -> torch.dtype | None:
    """torch.get_autocast_dtype(device_type) while autocast is enabled for ``device_type``, else None (also for a
    device type autocast does not know, e.g. meta)."""
    try:
        enabled = torch.is_autocast_enabled(device_type)
    except RuntimeError:
        return None
    return torch.get_autocast_dtype(device_type) if enabled else None


def addmm_fp32(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """acc += a @ b for a float32 ``acc``, without rounding a @ b to a's dtype first.

    cuBLAS does it in one GEMM (bf16/fp16 operands, float32 output: torch.addmm's out_dtype, CUDA only);
    elsewhere the operands are upcast to float32 (CPU: tests)."""
    if acc.is_cuda and a.dtype in HALF:
        return torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    return acc.addmm_(a.float(), b.float())


def mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b as float32, not rounded to a's dtype (16-bit operands on CUDA: one cuBLAS GEMM with out_dtype)."""
    if a.is_cuda and a.dtype in HALF:
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a.float(), b.float())


def mm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """out = a @ b accumulated in float32, written in out's dtype (a float32 out is not rounded to a's dtype)."""
    if out.dtype == a.dtype == b.dtype:
        return torch.mm(a, b, out=out)
    if out.dtype == torch.float32:
        return addmm_fp32(out.zero_(), a, b)
    return out.copy_(torch.mm(a.float(), b.float()))
