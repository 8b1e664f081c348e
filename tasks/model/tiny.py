"""The offline default model: a tiny Qwen2/Llama-style causal LM built from config, with a byte-level BPE
tokenizer trained on the task's own text (Qwen2's pre-tokenizer regex, so digits are single tokens and
llama.cpp's "qwen2" pre-tokenizer matches) and a ChatML chat template. Nothing is downloaded; the result is
saved once under the run workspace (``base_model/``) and reloaded."""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from grpoflow.tasks.config import ModelConfig, TinyModelConfig
from grpoflow.tasks.model.loading import CHATML_TEMPLATE
from grpoflow.tasks.model.sources import resolve_model

log = logging.getLogger(__name__)


QWEN2_PRETOKENIZE_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""  # noqa: E501


SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


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


def tiny_config(cfg: TinyModelConfig, **extra):
    """The transformers config of the tiny model ``cfg`` describes (``extra``: vocab_size, token ids)."""
    from transformers import LlamaConfig, Qwen2Config

    config_cls = {"llama": LlamaConfig, "qwen2": Qwen2Config}[cfg.architecture]
    return config_cls(
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings,
        **extra,
    )


def build_tiny_model(cfg: TinyModelConfig, tokenizer: PreTrainedTokenizerBase, seed: int) -> PreTrainedModel:
    """A randomly initialised causal LM sized by ``cfg`` (vocab = the tokenizer's)."""
    from transformers import LlamaForCausalLM, Qwen2ForCausalLM

    model_cls = {"llama": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM}[cfg.architecture]
    config = tiny_config(
        cfg,
        vocab_size=len(tokenizer),
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
    """Return a loadable name/path for the base model; for ``tiny``, build and save it once; a GGUF file or an
    alias resolves to its cached converted folder (grpoflow.tasks.model.sources)."""
    if cfg.name != "tiny":
        return resolve_model(cfg.name, cfg.cache_dir)
    if (out_dir / "config.json").is_file():
        return str(out_dir)
    if texts is None:
        raise ValueError("model.name=tiny needs the task text to train its tokenizer")
    tokenizer = train_tiny_tokenizer(texts, cfg.tiny.vocab_size)
    model = build_tiny_model(cfg.tiny, tokenizer, seed)
    # written aside, then moved in with config.json last: "config.json is there" means "built". Saved in place, a
    # kill mid-write left config.json beside a cut model.safetensors that every later run failed to load.
    building = out_dir / ".building"
    shutil.rmtree(building, ignore_errors=True)
    tokenizer.save_pretrained(building)
    model.save_pretrained(building)
    for name in sorted((p.name for p in building.iterdir()), key=lambda n: n == "config.json"):
        os.replace(building / name, out_dir / name)
    building.rmdir()
    n_params = sum(p.numel() for p in model.parameters())
    log.info("built tiny %s model: %.2fM parameters, vocab %d", cfg.tiny.architecture, n_params / 1e6, len(tokenizer))
    return str(out_dir)
