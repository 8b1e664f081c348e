"""GGUF export of a saved Hugging Face causal LM, written with the ``gguf`` package (no llama.cpp checkout).

:func:`write_gguf` converts a folder holding ``config.json``, ``*.safetensors`` and ``tokenizer.json``
(``LlamaForCausalLM`` or ``Qwen2ForCausalLM``) into one GGUF file the way llama.cpp's
``convert_hf_to_gguf.py`` does for those models:

- tensor names through ``gguf.TensorNameMap`` (``model.layers.0.self_attn.q_proj.weight`` ->
  ``blk.0.attn_q.weight``); Llama q/k projections permuted from HF's rotate-half RoPE layout to
  llama.cpp's interleaved one (:func:`permute`); Qwen2 is not permuted and keeps its q/k/v biases;
  a tied head (``tie_word_embeddings``) writes no ``output.weight`` (llama.cpp reuses ``token_embd``);
- Llama 3.1+ RoPE scaling (``rope_type: llama3``) as a ``rope_freqs.weight`` tensor, as the converter does;
- ``f32`` / ``f16`` / ``bf16`` / ``q8_0`` for 2-D weights; 1-D tensors, norms and biases stay f32
  (q8_0 falls back to f16 for a row length that is not a multiple of 32, as the converter does);
- ``q4_k_m`` quantized by llama.cpp from a 16-bit GGUF: in process through llama-cpp-python's C API
  (``llama_model_quantize``) when it imports (the opt-in ``llamacpp`` extra), else with ``llama-quantize``
  on PATH, else :class:`GGUFUnavailable`. llama.cpp picks each tensor's type: Q4_K, Q6_K for the output
  and some attn_v/ffn_down; a tensor whose row length is not a multiple of 256 (a k-quant block) falls
  back to Q5_0 (for Q4_K) or Q8_0 (for Q6_K): all of them for the default tiny model (hidden size 128).
  The summary's ``tensor_types`` counts what was written;
- the tokenizer as llama.cpp's ``gpt2`` (byte-level BPE) model: tokens, token types, merges, special
  ids, ``add_bos_token``, the chat template, and the pre-tokenizer name found from its split regex.

Everything that can reject a model (architecture, activation, RoPE scaling, tokenizer) is checked
before any file is written; the file is written under a temporary name and renamed when complete.
"""

from __future__ import annotations

import ctypes
import json
import logging
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QType
from gguf import LlamaFileType, TokenType

from grpoflow.tasks.model.tiny import QWEN2_PRETOKENIZE_REGEX

log = logging.getLogger(__name__)

ARCHITECTURES = {"LlamaForCausalLM": gguf.MODEL_ARCH.LLAMA, "Qwen2ForCausalLM": gguf.MODEL_ARCH.QWEN2}
OUT_TYPES = {
    "f32": (QType.F32, LlamaFileType.ALL_F32),
    "f16": (QType.F16, LlamaFileType.MOSTLY_F16),
    "bf16": (QType.BF16, LlamaFileType.MOSTLY_BF16),
    "q8_0": (QType.Q8_0, LlamaFileType.MOSTLY_Q8_0),
}
LLAMA_QUANTIZE_TYPES = {"q4_k_m": "Q4_K_M"}  # written by llama.cpp (LLAMA_FTYPE_MOSTLY_<name>) from an f16/bf16 GGUF
GGUF_TYPES = (*OUT_TYPES, *LLAMA_QUANTIZE_TYPES)

LLAMA3_PRETOKENIZE_REGEX = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"  # noqa: E501
# split regex of tokenizer.json -> llama.cpp's pre-tokenizer name (src/llama-vocab.cpp)
PRE_TOKENIZERS = {QWEN2_PRETOKENIZE_REGEX: "qwen2", LLAMA3_PRETOKENIZE_REGEX: "llama-bpe"}


QUANTIZE_TIMEOUT_S = 1800.0  # llama-quantize of a 7B model takes minutes; a hung one is stopped after this


class QuantizeError(ChildProcessError):
    """llama-quantize exited non-zero or did not finish within its timeout; the message names the command, its
    exit code (or the timeout) and the end of its stderr. An OSError: the stage reports it in one line."""


class GGUFUnavailable(RuntimeError):
    """The requested GGUF type needs llama.cpp, which is not installed (neither llama-cpp-python nor
    llama-quantize)."""


