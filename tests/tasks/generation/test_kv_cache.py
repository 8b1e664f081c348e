"""The decoding loop's in-place KV cache against transformers' concatenating DynamicCache."""

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

import grpoflow.tasks.generation.transformers_loop as loop
from grpoflow.tasks.config import TinyModelConfig
from grpoflow.tasks.generation.kv_cache import PreallocatedLayer, decode_cache
from grpoflow.tasks.generation.types import SamplingParams, left_pad
from grpoflow.tasks.model.tiny import build_tiny_model, train_tiny_tokenizer

TEXTS = ["What is 3 + 4?", "<reasoning>\n3 + 4 = 7\n</reasoning>\n<answer>\n7\n</answer>"] * 20


def model_and_prompts():
    tok = train_tiny_tokenizer(TEXTS, 280)
    cfg = TinyModelConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1
    )
    model = build_tiny_model(cfg, tok, seed=3).eval()
    prompts = [tok(t)["input_ids"] for t in ("What is 3 + 4?", "7", "<answer>", "3 + 4 = 7")] * 4
    return tok, model, prompts


def test_sampling_is_identical_to_the_concatenating_cache_with_rows_leaving(monkeypatch):
    """Seeded sampling, an EOS that ends some rows early (they leave the batch and the cache): every token,
    log-prob, length and stop flag equals what DynamicCache gives."""
    tok, model, prompts = model_and_prompts()
    ids, mask = left_pad(prompts, tok.pad_token_id)
    p = SamplingParams(max_new_tokens=12, temperature=1.0)
    seeds = list(range(len(prompts)))
    free = loop.sample(model, ids, mask, p, len(tok) + 7, seeds)[0]
    eos = int(free[:, 3].mode().values)  # a token several rows draw early: they stop, the batch compacts
    ours = loop.sample(model, ids, mask, p, eos, seeds)
    monkeypatch.setattr(loop, "decode_cache", lambda config, extra: DynamicCache(config=config))
    ref = loop.sample(model, ids, mask, p, eos, seeds)
    assert 0 < int(ours[3].sum()) < len(prompts), "the EOS must end some rows and not others"
    for a, b in zip(ours, ref, strict=True):
        assert torch.equal(a, b)


def test_layer_views_match_concatenation_and_regrow_past_their_room():
    torch.manual_seed(0)
    layer, ref = PreallocatedLayer(extra=2), DynamicLayer()
    for t in (5, 1, 1, 1, 1, 3):  # a prompt, steps, then more than the room left: the buffers regrow
        k, v = torch.randn(3, 2, t, 4), torch.randn(3, 2, t, 4)
        got, want = layer.update(k, v), ref.update(k, v)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert layer.get_seq_length() == ref.get_seq_length()
    keep = torch.tensor([0, 2])
    layer.batch_select_indices(keep)
    ref.batch_select_indices(keep)
    k, v = torch.randn(2, 2, 1, 4), torch.randn(2, 2, 1, 4)
    got, want = layer.update(k, v), ref.update(k, v)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_only_plain_full_attention_layers_are_replaced():
    _, model, _ = model_and_prompts()
    cache = decode_cache(model.config, 8)
    assert [type(x) for x in cache.layers] == [PreallocatedLayer] * model.config.num_hidden_layers
    model.config.layer_types = ["sliding_attention", "full_attention"]
    model.config.sliding_window = 4
    cache = decode_cache(model.config, 8)
    assert type(cache.layers[0]) is not PreallocatedLayer and type(cache.layers[1]) is PreallocatedLayer


def test_crop_matches_dynamic_layer():
    torch.manual_seed(0)
    layer, ref = PreallocatedLayer(extra=4), DynamicLayer()
    k, v = torch.randn(2, 2, 6, 4), torch.randn(2, 2, 6, 4)
    layer.update(k, v)
    ref.update(k, v)
    for crop in (-2, 3):  # remove 2, then keep 3
        layer.crop(crop)
        ref.crop(crop)
        assert torch.equal(layer.keys, ref.keys) and torch.equal(layer.values, ref.values)
    k, v = torch.randn(2, 2, 1, 4), torch.randn(2, 2, 1, 4)
    got, want = layer.update(k, v), ref.update(k, v)
    assert torch.equal(got[0], want[0]) and layer.get_seq_length() == ref.get_seq_length() == 4
