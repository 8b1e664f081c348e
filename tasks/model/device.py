"""Where training runs: ``run.device`` resolved to a torch device, and the device a model lives on.

    auto    -> cuda (the current CUDA device) when torch sees one, else cpu
    cpu     -> cpu
    cuda    -> cuda, cuda:N -> that GPU; an error naming run.device when torch sees no such GPU

Every stage loads its models onto this device (4-bit bases through bitsandbytes' own placement,
``device_map``), and builds its batches, masks and labels on ``model_device(model)``, so one setting moves
SFT, GRPO (policy, reference, sampling loop, optimizer state) and evaluation together. Export writes from
CPU copies whatever the device.
"""

from __future__ import annotations

import re

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