@dataclass(frozen=True)
class HParams:
    """The hyperparameters llama.cpp reads, resolved from config.json."""

    arch: gguf.MODEL_ARCH
    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ctx: int
    n_vocab: int
    rms_eps: float
    rope_theta: float
    rope_linear_factor: float | None
    tied: bool
    rope_freqs: np.ndarray | None = None  # llama3 RoPE scaling: written as rope_freqs.weight


@dataclass(frozen=True)
class Vocab:
    """llama.cpp's gpt2 tokenizer: one token (and type) per embedding row, plus merges/special ids/template."""

    tokens: list[str]
    types: list[int]
    pre: str
    special: gguf.SpecialVocab


def read_hparams(model_dir: Path) -> HParams:
    """Parse config.json; ValueError for an architecture, activation or RoPE scaling llama.cpp won't get here."""
    config = json.loads((model_dir / "config.json").read_text())
    archs = config.get("architectures") or [config.get("model_type", "<none>")]
    if archs[0] not in ARCHITECTURES:
        raise ValueError(
            f"GGUF export: unsupported architecture {archs[0]!r} in {model_dir / 'config.json'}; "
            f"supported: {', '.join(ARCHITECTURES)}"
        )
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"GGUF export: hidden_act {config['hidden_act']!r} is not supported (llama.cpp: silu)")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    arch = ARCHITECTURES[archs[0]]
    if rope_type not in ("default", "linear") and (rope_type, arch) != ("llama3", gguf.MODEL_ARCH.LLAMA):
        raise ValueError(
            f"GGUF export: RoPE scaling {rope_type!r} is not supported (default, linear; llama3 for Llama)"
        )
    n_embd, n_head = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or n_embd // n_head
    rope_theta = float(config.get("rope_theta") or rope.get("rope_theta") or 10000.0)
    return HParams(
        arch=arch,
        n_layer=config["num_hidden_layers"],
        n_embd=n_embd,
        n_ff=config["intermediate_size"],
        n_head=n_head,
        n_head_kv=config.get("num_key_value_heads") or n_head,
        head_dim=head_dim,
        n_ctx=config["max_position_embeddings"],
        n_vocab=config["vocab_size"],
        rms_eps=config.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        rope_linear_factor=float(rope["factor"]) if rope_type == "linear" else None,
        tied=bool(config.get("tie_word_embeddings", False)),
        rope_freqs=llama3_rope_factors(rope, rope_theta, head_dim) if rope_type == "llama3" else None,
    )


def llama3_rope_factors(rope: dict, theta: float, head_dim: int) -> np.ndarray:
    """rope_freqs.weight for Llama 3.1+ RoPE: per frequency, the divisor llama.cpp applies (as the converter)."""
    factor, low, high = rope.get("factor", 8.0), rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old_ctx = rope.get("original_max_position_embeddings", 8192)
    wavelen = 2 * np.pi * theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)
    smooth = (old_ctx / wavelen - low) / (high - low)
    mid = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < old_ctx / high, 1.0, np.where(wavelen > old_ctx / low, factor, mid)).astype(np.float32)


def pre_tokenizer_name(tokenizer: dict) -> str:
    """llama.cpp's name for the pre-tokenizer of a tokenizer.json (its Split regex, or GPT-2's ByteLevel regex)."""
    pre = tokenizer.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    for step in steps:
        if step.get("type") == "Split" and "Regex" in step.get("pattern", {}):
            regex = step["pattern"]["Regex"]
            if regex in PRE_TOKENIZERS:
                return PRE_TOKENIZERS[regex]
            raise ValueError(
                f"GGUF export: unknown pre-tokenizer regex {regex!r}: llama.cpp would split text differently "
                f"(known: {', '.join(PRE_TOKENIZERS.values())}, gpt-2)"
            )
    if any(s.get("type") == "ByteLevel" and s.get("use_regex", True) for s in steps):
        return "gpt-2"
    raise ValueError(f"GGUF export: cannot tell the pre-tokenizer from {pre!r}")


