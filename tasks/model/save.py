"""Saving a trained model as a plain folder (the export stage and the continuous flow's champion merge)."""

from __future__ import annotations

import shutil
from pathlib import Path

from transformers import PreTrainedModel

from grpoflow.tasks.config import ModelConfig
from grpoflow.tasks.model.loading import DTYPES, load_with_adapter, require_unquantized


def save_merged(trained, tokenizer, merged_dir: Path, dtype: str, is_adapter: bool) -> None:
    """The merged export: LoRA folded into the weights (peft's merge_and_unload, when ``trained`` has adapters),
    cast to ``dtype`` and saved as safetensors with the tokenizer: a plain model folder that transformers, vLLM
    (tests/tasks/generation/test_vllm_engine.py loads one) and the GGUF writer read."""
    shutil.rmtree(merged_dir, ignore_errors=True)
    merged = trained.merge_and_unload() if is_adapter else trained
    merged.to(DTYPES[dtype]).save_pretrained(merged_dir, safe_serialization=True)
    tokenizer.save_pretrained(merged_dir)


def merge_into_16bit_base(base: str, adapter_dir: str | Path, cfg: ModelConfig, what: str) -> PreTrainedModel:
    """The adapter in ``adapter_dir`` merged into ``base`` loaded unquantized in ``model.dtype`` (on the CPU).

    The way out of a 4-bit training model (QLoRA): peft's merge_and_unload on a 4-bit model dequantizes each weight,
    adds B @ A and quantizes the sum again (NF4 rounding on top of the update), and the saved folder carries a
    quantization_config that makes every later load 4-bit. Here the update lands in the 16-bit weights and the
    result is a plain checkpoint (a later stage quantizes it itself if model.load_in_4bit asks). ``what`` names
    the caller in the error when ``base`` is itself a quantized checkpoint."""
    require_unquantized(base, cfg, what)
    model = load_with_adapter(base, str(adapter_dir), cfg, quantize=False)
    return model.merge_and_unload()
