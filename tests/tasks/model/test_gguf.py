"""GGUF export (tasks/model/gguf.py): read back with gguf's own reader, and (opt-in) run by llama.cpp.

Tiny Qwen2/Llama models are built from config; every tensor of the GGUF is compared with the HF weights
(names mapped independently of gguf.TensorNameMap, Llama q/k un-permuted here by the inverse reshape)."""

import json
import os
import re
import stat
import time
from pathlib import Path

import datasets
import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config, GPT2LMHeadModel

from grpoflow.tasks.config import TinyModelConfig, load_config
from grpoflow.tasks.model import gguf as gguf_export
from grpoflow.tasks.model.gguf import GGUFUnavailable, encode, write_gguf
from grpoflow.tasks.model.tiny import build_tiny_model, train_tiny_tokenizer
from grpoflow.tasks.stages.export import run_export
from grpoflow.tasks.storage.workspace import Workspace
from grpoflow.tasks.tracking.tracker import RunLogger
from tests.paths import MICRO

TEXTS = [
    "What is 3 + 4?",
    "What is 13 - 17?",
    "<reasoning>\n13 - 17 = 13 - 10 - 7 = 3 - 7 = -4\n</reasoning>\n<answer>\n-4\n</answer>",
    "Answer in <answer></answer>.",
] * 20
LAYER_PARTS = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
TOP["lm_head.weight"] = "output.weight"


def llama_cpp_name(hf_name: str) -> str:
    """The name llama.cpp loads for an HF Llama/Qwen2 tensor (llama.cpp's src/llama-arch.cpp)."""
    if hf_name in TOP:
        return TOP[hf_name]
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)", hf_name)
    return f"blk.{m[1]}.{LAYER_PARTS[m[2]]}.{m[3]}"


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's permute: interleaved rope pairs back to HF's rotate-half halves, per head."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def save_tiny(path, arch="qwen2", tied=True, extra_rows=0, rope=None, **sizes):
    """A tiny model + tokenizer saved as the pipeline saves them; returns (tokenizer, model) in float32.

    ``rope``: RoPE scaling written to config.json (the returned model keeps default RoPE; reload it)."""
    tok = train_tiny_tokenizer(TEXTS, 300)
    dims = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    dims.update(num_key_value_heads=2, max_position_embeddings=256, **sizes)
    cfg = TinyModelConfig(architecture=arch, tie_word_embeddings=tied, **dims)
    model = build_tiny_model(cfg, tok, seed=0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():  # biases and norms too: nothing is left at 0 or 1
            p.add_(torch.randn(p.shape, generator=gen) * 0.02)
    if extra_rows:
        model.resize_token_embeddings(len(tok) + extra_rows, mean_resizing=False)
    if rope:
        model.config.rope_parameters = {"rope_theta": 10000.0, **rope}
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return tok, model.eval()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {
        (arch, tied): (root / f"{arch}-{tied}", *save_tiny(root / f"{arch}-{tied}", arch, tied))
        for arch in ("qwen2", "llama")
        for tied in (True, False)
    }


def field(reader, key):
    f = reader.get_field(key)
    return None if f is None else f.contents()


def tensor_values(t) -> np.ndarray:
    """A GGUF tensor as float32 in numpy (HF) order, dequantized."""
    return gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(int(d) for d in reversed(t.shape)))


