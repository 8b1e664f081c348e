"""Where training runs: ``run.device`` resolved to a torch device, and the device a model lives on.

    auto    -> cuda (the current CUDA device) when torch sees one, else cpu
    cpu     -> cpu
    cuda    -> cuda, cuda:N -> that GPU; an error naming run.device when torch sees no such GPU

A stage takes its device with :func:`select_device`, which also makes it torch's current CUDA device: what
launches on the current device (Triton kernels, a bare "cuda" in bitsandbytes' placement, a CUDA context created
by the first CUDA call) then lands on the GPU the tensors live on, not on cuda:0. Every stage loads its models
onto this device (4-bit bases through bitsandbytes' own placement, ``device_map``), and builds its batches, masks
and labels on ``model_device(model)``, so one setting moves SFT, GRPO (policy, reference, sampling loop,
optimizer state) and evaluation together. Export writes from CPU copies whatever the device.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

from grpoflow.tasks.config import DEVICE_PATTERN


def resolve_device(spec: str) -> torch.device:
    """The torch device of a ``run.device`` value; ValueError (naming the key) when it cannot be had here."""
    if not re.fullmatch(DEVICE_PATTERN, spec):
        raise ValueError(f"run.device: {spec!r} is not one of auto, cpu, cuda, cuda:N")
    if spec == "auto":
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(spec)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"run.device: {spec!r} asked for a GPU, but torch sees none (torch {torch.__version__}, CUDA build: "
                f"{torch.version.cuda or 'no'}); use run.device=auto or cpu, or install the gpu extra on a GPU worker"
            )
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"run.device: {spec!r}, but torch sees {torch.cuda.device_count()} GPU(s)")
    return device


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of a model's first parameter (where its inputs must go)."""
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def activate_device(
    device: torch.device,
    set_device: Callable[[torch.device], None] = torch.cuda.set_device,
    current_index: Callable[[], int] = torch.cuda.current_device,
) -> torch.device:
    """``device`` made torch's current CUDA device (``set_device``); a bare ``cuda`` becomes the current GPU with its
    index, so what the stage passes on (bitsandbytes' device_map, the vLLM engine's placement) names one GPU. Any
    other device type is returned as it is, nothing set."""
    if device.type != "cuda":
        return device
    if device.index is None:
        device = torch.device("cuda", current_index())
    set_device(device)
    return device


def select_device(
    spec: str,
    set_device: Callable[[torch.device], None] = torch.cuda.set_device,
    local_rank: int | None = None,
) -> torch.device:
    """The device of a stage's process for ``run.device`` (:func:`resolve_device`), made current
    (:func:`activate_device`): what every stage that computes calls, instead of ``resolve_device``.

    ``local_rank``: a torchrun process's LOCAL_RANK; a CUDA run then takes that GPU, whatever the backend (nccl's
    process group sets it too; under gloo the ranks would otherwise all share cuda:0). The config refuses
    ``run.device: cuda:N`` with several processes."""
    device = resolve_device(spec)
    if local_rank is not None and device.type == "cuda":
        device = torch.device("cuda", local_rank)
    return activate_device(device, set_device)