def load_vocab(model_dir: Path, n_vocab: int) -> Vocab:
    """Tokens and types for every embedding row ([PAD<i>] for rows the tokenizer does not use)."""
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"GGUF export: {path} not found (a fast byte-level BPE tokenizer is needed)")
    tokenizer = json.loads(path.read_text(encoding="utf-8"))
    model = tokenizer.get("model", {})
    decoder = tokenizer.get("decoder") or {}
    if model.get("type") != "BPE" or model.get("byte_fallback") or decoder.get("type") != "ByteLevel":
        raise ValueError(
            "GGUF export: only byte-level BPE tokenizers (llama.cpp 'gpt2') are supported, not "
            f"{model.get('type')} with a {decoder.get('type')} decoder (e.g. SentencePiece)"
        )
    reverse = {i: t for t, i in model["vocab"].items()}
    added = {a["id"]: a for a in tokenizer.get("added_tokens", [])}
    reverse.update({i: a["content"] for i, a in added.items()})
    if max(reverse) >= n_vocab:
        raise ValueError(f"GGUF export: tokenizer has id {max(reverse)} but the embedding has only {n_vocab} rows")
    tokens, types = [], []
    for i in range(n_vocab):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(TokenType.UNUSED)
            continue
        tokens.append(reverse[i])
        if i in added:
            token = reverse[i]
            special = added[i].get("special") or (token.startswith("<|") and token.endswith("|>"))
            types.append(TokenType.CONTROL if special else TokenType.USER_DEFINED)
        else:
            types.append(TokenType.NORMAL)
    special = gguf.SpecialVocab(model_dir, load_merges=True, n_vocab=n_vocab)
    return Vocab(tokens=tokens, types=[int(t) for t in types], pre=pre_tokenizer_name(tokenizer), special=special)


def permute(weights: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: HF rotate-half rows -> llama.cpp interleaved pairs, per head."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def hf_tensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the folder's safetensors files (one or several shards), by HF name."""
    from safetensors import safe_open

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"GGUF export: no *.safetensors in {model_dir}")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def gguf_tensors(model_dir: Path, hp: HParams) -> Iterator[tuple[str, np.ndarray]]:
    """(GGUF name, float32 array) for every tensor llama.cpp loads, Llama q/k permuted, tied head dropped."""
    names = gguf.get_tensor_name_map(hp.arch, hp.n_layer)
    has_head = False
    for name, tensor in hf_tensors(model_dir):
        if name.endswith("rotary_emb.inv_freq"):
            continue
        if name == "lm_head.weight":
            if hp.tied:
                continue
            has_head = True
        new_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if new_name is None:
            raise ValueError(f"GGUF export: no llama.cpp name for tensor {name!r} ({hp.arch.name})")
        data = tensor.to(torch.float32).numpy()
        if hp.arch == gguf.MODEL_ARCH.LLAMA:
            if name.endswith(("q_proj.weight", "q_proj.bias")):
                data = permute(data, hp.n_head, hp.n_head)
            elif name.endswith(("k_proj.weight", "k_proj.bias")):
                data = permute(data, hp.n_head, hp.n_head_kv)
        yield new_name, np.ascontiguousarray(data)
    if not hp.tied and not has_head:
        raise ValueError(f"GGUF export: tie_word_embeddings is false but {model_dir} has no lm_head.weight")
    if hp.rope_freqs is not None:
        yield gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight", hp.rope_freqs


def tensor_qtype(gguf_name: str, n_dims: int, out_type: str) -> QType:
    """The converter's rule: 1-D tensors, norms and biases stay f32; the other weights take ``out_type``."""
    if n_dims <= 1 or gguf_name.endswith("_norm.weight") or not gguf_name.endswith(".weight"):
        return QType.F32
    return OUT_TYPES[out_type][0]


def encode(data: np.ndarray, qtype: QType) -> tuple[np.ndarray, QType]:
    """Quantize/cast with gguf.quants; a shape q8_0 cannot take (row length % 32) falls back to f16."""
    try:
        return gguf.quants.quantize(data, qtype), qtype
    except gguf.QuantError as e:
        log.warning("%s: falling back to F16", e)
        return gguf.quants.quantize(data, QType.F16), QType.F16


