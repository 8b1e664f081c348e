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
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from tasks.config import LoraConfig, ModelConfig, TinyModelConfig

log = logging.getLogger(__name__)

QWEN2_PRETOKENIZE_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""  # noqa: E501
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def train_tiny_tokenizer(texts: Iterable[str], vocab_size: int) -> PreTrainedTokenizerBase:
    """Byte-level BPE trained on ``texts`` with Qwen2's pre-tokenizer and a ChatML template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
        additional_special_tokens=["<|im_start|>"],
    )
    fast.chat_template = CHATML_TEMPLATE
    fast.padding_side = "left"
    return fast


def build_tiny_model(cfg: TinyModelConfig, tokenizer: PreTrainedTokenizerBase, seed: int) -> PreTrainedModel:
    """A randomly initialised causal LM sized by ``cfg`` (vocab = the tokenizer's)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[
        cfg.architecture
    ]
    config = config_cls(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings,
        bos_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = model_cls(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def ensure_base_model(cfg: ModelConfig, texts: Iterable[str] | None, out_dir: Path, seed: int) -> str:
    """Return a loadable name/path for the base model; for ``tiny``, build and save it once."""
    if cfg.name != "tiny":
        return cfg.name
    if (out_dir / "config.json").is_file():
        return str(out_dir)
    if texts is None:
        raise ValueError("model.name=tiny needs the task text to train its tokenizer")
    tokenizer = train_tiny_tokenizer(texts, cfg.tiny.vocab_size)
    model = build_tiny_model(cfg.tiny, tokenizer, seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out_dir)
    model.save_pretrained(out_dir)
    n_params = sum(p.numel() for p in model.parameters())
    log.info("built tiny %s model: %.2fM parameters, vocab %d", cfg.tiny.architecture, n_params / 1e6, len(tokenizer))
    return str(out_dir)


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


def load_causal_lm(name_or_path: str, cfg: ModelConfig, *, quantize: bool | None = None) -> PreTrainedModel:
    """Load a causal LM with the configured dtype, attention and (optionally) 4-bit quantization."""
    kwargs: dict = {"revision": cfg.revision, "trust_remote_code": cfg.trust_remote_code}
    kwargs["dtype"] = DTYPES.get(cfg.dtype, "auto")
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
    try:
        model = AutoModelForCausalLM.from_pretrained(name_or_path, **kwargs)
    except OSError as e:
        raise ValueError(
            f"model.name: cannot load {name_or_path!r} (not a local model folder or reachable id): {e}"
        ) from e
    return model


def add_lora(model: PreTrainedModel, cfg: LoraConfig, gradient_checkpointing: bool = False):
    """Wrap ``model`` with fresh trainable LoRA adapters (peft)."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model, prepare_model_for_kbit_training

    if getattr(model, "is_loaded_in_4bit", False):
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=gradient_checkpointing)
    peft_cfg = PeftLoraConfig(
        r=cfg.r,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=cfg.target_modules,
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, peft_cfg)


def load_trainable(name_or_path: str, cfg: ModelConfig, use_lora: bool):
    """Model ready to train: LoRA-wrapped (frozen base) or all weights trainable."""
    model = load_causal_lm(name_or_path, cfg, quantize=cfg.load_in_4bit and use_lora)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    if use_lora:
        model = add_lora(model, cfg.lora, cfg.gradient_checkpointing)
    model.train()
    return model


def load_with_adapter(base: str, adapter_dir: str | None, cfg: ModelConfig, *, quantize: bool | None = None):
    """The base model with a trained adapter applied (or just the base when adapter_dir is None)."""
    model = load_causal_lm(base, cfg, quantize=quantize)
    if adapter_dir:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_dir)
    model.eval()
    return model


def backbone_and_head(model) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The transformer body (returns last hidden states) and the output projection of a causal LM.

    Works for plain transformers models and peft wrappers (LoRA layers live inside the body)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return getattr(base, base.base_model_prefix), base.get_output_embeddings()


def count_parameters(model) -> tuple[int, int]:
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trainable, total


# --------------------------------------------------------------------------------------------
# LoRA merged on the side (generation backends)
# --------------------------------------------------------------------------------------------
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
