import torch

from grpoflow.tasks.config import ModelConfig, TinyModelConfig
from grpoflow.tasks.model.loading import add_lora, backbone_and_head, count_parameters
from grpoflow.tasks.model.tiny import build_tiny_model, ensure_base_model, train_tiny_tokenizer

TEXTS = ["What is 12 + 345?", "<reasoning>\n12 + 345 = 357\n</reasoning>\n<answer>\n357\n</answer>"] * 20


def tiny(tmp_cfg=None):
    tok = train_tiny_tokenizer(TEXTS, 300)
    cfg = tmp_cfg or TinyModelConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1
    )
    return tok, build_tiny_model(cfg, tok, seed=0)


def test_tokenizer_digits_are_single_tokens_and_round_trip():
    tok = train_tiny_tokenizer(TEXTS, 300)
    pieces = tok.tokenize("x 12345 y")
    assert [p for p in pieces if p.isdigit()] == list("12345")
    text = "<reasoning>\n1 + 2 = 3\n</reasoning>"
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text


def test_chat_template_and_special_tokens():
    tok = train_tiny_tokenizer(TEXTS, 300)
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    ids = tok(rendered, add_special_tokens=False)["input_ids"]
    assert tok.convert_tokens_to_ids("<|im_start|>") in ids and tok.eos_token_id in ids


def test_tiny_model_is_seeded_and_llama_builds_too():
    tok, a = tiny()
    _, b = tiny()
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
    llama = build_tiny_model(
        TinyModelConfig(
            architecture="llama",
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
        ),
        tok,
        seed=0,
    )
    assert llama.config.model_type == "llama"
    assert llama.config.vocab_size == len(tok)


def test_backbone_and_head_reproduce_the_logits_with_and_without_lora():
    tok, model = tiny()
    ids = torch.tensor([tok("What is 1 + 2?")["input_ids"]])
    full = model(input_ids=ids).logits
    body, head = backbone_and_head(model)
    torch.testing.assert_close(head(body(input_ids=ids).last_hidden_state), full)
    peft_model = add_lora(model, ModelConfig().lora.model_copy(update={"target_modules": "all-linear"}))
    trainable, total = count_parameters(peft_model)
    assert 0 < trainable < total
    body, head = backbone_and_head(peft_model)
    torch.testing.assert_close(head(body(input_ids=ids).last_hidden_state), peft_model(input_ids=ids).logits)


def test_a_tiny_model_build_killed_mid_write_is_built_again(tmp_path, monkeypatch):
    """The weights' write fails half-way (a kill, a full disk): the next run builds the model again and it loads.
    Saved in place, config.json was already there and every later run took the cut folder for built."""
    import pytest
    import transformers.modeling_utils as mu
    from transformers import AutoModelForCausalLM

    real_save = mu.safe_save_file

    def cut(tensors, filename, *args, **kwargs):
        open(filename, "wb").write(b"\0" * 100)
        raise OSError("killed mid-write")

    cfg = ModelConfig(
        name="tiny",
        tiny=TinyModelConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1
        ),
    )
    out = tmp_path / "base_model"
    out.mkdir()
    monkeypatch.setattr(mu, "safe_save_file", cut)
    with pytest.raises(OSError, match="killed mid-write"):
        ensure_base_model(cfg, TEXTS, out, seed=0)
    assert not (out / "config.json").exists()
    monkeypatch.setattr(mu, "safe_save_file", real_save)
    path = ensure_base_model(cfg, TEXTS, out, seed=0)
    assert AutoModelForCausalLM.from_pretrained(path).config.hidden_size == 32
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []


def test_lora_target_modules_that_match_no_module_are_found_before_any_stage(tmp_path):
    """From the weights' names alone (safetensors headers; for model.tiny its architectures' layers): model.tiny,
    and a local folder. Before, peft refused the names in the GRPO stage, after SFT, without naming the key."""
    from grpoflow.tasks.config import config_from_dict
    from grpoflow.tasks.model.targets import TINY_LINEAR, lora_target_problem

    for arch in ("llama", "qwen2"):  # the constant is what the tiny architectures hold
        _, built = tiny(TinyModelConfig(architecture=arch, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1))  # fmt: skip
        linear = {n.rsplit(".", 1)[-1] for n, m in built.named_modules() if isinstance(m, torch.nn.Linear)}
        assert linear == set(TINY_LINEAR), arch

    small = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
             "num_key_value_heads": 1}  # fmt: skip

    def cfg(name="tiny", **lora):
        export = {} if lora.get("enabled", True) else {"adapter": False}
        return config_from_dict({"model": {"name": name, "tiny": small, "lora": lora}, "export": export})

    assert lora_target_problem(cfg()) is None  # the defaults: q/k/v/o and the MLP
    problem = lora_target_problem(cfg(target_modules=["foo_proj", "q_proj"]))
    assert problem.startswith("model.lora.target_modules: 'foo_proj' match no module of model.tiny")
    assert "its linear layers are down_proj, gate_proj, k_proj" in problem
    assert lora_target_problem(cfg(target_modules="all-linear")) is None
    assert lora_target_problem(cfg(enabled=False, target_modules=["foo_proj"])) is None
    tok, model = tiny()
    model.save_pretrained(tmp_path / "local")
    assert lora_target_problem(cfg(str(tmp_path / "local"))) is None
    assert "of " + str(tmp_path / "local") + "'s weights" in lora_target_problem(
        cfg(str(tmp_path / "local"), target_modules=["c_attn"])
    )