def add_metadata(writer: gguf.GGUFWriter, hp: HParams, vocab: Vocab, out_type: str, name: str) -> None:
    """Architecture hyperparameters and the gpt2 tokenizer, under the keys llama.cpp reads."""
    writer.add_type("model")
    writer.add_name(name)
    writer.add_context_length(hp.n_ctx)
    writer.add_embedding_length(hp.n_embd)
    writer.add_block_count(hp.n_layer)
    writer.add_feed_forward_length(hp.n_ff)
    writer.add_head_count(hp.n_head)
    writer.add_head_count_kv(hp.n_head_kv)
    if hp.head_dim != hp.n_embd // hp.n_head:
        writer.add_key_length(hp.head_dim)
        writer.add_value_length(hp.head_dim)
    writer.add_rope_dimension_count(hp.head_dim)
    writer.add_rope_freq_base(hp.rope_theta)
    if hp.rope_linear_factor is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(hp.rope_linear_factor)
    writer.add_layer_norm_rms_eps(hp.rms_eps)
    writer.add_vocab_size(hp.n_vocab)
    writer.add_file_type(OUT_TYPES[out_type][1])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.types)
    vocab.special.add_to_gguf(writer, quiet=True)  # merges, bos/eos/pad ids, add_*_token, chat template
    if "bos" not in vocab.special.add_special_token:
        writer.add_add_bos_token(False)


def write_gguf(
    model_dir: str | Path, out_path: Path, out_type: str, quantize_timeout_s: float = QUANTIZE_TIMEOUT_S
) -> dict:
    """Convert the HF causal LM in ``model_dir`` into ``out_path`` as ``out_type`` (see ``GGUF_TYPES``).

    Returns a summary (path, type, architecture, tensors, bytes, vocab, pre-tokenizer, seconds). Raises
    ValueError for an unknown type or an unsupported model, GGUFUnavailable for q4_k_m without llama.cpp;
    both before any file is written; QuantizeError when llama-quantize fails or runs past ``quantize_timeout_s``.
    The written file is read back with gguf.GGUFReader (tensor names)."""
    t0 = time.perf_counter()
    model_dir, out_path = Path(model_dir), Path(out_path)
    if out_type not in GGUF_TYPES:
        raise ValueError(f"GGUF export: unknown type {out_type!r}; supported: {', '.join(GGUF_TYPES)}")
    hp = read_hparams(model_dir)
    vocab = load_vocab(model_dir, hp.n_vocab)
    if out_type in LLAMA_QUANTIZE_TYPES:
        return quantize_with_llama_cpp(model_dir, out_path, out_type, t0, quantize_timeout_s)

    writer = gguf.GGUFWriter(path=None, arch=gguf.MODEL_ARCH_NAMES[hp.arch], use_temp_file=True)
    add_metadata(writer, hp, vocab, out_type, model_dir.name)
    written: dict[str, str] = {}
    for name, data in gguf_tensors(model_dir, hp):
        data, qtype = encode(data, tensor_qtype(name, data.ndim, out_type))
        writer.add_tensor(name, data, raw_dtype=qtype)
        written[name] = qtype.name

    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(out_path.name + ".tmp")
    try:
        writer.write_header_to_file(tmp)
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
    reader = gguf.GGUFReader(tmp)
    got = {t.name: t.tensor_type.name for t in reader.tensors}
    del reader
    if got != written:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"GGUF export: {tmp} reads back other tensors than were written")
    tmp.replace(out_path)
    return {
        "path": str(out_path),
        "type": out_type,
        "architecture": gguf.MODEL_ARCH_NAMES[hp.arch],
        "tensors": len(written),
        "bytes": out_path.stat().st_size,
        "vocab_size": hp.n_vocab,
        "pre_tokenizer": vocab.pre,
        "seconds": time.perf_counter() - t0,
    }


def llama_cpp_module():
    """llama-cpp-python's ``llama_cpp`` module (the opt-in ``llamacpp`` extra), or None when it does not import."""
    try:
        import llama_cpp
    except (ImportError, OSError):  # OSError: the package is there but its shared library does not load
        return None
    return llama_cpp


def llama_quantize_binary() -> str | None:
    """Path of llama.cpp's llama-quantize on PATH, or None."""
    return shutil.which("llama-quantize")


