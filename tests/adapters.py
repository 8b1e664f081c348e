"""A LoRA adapter as GRPO leaves one, for the tests that export, verify or register it."""

from __future__ import annotations

from pathlib import Path

import torch

from grpoflow.tasks.model.loading import add_lora, load_causal_lm, load_tokenizer


def save_trained_adapter(cfg, base: str | Path, out: Path, init_seed: int | None = None) -> Path:
    """A LoRA adapter (``cfg.model.lora``) on ``base`` with non-zero updates (lora_B = 0.05 N(0, 1) from a
    generator seeded 0: it changes the logits), saved at ``out`` with the base's tokenizer, as GRPO saves both.
    ``init_seed`` seeds torch's global generator first, from which peft draws lora_A; None leaves it as it is."""
    if init_seed is not None:
        torch.manual_seed(init_seed)
    model = add_lora(load_causal_lm(str(base), cfg.model), cfg.model.lora)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(out)
    load_tokenizer(str(base), cfg.model).save_pretrained(out)
    return out