@pytest.mark.parametrize("out_type", ["f32", "f16", "bf16", "q8_0"])
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_round_trip(models, tmp_path, arch, out_type):
    path, tok, model = models[(arch, True)]
    info = write_gguf(path, tmp_path / "m.gguf", out_type)
    r = gguf.GGUFReader(tmp_path / "m.gguf")
    cfg = model.config

    assert info["architecture"] == field(r, "general.architecture") == arch
    assert field(r, f"{arch}.attention.head_count") == 4 and field(r, f"{arch}.attention.head_count_kv") == 2
    assert field(r, f"{arch}.block_count") == 2 and field(r, f"{arch}.embedding_length") == 64
    assert field(r, f"{arch}.feed_forward_length") == 128 and field(r, f"{arch}.context_length") == 256
    assert field(r, f"{arch}.rope.freq_base") == cfg.rope_parameters["rope_theta"]
    assert field(r, f"{arch}.attention.layer_norm_rms_epsilon") == pytest.approx(cfg.rms_norm_eps)
    assert field(r, f"{arch}.vocab_size") == len(tok) == cfg.vocab_size
    assert field(r, "tokenizer.ggml.model") == "gpt2" and field(r, "tokenizer.ggml.pre") == "qwen2"
    assert field(r, "tokenizer.ggml.tokens") == tok.convert_ids_to_tokens(list(range(len(tok))))
    types = field(r, "tokenizer.ggml.token_type")
    specials = {tok.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")}
    assert {i for i, t in enumerate(types) if t == gguf.TokenType.CONTROL} == specials
    assert all(t == gguf.TokenType.NORMAL for i, t in enumerate(types) if i not in specials)
    merges = json.loads((path / "tokenizer.json").read_text())["model"]["merges"]
    assert field(r, "tokenizer.ggml.merges") == [" ".join(m) for m in merges]
    assert field(r, "tokenizer.ggml.eos_token_id") == tok.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    assert field(r, "tokenizer.ggml.padding_token_id") == tok.pad_token_id
    assert field(r, "tokenizer.ggml.add_bos_token") is False
    assert field(r, "tokenizer.chat_template") == tok.chat_template

    hf = {n: p.detach().numpy() for n, p in model.state_dict().items() if n != "lm_head.weight"}  # tied
    tensors = {t.name: t for t in r.tensors}
    assert set(tensors) == {llama_cpp_name(n) for n in hf} and "output.weight" not in tensors
    assert info["tensors"] == len(tensors)
    qtype = {"f32": Q.F32, "f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0}[out_type]
    for name, want in hf.items():
        t = tensors[llama_cpp_name(name)]
        assert tuple(int(d) for d in reversed(t.shape)) == want.shape, name
        got = tensor_values(t)
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            heads = 4 if ".q_proj." in name else 2
            assert not np.array_equal(got, want)  # stored permuted ...
            got = unpermute(got, heads)  # ... and the inverse gives HF's layout back
        if want.ndim == 1:  # norms and biases stay f32, exact
            assert t.tensor_type == Q.F32 and np.array_equal(got, want), name
            continue
        assert t.tensor_type == qtype, name
        if out_type == "f32":
            assert np.array_equal(got, want), name
        elif out_type in ("f16", "bf16"):  # exactly the round-to-nearest-even cast
            cast = torch.from_numpy(want).to(torch.float16 if out_type == "f16" else torch.bfloat16).float()
            assert np.array_equal(got, cast.numpy()), name
        else:  # q8_0: 32-value blocks, scale d = max|x|/127 in f16: error <= d/2 + 127 * f16 rounding of d
            blocks_max = np.abs(want.reshape(-1, 32)).max(axis=1, keepdims=True)
            err = np.abs(got - want).reshape(-1, 32)
            assert (err <= blocks_max / 127 * 0.57 + 1e-7).all(), name


def test_qwen2_keeps_biases_and_is_not_permuted(models, tmp_path):
    path, _, model = models[("qwen2", True)]
    write_gguf(path, tmp_path / "m.gguf", "f32")
    tensors = {t.name: t for t in gguf.GGUFReader(tmp_path / "m.gguf").tensors}
    sd = model.state_dict()
    for i in range(2):
        for p in ("q", "k", "v"):
            assert np.array_equal(
                tensor_values(tensors[f"blk.{i}.attn_{p}.bias"]),
                sd[f"model.layers.{i}.self_attn.{p}_proj.bias"].numpy(),
            )
        assert np.array_equal(
            tensor_values(tensors[f"blk.{i}.attn_q.weight"]), sd[f"model.layers.{i}.self_attn.q_proj.weight"].numpy()
        )


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_untied_head_is_written(models, tmp_path, arch):
    path, _, model = models[(arch, False)]
    write_gguf(path, tmp_path / "m.gguf", "f32")
    tensors = {t.name: t for t in gguf.GGUFReader(tmp_path / "m.gguf").tensors}
    head = model.lm_head.weight.detach().numpy()
    assert not np.array_equal(head, model.model.embed_tokens.weight.detach().numpy())
    assert np.array_equal(tensor_values(tensors["output.weight"]), head)


def test_extra_embedding_rows_get_pad_tokens(tmp_path):
    tok, model = save_tiny(tmp_path / "hf", extra_rows=5)
    write_gguf(tmp_path / "hf", tmp_path / "m.gguf", "f16")
    r = gguf.GGUFReader(tmp_path / "m.gguf")
    n = len(tok)
    tokens, types = field(r, "tokenizer.ggml.tokens"), field(r, "tokenizer.ggml.token_type")
    assert field(r, "qwen2.vocab_size") == len(tokens) == n + 5 == model.config.vocab_size
    assert tokens[n:] == [f"[PAD{i}]" for i in range(n, n + 5)] and set(types[n:]) == {gguf.TokenType.UNUSED}
    assert tokens[:n] == tok.convert_ids_to_tokens(list(range(n)))
    emb = {t.name: t for t in r.tensors}["token_embd.weight"]
    assert tuple(int(d) for d in reversed(emb.shape)) == (n + 5, 64)


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
LLAMA3_ROPE["original_max_position_embeddings"] = 128


def test_llama3_rope_scaling_is_written_as_rope_freqs(tmp_path):
    """llama.cpp divides each RoPE frequency by rope_freqs: default inv_freq / transformers' llama3 inv_freq."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    save_tiny(tmp_path / "hf", "llama", rope=LLAMA3_ROPE)
    write_gguf(tmp_path / "hf", tmp_path / "m.gguf", "q8_0")
    t = {t.name: t for t in gguf.GGUFReader(tmp_path / "m.gguf").tensors}["rope_freqs.weight"]
    config = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").config
    llama3, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    default = 1.0 / (10000.0 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    assert t.tensor_type == Q.F32
    np.testing.assert_allclose(tensor_values(t), (default / llama3).numpy(), rtol=1e-6)
    assert {1.0, 8.0} < set(tensor_values(t).tolist())  # some kept, some scaled, some smoothed
    save_tiny(tmp_path / "qwen", "qwen2", rope=LLAMA3_ROPE)
    with pytest.raises(ValueError, match="RoPE scaling 'llama3' is not supported"):
        write_gguf(tmp_path / "qwen", tmp_path / "q.gguf", "f16")


def test_q8_0_falls_back_to_f16_for_odd_rows():
    data = np.random.default_rng(0).standard_normal((4, 48)).astype(np.float32)
    out, qtype = encode(data, Q.Q8_0)
    assert qtype == Q.F16 and np.array_equal(out, data.astype(np.float16))


def test_unsupported_architecture_fails_before_writing(tmp_path):
    hf = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, n_positions=64, vocab_size=300)).save_pretrained(hf)
    train_tiny_tokenizer(TEXTS, 300).save_pretrained(hf)
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=r"unsupported architecture 'GPT2LMHeadModel'.*LlamaForCausalLM, Qwen2"):
        write_gguf(hf, out / "m.gguf", "f16")
    assert not out.exists()
    with pytest.raises(ValueError, match="unknown type 'q2'; supported: f32, f16, bf16, q8_0, q4_k_m"):
        write_gguf(hf, out / "m.gguf", "q2")
    assert not out.exists()


def test_q4_k_m_needs_llama_cpp(models, tmp_path, monkeypatch):
    path = models[("qwen2", True)][0]
    monkeypatch.setattr(gguf_export, "llama_cpp_module", lambda: None)
    monkeypatch.setattr(gguf_export, "llama_quantize_binary", lambda: None)
    with pytest.raises(GGUFUnavailable, match="q4_k_m is not available: it needs llama.cpp, either llama-cpp-py"):
        write_gguf(path, tmp_path / "out" / "m.gguf", "q4_k_m")
    assert not (tmp_path / "out").exists()


def test_q4_k_m_runs_llama_quantize_on_a_16_bit_gguf(models, tmp_path, monkeypatch):
    """A stand-in llama-quantize (copies its input, records its arguments): the plumbing around the binary,
    used when llama-cpp-python does not import."""
    path = models[("qwen2", True)][0]
    monkeypatch.setattr(gguf_export, "llama_cpp_module", lambda: None)
    fake = tmp_path / "bin" / "llama-quantize"
    fake.parent.mkdir()
    fake.write_text(f'#!/bin/sh\necho "$3" > {tmp_path}/args\ncp "$1" "$2"\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    info = write_gguf(path, tmp_path / "out" / "m.gguf", "q4_k_m")
    assert (tmp_path / "args").read_text().strip() == "Q4_K_M"
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["m.gguf"]  # source and temp files removed
    r = gguf.GGUFReader(tmp_path / "out" / "m.gguf")
    assert info["tensors"] == len(r.tensors) and field(r, "general.file_type") == gguf.LlamaFileType.MOSTLY_F16
    assert info["quantizer"] == str(fake)


@pytest.mark.parametrize("case", ["fails", "hangs"])
def test_a_failing_or_hung_llama_quantize_is_a_named_error(models, tmp_path, monkeypatch, case):
    """A real llama-quantize stand-in on PATH that exits 1 after writing to stderr, or sleeps past the timeout: a
    QuantizeError (an OSError, so the stage reports it in one line) naming the command, the exit code or the
    timeout, and the stderr's last lines; no file left behind."""
    path = models[("qwen2", True)][0]
    monkeypatch.setattr(gguf_export, "llama_cpp_module", lambda: None)
    fake = tmp_path / "bin" / "llama-quantize"
    fake.parent.mkdir()
    body = "echo 'llama_model_quantize: failed to quantize: unknown model arch' >&2; exit 1"
    fake.write_text("#!/bin/sh\n" + (body if case == "fails" else "echo 'loading model' >&2; exec sleep 30") + "\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    out = tmp_path / "out" / "m.gguf"
    t0 = time.monotonic()
    with pytest.raises(gguf_export.QuantizeError) as info:
        write_gguf(path, out, "q4_k_m", quantize_timeout_s=2)
    msg = str(info.value)
    assert msg.startswith(f"GGUF q4_k_m: `{fake} ") and " Q4_K_M`" in msg, msg
    if case == "fails":
        assert "exited with code 1; its stderr ends: llama_model_quantize: failed to quantize" in msg, msg
    else:
        assert "did not finish within 2 s (export.quantize_timeout_s)" in msg and "loading model" in msg, msg
        assert time.monotonic() - t0 < 20
    assert isinstance(info.value, OSError) and list(out.parent.iterdir()) == []


def test_export_stage_writes_and_lists_gguf(models, tmp_path, monkeypatch):
    path = models[("qwen2", True)][0]
    monkeypatch.setattr(gguf_export, "llama_cpp_module", lambda: None)
    monkeypatch.setattr(gguf_export, "llama_quantize_binary", lambda: None)
    cfg = load_config(MICRO, ["export.adapter=false", "export.verify_prompts=1", "export.gguf=[f16,q8_0,q4_k_m]"])
    ws = Workspace(tmp_path / "ws")
    rows = [{"prompt": [{"role": "user", "content": "What is 3 + 4?"}]}]
    datasets.Dataset.from_list(rows).save_to_disk(str(ws.root / "data" / "eval"))
    summary = run_export(cfg, ws, RunLogger.disabled(), str(path), str(path), is_adapter=False)
    gguf_dir = ws.root / "export" / "gguf"
    assert summary["gguf"] == {t: str(gguf_dir / f"model-{t}.gguf") for t in ("f16", "q8_0")}
    assert "llama-cpp-python" in summary["gguf_skipped"]["q4_k_m"]
    assert sorted(p.name for p in gguf_dir.iterdir()) == ["model-f16.gguf", "model-q8_0.gguf"]
    r = gguf.GGUFReader(gguf_dir / "model-f16.gguf")
    assert field(r, "general.file_type") == gguf.LlamaFileType.MOSTLY_F16 and len(r.tensors) == 2 + 2 * 12
    assert load_config(MICRO).export.gguf == ["f16"]  # the default: one f16 GGUF of the merged model


# --------------------------------------------------------------------------------------------
# llama.cpp itself (opt-in: pip install -e ".[llamacpp]"; pytest -m llamacpp)
# --------------------------------------------------------------------------------------------
PROMPTS = [
    [{"role": "user", "content": "What is 13 - 17?"}],
    [{"role": "system", "content": "Answer in <answer></answer>."}, {"role": "user", "content": "What is 3 + 4?"}],
    [{"role": "user", "content": "Grüße, was ist 7 + 8? 😀\n\n  ok"}],
]
GREEDY_TOKENS = 12


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    out = list(ids)
    with torch.no_grad():
        for _ in range(n):
            out.append(int(model(torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(ids) :]


@pytest.mark.llamacpp
@pytest.mark.parametrize("arch", ["qwen2", "llama", "llama-rope3"])
def test_llama_cpp_matches_transformers(tmp_path, arch):
    """Each GGUF (f32, f16, q8_0) in llama.cpp: the HF tokenizer's tokens on chat-templated prompts, logits
    within tolerance, the same greedy tokens as transformers (q8_0: up to near-ties within its tolerance).

    The KV cache is f32 (llama.cpp's default f16 cache alone moves f32 logits by ~3e-4 of their range); q8_0
    also quantizes activations to 8 bits in llama.cpp, hence its looser bound."""
    rope = LLAMA3_ROPE if arch == "llama-rope3" else None
    save_tiny(tmp_path / "hf", arch.split("-")[0], tied=arch == "qwen2", rope=rope, hidden_size=128)
    report = check_llama_cpp(
        tmp_path / "hf", tmp_path, {"f32": (1e-4, True), "f16": (5e-3, True), "q8_0": (5e-2, False)}
    )
    print(f"\n{arch}: {json.dumps(report, indent=1)}")


@pytest.mark.llamacpp
@pytest.mark.slow
def test_llama_cpp_matches_transformers_on_smollm2(tmp_path):
    """The real SmolLM2-135M-Instruct (the smollm2-135m-instruct alias, converted from its Q4_1 GGUF to a
    transformers folder), exported by our writer: llama.cpp tokenizes its ChatML prompts as the HF tokenizer
    does, and its greedy completions follow transformers' (f32: the same tokens; f16: each token transformers'
    argmax or within the f16 tolerance of it, as near-ties may flip)."""
    from grpoflow.tasks.model.sources import resolve_model

    folder = resolve_model("smollm2-135m-instruct", str(tmp_path / "models"))
    report = check_llama_cpp(Path(folder), tmp_path, {"f32": (1e-4, True), "f16": (5e-3, False)})
    print(f"\nSmolLM2-135M-Instruct: {json.dumps(report, indent=1)}")


def load_llama(llama_cpp, path: Path, **kw):
    """``llama_cpp.Llama`` on the GGUF at ``path``. A file with quantized tensors (Q8_0, Q4_K, ...) on a CPU with
    AMX (llama.cpp's system info says ``AMX_INT8 = 1``) loads with llama.cpp's extra buffer types off (its CLI's
    ``--no-repack``): llama-cpp-python 0.3.36's llama.cpp segfaults evaluating quantized tensors through them
    there, for files its own ``llama_model_quantize`` writes as well as ours (docs/export.md). F32/F16 files take
    the default path."""
    reader = gguf.GGUFReader(path)
    quantized = any(t.tensor_type not in (Q.F32, Q.F16, Q.BF16) for t in reader.tensors)
    del reader
    if not quantized or b"AMX_INT8 = 1" not in llama_cpp.llama_print_system_info():
        return llama_cpp.Llama(model_path=str(path), **kw)
    low = llama_cpp.llama_cpp
    default = low.llama_model_default_params

    def without_extra_buffers():
        params = default()
        params.use_extra_bufts = False
        return params

    low.llama_model_default_params = without_extra_buffers  # what Llama() starts its model parameters from
    try:
        return llama_cpp.Llama(model_path=str(path), **kw)
    finally:
        low.llama_model_default_params = default


def check_llama_cpp(hf_dir: Path, out_dir: Path, tolerance: dict[str, tuple[float, bool]]) -> dict[str, str]:
    """Write each GGUF type of ``tolerance`` ({type: (max |logit diff| / max |logit|, greedy exact)}) from the
    transformers folder and compare llama.cpp with transformers on PROMPTS: tokens, logits, greedy tokens.
    Greedy not exact: each token llama.cpp picks must be within twice the tolerance of transformers' best."""
    llama_cpp = pytest.importorskip("llama_cpp")
    hf_tok = AutoTokenizer.from_pretrained(hf_dir)
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    texts = [hf_tok.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in PROMPTS]
    prompts = [hf_tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    with torch.no_grad():
        ref_logits = [hf(torch.tensor([ids])).logits[0].numpy() for ids in prompts]
    ref_greedy = [hf_greedy(hf, ids, GREEDY_TOKENS) for ids in prompts]
    scale = max(np.abs(x).max() for x in ref_logits)
    report = {}
    for out_type, (tol, exact) in tolerance.items():
        path = out_dir / f"model-{out_type}.gguf"
        write_gguf(hf_dir, path, out_type)
        vocab = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
        for text, ids in zip(texts, prompts):
            assert vocab.tokenize(text.encode(), add_bos=False, special=True) == ids, (out_type, text)
        del vocab
        f32 = llama_cpp.GGML_TYPE_F32
        llm = load_llama(
            llama_cpp, path, n_ctx=256, n_batch=256, logits_all=True, type_k=f32, type_v=f32, verbose=False
        )
        assert llm.metadata["tokenizer.chat_template"] == hf_tok.chat_template
        diffs, agree = [], 0
        for ids, want, greedy in zip(prompts, ref_logits, ref_greedy):
            llm.reset()
            llm.eval(ids)
            diffs.append(float(np.abs(np.array(llm.scores[: len(ids)]) - want).max() / scale))
            out = []
            for _ in range(GREEDY_TOKENS):
                out.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
                llm.eval([out[-1]])
            agree += sum(a == b for a, b in zip(out, greedy))
            if exact:
                assert out == greedy, (out_type, out, greedy)
            else:  # each pick is transformers' argmax on llama.cpp's own sequence, or within tolerance of it
                with torch.no_grad():
                    lg = hf(torch.tensor([ids + out])).logits[0, len(ids) - 1 : -1]
                picked = lg.gather(1, torch.tensor(out)[:, None])[:, 0]
                assert (picked >= lg.max(-1).values - 2 * tol * scale).all(), (out, greedy)
        report[out_type] = f"logits max |diff| {max(diffs) * scale:.2e} ({max(diffs):.1e} of the range {scale:.2f}), "
        report[out_type] += f"greedy {agree}/{GREEDY_TOKENS * len(prompts)}"
        assert max(diffs) < tol, (out_type, diffs)
        del llm
    return report


def test_default_gguf_follows_the_merged_export():
    from pydantic import ValidationError

    from grpoflow.tasks.config import ExportConfig

    assert ExportConfig().gguf == ["f16"]
    assert ExportConfig(merged=False).gguf == []  # the default needs the merged folder: none without it
    with pytest.raises(ValidationError, match="gguf converts the merged model"):
        ExportConfig(merged=False, gguf=["q8_0"])


@pytest.mark.llamacpp
@pytest.mark.parametrize(
    ("hidden", "inner", "want_types"), [(256, 512, {"Q4_K", "Q6_K", "F32"}), (128, 384, {"Q5_0", "Q8_0", "F32"})]
)
def test_llama_cpp_q4_k_m(tmp_path, hidden, inner, want_types):
    """q4_k_m quantized in process by llama-cpp-python from the 16-bit GGUF: llama.cpp loads it, tokenizes as
    the HF tokenizer, and its logits stay close to transformers'. Hidden size 256 gets real k-quants (Q4_K,
    Q6_K for the output and some attn_v/ffn_down); 128 x 384, the default tiny model's, is not a multiple of 256,
    so llama.cpp falls back to Q5_0 / Q8_0 per tensor. 4-bit weights move near-tied logits: the bounds are on
    the error relative to the logit range and on how often the top-1 token agrees, not on exact tokens."""
    llama_cpp = pytest.importorskip("llama_cpp")
    save_tiny(tmp_path / "hf", "qwen2", tied=False, hidden_size=hidden, intermediate_size=inner)
    hf_tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    info = write_gguf(tmp_path / "hf", tmp_path / "model-q4_k_m.gguf", "q4_k_m")
    assert info["quantizer"] == "llama-cpp-python"
    assert set(info["tensor_types"]) == want_types
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "model-q4_k_m.gguf"]  # source GGUF removed
    r = gguf.GGUFReader(tmp_path / "model-q4_k_m.gguf")
    assert field(r, "general.file_type") == gguf.LlamaFileType.MOSTLY_Q4_K_M
    del r
    texts = [hf_tok.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in PROMPTS]
    prompts = [hf_tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    f32 = llama_cpp.GGML_TYPE_F32
    llm = load_llama(
        llama_cpp,
        tmp_path / "model-q4_k_m.gguf",
        n_ctx=256,
        n_batch=256,
        logits_all=True,
        type_k=f32,
        type_v=f32,
        verbose=False,
    )
    diffs, corrs, top1, positions, agree = [], [], 0, 0, 0
    for text, ids in zip(texts, prompts):
        assert llm.tokenize(text.encode(), add_bos=False, special=True) == ids, text
        with torch.no_grad():
            want = hf(torch.tensor([ids])).logits[0].numpy()
        llm.reset()
        llm.eval(ids)
        got = np.array(llm.scores[: len(ids)])
        diffs.append(np.abs(got - want).max() / np.abs(want).max())
        corrs.append(np.corrcoef(got.ravel(), want.ravel())[0, 1])
        top1 += int((got.argmax(-1) == want.argmax(-1)).sum())
        positions += len(ids)
        out = []
        for _ in range(GREEDY_TOKENS):
            out.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
            llm.eval([out[-1]])
        agree += sum(a == b for a, b in zip(out, hf_greedy(hf, ids, GREEDY_TOKENS)))
    del llm
    print(
        f"\nq4_k_m, hidden {hidden} ({info['tensor_types']}): logits max |diff| {max(diffs):.1e} of the range, "
        f"correlation >= {min(corrs):.4f}, "
        f"top-1 {top1}/{positions} prompt positions, greedy {agree}/{GREEDY_TOKENS * len(prompts)} tokens"
    )
    assert min(corrs) > 0.95
    assert max(diffs) < 0.4
    assert top1 / positions >= 0.7