def quantize_in_process(llama_cpp, src: Path, dst: Path, out_type: str) -> None:
    """llama.cpp's own quantizer through its C API: ``llama_model_quantize(src, dst, params)`` with the
    default params (all cores, k-quant mixes as llama-quantize) and ``ftype = LLAMA_FTYPE_MOSTLY_<TYPE>``."""
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{LLAMA_QUANTIZE_TYPES[out_type]}")
    llama_log = logging.getLogger("llama-cpp-python")  # llama.cpp's log goes to stderr below this level
    level = llama_log.level
    llama_log.setLevel(logging.ERROR)  # a line per tensor otherwise; the summary lists the types chosen
    try:
        rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    finally:
        llama_log.setLevel(level)
    if rc != 0:
        raise RuntimeError(f"llama.cpp llama_model_quantize({src} -> {out_type}) failed with status {rc}")


def run_llama_quantize(binary: str, src: Path, dst: Path, out_type: str, timeout_s: float) -> None:
    """``llama-quantize SRC DST TYPE`` as a child process, stopped after ``timeout_s`` seconds; QuantizeError
    naming the command, its exit code (or the timeout) and the last lines of its stderr."""
    cmd = [binary, str(src), str(dst), LLAMA_QUANTIZE_TYPES[out_type]]
    shown = " ".join(cmd)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        raise QuantizeError(
            f"GGUF {out_type}: `{shown}` did not finish within {timeout_s:g} s (export.quantize_timeout_s) and was "
            f"stopped{_tail(e.stderr)}"
        ) from None
    except OSError as e:  # not executable, a missing interpreter
        raise QuantizeError(f"GGUF {out_type}: `{shown}` could not start: {e.strerror or e}") from None
    if proc.returncode != 0:
        raise QuantizeError(f"GGUF {out_type}: `{shown}` exited with code {proc.returncode}{_tail(proc.stderr)}")


def _tail(stderr: str | bytes | None, lines: int = 5) -> str:
    text = stderr.decode(errors="replace") if isinstance(stderr, bytes) else (stderr or "")
    last = [line for line in text.strip().splitlines() if line.strip()][-lines:]
    return f"; its stderr ends: {' | '.join(last)[-1000:]}" if last else "; no stderr"


def quantize_with_llama_cpp(
    model_dir: Path, out_path: Path, out_type: str, t0: float, timeout_s: float = QUANTIZE_TIMEOUT_S
) -> dict:
    """``q4_k_m`` & co: write a 16-bit GGUF next to ``out_path`` and quantize it with llama.cpp, in process
    (llama-cpp-python) or with ``llama-quantize`` on PATH (stopped after ``timeout_s``)."""
    lib = llama_cpp_module()
    binary = None if lib is not None else llama_quantize_binary()
    if lib is None and binary is None:
        raise GGUFUnavailable(
            f"GGUF {out_type} is not available: it needs llama.cpp, either llama-cpp-python "
            "(pip install -e '.[llamacpp]') or llama.cpp's llama-quantize on PATH (neither found). "
            f"Use one of {', '.join(OUT_TYPES)}, or quantize the f16 GGUF yourself."
        )
    config = json.loads((model_dir / "config.json").read_text())
    src_type = "bf16" if (config.get("dtype") or config.get("torch_dtype")) == "bfloat16" else "f16"
    src = out_path.with_name(f"{out_path.stem}.{src_type}-source.gguf")
    tmp = out_path.with_name(out_path.name + ".tmp")
    try:
        write_gguf(model_dir, src, src_type)
        if lib is not None:
            quantize_in_process(lib, src, tmp, out_type)
        else:
            run_llama_quantize(binary, src, tmp, out_type, timeout_s)
        tmp.replace(out_path)
    finally:
        src.unlink(missing_ok=True)
        tmp.unlink(missing_ok=True)
    reader = gguf.GGUFReader(out_path)
    types: dict[str, int] = {}
    for t in reader.tensors:
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
    summary = {"path": str(out_path), "type": out_type, "tensors": len(reader.tensors), "tensor_types": types}
    del reader
    if not any(t.endswith("_K") for t in types):
        log.warning(
            "GGUF %s: no row length is a multiple of 256 (a k-quant block): llama.cpp wrote %s instead",
            out_type,
            ", ".join(f"{n} x {t}" for t, n in sorted(types.items())),
        )
    summary["quantizer"] = "llama-cpp-python" if lib is not None else binary
    return {**summary, "bytes": out_path.stat().st_size, "seconds": time.perf_counter() - t0}
