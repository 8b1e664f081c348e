"""Model and tokenizer loading shared by the stages.

- ``model.name: tiny`` builds a small Qwen2/Llama-style causal LM from config, with a byte-level
  BPE tokenizer trained on the task's own text (Qwen2's pre-tokenizer regex, so digits are single
  tokens and llama.cpp's "qwen2" pre-tokenizer matches) and a ChatML chat template. Nothing is
  downloaded; the result is saved once under the run workspace (``base_model/``) and reloaded.
- Any other name is a Hugging Face model id or a local path, loaded with transformers.
- LoRA adapters via peft; QLoRA (4-bit NF4 base) via bitsandbytes.
"""

from __future__ import annotations

import logging

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from grpoflow.tasks.config import LoraConfig, ModelConfig
from grpoflow.tasks.model.lora import unwrap
from grpoflow.tasks.model.precision import check_cpu_bf16, lora_autocast_dtype, use_float32_attention

log = logging.getLogger(__name__)

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_tokenizer(name_or_path: str, cfg: ModelConfig) -> PreTrainedTokenizerBase:
    tok = AutoTokenizer.from_pretrained(name_or_path, revision=cfg.revision, trust_remote_code=cfg.trust_remote_code)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    if tok.chat_template is None:
        tok.chat_template = CHATML_TEMPLATE
    return tok


def prompt_ids(tokenizer, prompt_messages: list[dict], max_prompt_length: int | None = None) -> list[int]:
    """Chat-templated prompt token ids, left-truncated to max_prompt_length (as TRL does)."""
    text = tokenizer.apply_chat_template(prompt_messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if max_prompt_length is not None and len(ids) > max_prompt_length:
        ids = ids[-max_prompt_length:]
    return ids


def load_causal_lm(
    name_or_path: str,
    cfg: ModelConfig,
    *,
    quantize: bool | None = None,
    device: torch.device | None = None,
    dtype: torch.dtype | None = None,
) -> PreTrainedModel:
    """Load a causal LM with the configured dtype (``dtype`` overrides it), attention and (optionally) 4-bit
    quantization, onto ``device`` (None: where transformers puts it, the CPU). A 4-bit model is placed by
    bitsandbytes itself (``device_map``): its packed weights cannot be moved with ``.to`` after loading."""
    kwargs: dict = {"revision": cfg.revision, "trust_remote_code": cfg.trust_remote_code}
    kwargs["dtype"] = dtype or DTYPES.get(cfg.dtype, "auto")
    if cfg.attn_implementation:
        kwargs["attn_implementation"] = cfg.attn_implementation
    if cfg.load_in_4bit if quantize is None else quantize:
        from transformers import BitsAndBytesConfig

        compute = DTYPES.get(cfg.dtype, torch.bfloat16)
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=compute,
        )
        if device is not None and device.type != "cpu":
            kwargs["device_map"] = {"": device}
    try:
        model = AutoModelForCausalLM.from_pretrained(name_or_path, **kwargs)
    except OSError as e:
        raise ValueError(
            f"model.name: cannot load {name_or_path!r} (not a local model folder or reachable id): {e}"
        ) from e
    if getattr(model, "is_loaded_in_4bit", False):
        keep_bnb_cpu_path_valid(model)
    elif device is not None:
        model.to(device)
    return model


def keep_bnb_cpu_path_valid(model) -> int:
    """Keep every 4-bit layer on bitsandbytes' generic CPU path (dequantize, then matmul in the compute dtype).

    On CPUs with AVX512-BF16, bitsandbytes 0.50 instead repacks a Linear4bit's weight in place on its first no-grad
    forward (GRPO's generation) and from then on multiplies in bfloat16: a silent change of precision from
    ``model.dtype``, stored bytes that no longer match the saved base, and a crash ("shape '[N, 0]' is invalid")
    for layers whose in_features is not a multiple of the quantization block size (small models). Returns how many
    layers were switched."""
    changed = 0
    for module in model.modules():
        if getattr(module, "support_avx512bf16_for_cpu", False):
            module.support_avx512bf16_for_cpu = False
            changed += 1
    return changed


