"""Saving a trained model as a plain folder (the export stage and the continuous flow's champion merge)."""

from __future__ import annotations

import shutil
from pathlib import Path

from grpoflow.tasks.model.loading import DTYPES


def save_merged(trained, tokenizer, merged_dir: Path, dtype: str, is_adapter: bool) -> None:
    """The merged export: LoRA folded into the weights (peft's merge_and_unload, when ``trained`` has adapters),
    cast to ``dtype`` and saved as safetensors with the tokenizer: a plain model folder that transformers, vLLM
    (tests/tasks/test_vllm_engine.py loads one) and the GGUF writer read."""
    shutil.rmtree(merged_dir, ignore_errors=True)
    merged = trained.merge_and_unload() if is_adapter else trained
    merged.to(DTYPES[dtype]).save_pretrained(merged_dir, safe_serialization=True)
    tokenizer.save_pretrained(merged_dir)
