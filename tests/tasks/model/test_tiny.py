import torch

from grpoflow.tasks.config import ModelConfig, TinyModelConfig
from grpoflow.tasks.model.loading import add_lora, backbone_and_head, count_parameters
from grpoflow.tasks.model.tiny import build_tiny_model, train_tiny_tokenizer

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
