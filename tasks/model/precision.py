"""Compute precision of training passes: bfloat16 matmuls over a bfloat16 LoRA base, float32 attention on CPUs.

LoRA over a ``model.dtype: bfloat16`` base keeps its adapters float32 (peft's default). Without autocast every
adapted linear casts its bf16 input up to float32 for the adapter path and the adapter's output back (peft's input
casting): on a CPU two full activation copies per linear, and the adapter matmuls in float32. Under
``torch.autocast(bfloat16)`` with peft's input casting off, the adapter matmuls run in bf16 like the base's, the
float32 master adapters receive float32 gradients through autocast's casts, and no activation is copied: the same
arithmetic as transformers' Trainer with ``bf16=True`` (TRL's default), without its copies.

On CPUs with AMX (Sapphire Rapids and later) a bf16 GEMM runs about 6x faster than float32 (bench_matmul_peak.py:
2.32 vs 0.37 TFLOP/s on 2 threads);
torch's bf16 flash-attention backward on the CPU is instead about 3x slower than float32's, so CPU training passes
run attention in float32 (:func:`sdpa_float32`). Measured on SmolLM2-135M with LoRA r=16 on all linears, 32 x 96
tokens, forward and backward, 2 threads: float32 11.3 s; bf16 base as before 9.8 s; bf16 autocast 5.3 s; plus
float32 attention 4.8 s (2.4x float32).
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import torch

SDPA_FLOAT32 = "sdpa_float32"
# a CPU whose bf16 matmuls take longer than this many float32 ones has no bf16 matrix path: torch runs scalar code
MAX_CPU_BF16_SLOWDOWN = 4.0
ALLOW_SLOW_BF16_ENV = "GRPOFLOW_ALLOW_SLOW_BF16"


def lora_autocast_dtype(dtype: str, use_lora: bool, load_in_4bit: bool) -> torch.dtype | None:
    """bfloat16 for LoRA over a bfloat16 base (the adapters float32, the passes under bf16 autocast), else None.

    A 4-bit base keeps bitsandbytes' own compute dtype (its linears dequantize to ``model.dtype``)."""
    return torch.bfloat16 if use_lora and dtype == "bfloat16" and not load_in_4bit else None


@contextmanager
def train_precision(model, device_type: str, dtype: torch.dtype | None) -> Iterator[None]:
    """``torch.autocast(device_type, dtype)`` with peft's input casting off (a no-op context for ``dtype`` None).

    Off, a LoRA layer hands its bf16 input to its float32 adapters as it is and autocast runs the adapter matmuls in
    bf16; on, peft would copy every input to float32 first and autocast would copy it back."""
    if dtype is None:
        yield
        return
    with ExitStack() as stack:
        stack.enter_context(torch.autocast(device_type, dtype=dtype))
        if hasattr(model, "peft_config"):
            from peft.helpers import disable_input_dtype_casting

            stack.enter_context(disable_input_dtype_casting(model))
        yield


def sdpa_float32(module, query, key, value, attention_mask, **kwargs):
    """transformers' SDPA attention computed in float32 (autocast off inside), its output in the query's dtype.

    A drop-in attention implementation (transformers' AttentionInterface) for CPU training in bf16: the casts of
    q, k, v (B x H x T x d each) cost far less than the bf16 flash-attention kernels lose on the CPU."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    with torch.autocast(query.device.type, enabled=False):
        mask = attention_mask
        if mask is not None and mask.is_floating_point():  # an additive mask: in the scores' dtype
            mask = mask.float()
        out, weights = sdpa_attention_forward(module, query.float(), key.float(), value.float(), mask, **kwargs)
    return out.to(query.dtype), weights


def register_sdpa_float32() -> None:
    """Make ``attn_implementation="sdpa_float32"`` known to transformers (idempotent)."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(SDPA_FLOAT32, sdpa_float32)
    AttentionMaskInterface.register(SDPA_FLOAT32, sdpa_mask)


def use_float32_attention(model, device: torch.device, computes_bf16: bool) -> bool:
    """Switch a model that trains in bf16 on the CPU from ``sdpa`` to :func:`sdpa_float32`; returns whether it did.

    Other devices, other attention implementations and float32 training are left as they are."""
    if device.type != "cpu" or not computes_bf16:
        return False
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if getattr(base.config, "_attn_implementation", None) != "sdpa":
        return False
    register_sdpa_float32()
    base.set_attn_implementation(SDPA_FLOAT32)
    return True


@functools.cache
def cpu_bf16_slowdown(n: int = 256, repeats: int = 3) -> float:
    """t(bf16) / t(float32) of an n x n x n matmul on this CPU at torch's current thread count, best of ``repeats``
    each after a warm-up: about 0.15 with AMX (bf16 6x faster) and tens on CPUs without AMX or AVX512-BF16, where
    torch falls back to scalar code (an AVX2-only AMD EPYC: 37 on 1 thread, 64 on 2; its GEMM peak 1.4 GFLOP/s bf16
    against 187 float32, benchmarks/RESULTS.md). Takes about 0.1 s there, milliseconds elsewhere; once a process."""
    a = torch.randn(n, n)

    def best(x: torch.Tensor) -> float:
        x @ x  # warm-up: kernel selection, thread pool
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            x @ x
            times.append(time.perf_counter() - t)
        return min(times)

    return best(a.bfloat16()) / max(best(a), 1e-9)


def check_cpu_bf16(device: torch.device, computes_bf16: bool, setting: str, limit: float | None = None) -> None:
    """Refuse bf16 training on a CPU whose bf16 matmuls are more than ``limit`` (MAX_CPU_BF16_SLOWDOWN) times
    slower than float32's (:func:`cpu_bf16_slowdown`): there bfloat16 would make a run tens of times slower, not
    faster. ``setting`` names the config value in the error (``model.dtype=bfloat16``).
    ``GRPOFLOW_ALLOW_SLOW_BF16=1`` trains anyway (bf16 for its memory, or tiny test shapes where speed does not
    matter)."""
    if device.type != "cpu" or not computes_bf16 or os.environ.get(ALLOW_SLOW_BF16_ENV) == "1":
        return
    slowdown = cpu_bf16_slowdown()
    if slowdown > (MAX_CPU_BF16_SLOWDOWN if limit is None else limit):
        raise ValueError(
            f"{setting}: this CPU has no fast bfloat16 matrix path (no AMX or AVX512-BF16): a bfloat16 matmul takes "
            f"{slowdown:.0f}x as long as a float32 one here (measured now), so training would run about that much "
            f"slower; set model.dtype=float32 (or {ALLOW_SLOW_BF16_ENV}=1 to train in bfloat16 anyway)"
        )
