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


def lora_target_problem(cfg) -> str | None:
    """Why model.lora.target_modules (a list of names) would match no module of the model, found before any stage
    from the model's structure alone (built on the meta device: no weights): peft refused it in the GRPO stage,
    after SFT, without naming the key. None when every name matches, for 'all-linear' or a regex string, and
    when the structure is unknown here (a GGUF file, an alias, a hub model not in the cache)."""
    lora = cfg.model.lora
    if not lora.enabled or isinstance(lora.target_modules, str):  # SFT's LoRA too needs model.lora.enabled
        return None
    found = _model_structure(cfg.model)
    if found is None:
        return None
    config, where = found
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    names = [n for n, _ in model.named_modules() if n]
    missing = [t for t in lora.target_modules if not any(n == t or n.endswith("." + t) for n in names)]
    if not missing:
        return None
    linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
    return (
        f"model.lora.target_modules: {', '.join(map(repr, missing))} match no module of {where}; its linear layers "
        f"are {', '.join(linear)} (or set 'all-linear')"
    )


def _model_structure(m) -> tuple[object, str] | None:
    """(a transformers config of ``m`` (a ModelConfig), where it was read), or None when unknown without loading."""
    import json
    from pathlib import Path

    from transformers import AutoConfig

    if m.name == "tiny":
        from grpoflow.tasks.model.tiny import tiny_config

        return tiny_config(m.tiny, vocab_size=m.tiny.vocab_size), "model.tiny"
    path = Path(m.name).expanduser() / "config.json"
    if not path.is_file():
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(m.name, "config.json", revision=m.revision)
        except Exception:  # not a hub id (a GGUF path, an alias)
            return None
        if not isinstance(cached, str):
            return None
        path = Path(cached)
    try:
        raw = json.loads(path.read_text())
        return AutoConfig.for_model(**raw), f"{m.name}'s config.json"
    except (OSError, ValueError, KeyError):  # unreadable, or a model type this transformers does not know
        return None
