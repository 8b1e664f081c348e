"""Triton launches on the device of their tensors.

Triton launches a kernel on the *current* CUDA device (cuda:0 unless someone called set_device), whatever
device its tensors live on: a launch against tensors on cuda:1 then reads another card's addresses. Every
launcher of grpoflow.kernels goes through :func:`launch`, which enters ``torch.cuda.device(tensor's device)``
around the launch (a null context for CPU tensors, i.e. TRITON_INTERPRET=1). The context factory is a
parameter, so that a test on a machine without a GPU can record which device each launch entered.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

ContextFactory = Callable[[Any], AbstractContextManager]


def device_context(device: Any, factory: ContextFactory | None = None) -> AbstractContextManager:
    """``factory(device)`` (default ``torch.cuda.device``) for a CUDA device; a null context for any other.

    ``device`` is anything with a ``type`` attribute (a torch.device, or a stand-in in tests)."""
    if getattr(device, "type", None) != "cuda":
        return nullcontext()
    return (factory or torch.cuda.device)(device)


def launch(kernel: Any, grid: Any, device: Any, *args: Any, context: ContextFactory | None = None, **meta: Any) -> None:
    """``kernel[grid](*args, **meta)`` inside :func:`device_context` of ``device`` (the tensors' device)."""
    with device_context(device, context):
        kernel[grid](*args, **meta)
