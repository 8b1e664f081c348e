"""Optimizer and learning-rate schedule shared by the SFT and GRPO stages (TRL/HF names)."""

from __future__ import annotations

import math

import torch
from transformers import get_scheduler

from grpoflow.tasks.config.training import OptimizerFields


def build_optimizer(params, cfg: OptimizerFields) -> torch.optim.Optimizer:
    """torch AdamW, or bitsandbytes 8-bit AdamW (``optim: adamw_8bit | paged_adamw_8bit``)."""
    params = [p for p in params if p.requires_grad]
    if not params:
        raise ValueError("no trainable parameters (is every weight frozen?)")
    kw = dict(lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2), weight_decay=cfg.weight_decay)
    if cfg.optim == "adamw_torch":
        return torch.optim.AdamW(params, **kw)
    import bitsandbytes as bnb

    cls = bnb.optim.PagedAdamW8bit if cfg.optim == "paged_adamw_8bit" else bnb.optim.AdamW8bit
    return cls(params, **kw)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimizerFields, total_steps: int):
    warmup = cfg.warmup_steps or math.ceil(cfg.warmup_ratio * total_steps)
    return get_scheduler(cfg.lr_scheduler_type, optimizer, num_warmup_steps=warmup, num_training_steps=total_steps)


def clip_and_step(model, optimizer, scheduler, max_grad_norm: float | None) -> float:
    """Clip gradients (when configured), step optimizer and schedule; return the pre-clip grad norm."""
    params = [p for p in model.parameters() if p.requires_grad]
    norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm if max_grad_norm else float("inf"))
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # FSDP2: a DTensor