def enable_gradient_checkpointing(model: PreTrainedModel) -> None:
    """Checkpoint every decoder layer with torch's non-reentrant checkpoint (``use_reentrant=False``), the variant
    torch recommends: it supports frozen inputs (a frozen base's embeddings) and keyword arguments, and does not
    warn. The KV cache is off: it cannot coexist with recomputation."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False


def prepare_4bit_base(model: PreTrainedModel, gradient_checkpointing: bool) -> PreTrainedModel:
    """A 4-bit base made ready for LoRA: every weight frozen and, if asked, non-reentrant gradient checkpointing.

    This replaces peft's ``prepare_model_for_kbit_training``, which does two things grpoflow does not want:
    it calls ``gradient_checkpointing_enable`` again with its own kwargs (``{}`` unless told otherwise), which
    replaces an earlier ``use_reentrant=False`` with torch's reentrant fallback (and its warning); and it casts
    every parameter that is not 4-bit (embeddings, output head, norms) from 16 bits to float32. Those weights are
    frozen, so float32 copies make no update more precise; they double the memory of the two vocabulary-sized
    matrices (2 x V x D: about 2 GB more for a 7B model with a 152k vocabulary), turn the residual stream float32
    after the first float32 norm, and hand the log-prob head a float32 weight. A bfloat16 base keeps float32's
    exponent range, the reason QLoRA upcast under float16. So a QLoRA base keeps ``model.dtype`` everywhere but
    in its 4-bit linears, as the 16-bit LoRA base does, and the adapters are float32 (peft's own default)."""
    for param in model.parameters():
        param.requires_grad_(False)
    if gradient_checkpointing:
        enable_gradient_checkpointing(model)
    return model


def add_lora(model: PreTrainedModel, cfg: LoraConfig, gradient_checkpointing: bool = False):
    """Wrap ``model`` with fresh trainable LoRA adapters (peft); a 4-bit base goes through prepare_4bit_base."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    if getattr(model, "is_loaded_in_4bit", False):
        model = prepare_4bit_base(model, gradient_checkpointing)
    peft_cfg = PeftLoraConfig(
        r=cfg.r,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=cfg.target_modules,
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, peft_cfg)


def train_dtypes(cfg: ModelConfig, use_lora: bool) -> tuple[torch.dtype | None, torch.dtype | None]:
    """(weights dtype, autocast dtype) of a model being trained; None: as configured / no autocast.

    LoRA: the frozen base in ``model.dtype`` (bf16 halves its memory) and the adapters in float32 (peft casts
    them up, its autocast_adapter_dtype default): the trained weights keep full precision. Its passes' autocast
    (bf16 over a bf16 base) is :func:`compute_dtype`'s, not this function's.
    Full fine-tuning with bfloat16: float32 master weights (AdamW's updates of bf16 weights round away) and
    the forward passes under torch.autocast to bfloat16, as transformers' Trainer does with bf16=True.
    float32: neither. (float16 is refused by the config: it needs a loss scaler.)"""
    if use_lora or cfg.dtype != "bfloat16":
        return None, None
    return torch.float32, torch.bfloat16


def compute_dtype(cfg: ModelConfig, use_lora: bool) -> torch.dtype | None:
    """The autocast dtype of training passes: full fine-tuning's (train_dtypes) or, for LoRA over a bf16 base,
    bfloat16 with the adapters kept float32 (tasks/model/precision.py); None: no autocast."""
    return train_dtypes(cfg, use_lora)[1] or lora_autocast_dtype(cfg.dtype, use_lora, cfg.load_in_4bit)


def load_trainable(name_or_path: str, cfg: ModelConfig, use_lora: bool, device: torch.device | None = None):
    """Model ready to train on ``device``: LoRA-wrapped (frozen base) or all weights trainable (train_dtypes)."""
    weights, _ = train_dtypes(cfg, use_lora)
    model = load_causal_lm(name_or_path, cfg, quantize=cfg.load_in_4bit and use_lora, device=device, dtype=weights)
    if model.dtype == torch.float16:
        raise ValueError(
            f"model.dtype={cfg.dtype}: {name_or_path} loaded in float16, which grpoflow does not train (no loss "
            "scaler: small gradients underflow); set model.dtype=bfloat16 or float32"
        )
    computes_bf16 = model.dtype == torch.bfloat16 or compute_dtype(cfg, use_lora) == torch.bfloat16
    check_cpu_bf16(device or torch.device("cpu"), computes_bf16, f"model.dtype={cfg.dtype}")
    if cfg.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    # bf16 training passes on a CPU: attention in float32 (torch's bf16 flash-attention backward is slow there)
    use_float32_attention(model, device or torch.device("cpu"), cfg.dtype == "bfloat16")
    if use_lora:
        model = add_lora(model, cfg.lora, cfg.gradient_checkpointing)
    model.train()
    return model


def quantization_method(name_or_path: str, cfg: ModelConfig) -> str | None:
    """The ``quant_method`` of a checkpoint's quantization_config (its config.json), None for a plain checkpoint.

    transformers loads a checkpoint that carries one quantized (bitsandbytes 4-bit, GPTQ, ...) whatever
    ``from_pretrained`` is asked, so such a folder can never be the 16-bit base a LoRA adapter is merged into."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(
            name_or_path, revision=cfg.revision, trust_remote_code=cfg.trust_remote_code
        )
    except OSError as e:
        raise ValueError(f"cannot read the model config of {name_or_path!r}: {e}") from e
    q = getattr(config, "quantization_config", None)
    if q is None:
        return None
    method = q.get("quant_method") if isinstance(q, dict) else getattr(q, "quant_method", None)
    return str(getattr(method, "value", method) or "unknown")


def require_unquantized(name_or_path: str, cfg: ModelConfig, what: str) -> None:
    """Refuse a quantized checkpoint where 16-bit weights are needed (a merge target): ``what`` names the use."""
    method = quantization_method(name_or_path, cfg)
    if method is not None:
        raise ValueError(
            f"{what}: {name_or_path} is a quantized checkpoint (its config.json has a {method} quantization_config), "
            "which transformers loads quantized whatever is asked: a LoRA adapter merged into it is rounded to the "
            "quantized format again and the result loads quantized. Use the unquantized checkpoint; "
            "model.load_in_4bit=true quantizes it at load time for training."
        )


def load_with_adapter(
    base: str,
    adapter_dir: str | None,
    cfg: ModelConfig,
    *,
    quantize: bool | None = None,
    device: torch.device | None = None,
):
    """The base model with a trained adapter applied (or just the base when adapter_dir is None), on ``device``."""
    model = load_causal_lm(base, cfg, quantize=quantize, device=device)
    if adapter_dir:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_dir)
    model.eval()
    return model


def backbone_and_head(model) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The transformer body (returns last hidden states) and the output projection of a causal LM.

    Works for plain transformers models and peft wrappers (LoRA layers live inside the body)."""
    base = unwrap(model)
    return getattr(base, base.base_model_prefix), base.get_output_embeddings()


def count_parameters(model) -> tuple[int, int]:
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trainable, total


# --------------------------------------------------------------------------------------------
# LoRA merged on the side (generation backends)
# --------------------------------------------------------------------------------------------
