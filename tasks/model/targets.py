"""LoRA target modules checked against the model's structure before any stage (the model built on the meta device
from its config: no weights), so that names peft would refuse in the GRPO stage are named at validate."""

from __future__ import annotations

import torch


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
