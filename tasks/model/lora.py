"""peft helpers: the model under a peft wrapper, its LoRA layers, and LoRA merged on the side (W + scale * B @ A
computed as a fresh tensor, the frozen base untouched) for the generation backends."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


def unwrap(model):
    """The transformers model inside a peft wrapper (``get_base_model``), or ``model`` itself."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def lora_layers(model) -> dict[str, torch.nn.Module]:
    """peft LoRA layers of ``model`` by module name (relative to the base model); {} for a plain model."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return {
        name: m
        for name, m in base.named_modules()
        if hasattr(m, "lora_A") and hasattr(m, "get_delta_weight") and hasattr(m, "base_layer")
    }


@torch.no_grad()
def merged_weight(layer) -> torch.Tensor:
    """W + sum over active adapters of scale * B @ A, as a new tensor (the layer is not modified).

    The base weight itself when the adapters are disabled or already merged into it."""
    weight = layer.base_layer.weight
    if layer.merged or getattr(layer, "disable_adapters", False):
        return weight.detach()
    out = weight.detach().clone()
    for a in layer.active_adapters:
        if a in layer.lora_A:
            out += layer.get_delta_weight(a).to(out.dtype)
    return out


def merge_blocker(model) -> str | None:
    """Why ``model``'s adapters cannot be merged on the side (None: they can, or there are none)."""
    for name, layer in lora_layers(model).items():
        if not layer.base_layer.weight.dtype.is_floating_point:
            return f"{name} has a quantized base weight ({layer.base_layer.weight.dtype})"
        if any(layer.use_dora.get(a, False) for a in layer.active_adapters):
            return f"{name} uses DoRA"
    return None


@contextmanager
def lora_merged(model) -> Iterator[None]:
    """Run a peft ``model`` with its LoRA layers replaced by merged weights: one matmul per layer.

    Inside, every LoRA layer's base weight is swapped for W + scale * B @ A (a fresh tensor) and
    the adapters are disabled; on exit the original base weights come back untouched (nothing is
    merged in place, so no rounding drift accumulates in a frozen base). Costs one copy of the
    adapted weights while open. A plain model, or one ``merge_blocker`` refuses, runs as is."""
    layers = lora_layers(model)
    if not layers or merge_blocker(model) is not None:
        yield
        return
    saved = []
    try:
        for layer in layers.values():
            merged = torch.nn.Parameter(merged_weight(layer), requires_grad=False)
            saved.append((layer.base_layer, layer.base_layer._parameters["weight"]))
            layer.base_layer._parameters["weight"] = merged
        with model.disable_adapter():
            yield
    finally:
        for module, weight in saved:
            module._parameters["weight"] = weight
