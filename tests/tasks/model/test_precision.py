import pytest
import torch

from grpoflow.tasks.config import ModelConfig, TinyModelConfig
from grpoflow.tasks.model.loading import add_lora, compute_dtype, load_trainable
from grpoflow.tasks.model.precision import (
    ALLOW_SLOW_BF16_ENV,
    SDPA_FLOAT32,
    check_cpu_bf16,
    cpu_bf16_slowdown,
    lora_autocast_dtype,
    sdpa_float32,
    train_precision,
    use_float32_attention,
)
from grpoflow.tasks.model.tiny import build_tiny_model, train_tiny_tokenizer

TEXTS = ["What is 12 + 345?", "<reasoning>\n12 + 345 = 357\n</reasoning>\n<answer>\n357\n</answer>"] * 20
SMALL = TinyModelConfig(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
)


def tiny_lora(dtype: torch.dtype):
    tok = train_tiny_tokenizer(TEXTS, 300)
    model = build_tiny_model(SMALL, tok, seed=0).to(dtype)
    torch.manual_seed(1)  # the adapters' initialisation
    model = add_lora(model, ModelConfig(lora={"r": 4, "alpha": 8, "target_modules": "all-linear"}).lora)
    for name, p in model.named_parameters():  # B starts at zero: give the adapters an effect to compare
        if "lora_B" in name:
            p.data.normal_(0, 0.2)
    return tok, model


def batch():
    ids = torch.randint(3, 290, (3, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # a left-padded row
    return ids, mask


def adapter_grads(model, autocast):
    model.zero_grad(set_to_none=True)
    ids, mask = batch()
    with train_precision(model, "cpu", autocast):
        logits = model(input_ids=ids, attention_mask=mask).logits
    logits.float().log_softmax(-1)[mask.bool()].mean().backward()
    return logits.float(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def test_autocast_dtype_only_for_lora_over_a_bf16_base():
    assert lora_autocast_dtype("bfloat16", use_lora=True, load_in_4bit=False) == torch.bfloat16
    assert lora_autocast_dtype("float32", use_lora=True, load_in_4bit=False) is None
    assert lora_autocast_dtype("bfloat16", use_lora=False, load_in_4bit=False) is None
    assert lora_autocast_dtype("bfloat16", use_lora=True, load_in_4bit=True) is None
    # full fine-tuning in bf16 keeps its own autocast (float32 master weights)
    assert compute_dtype(ModelConfig(dtype="bfloat16"), use_lora=False) == torch.bfloat16
    assert compute_dtype(ModelConfig(dtype="bfloat16"), use_lora=True) == torch.bfloat16
    assert compute_dtype(ModelConfig(dtype="float32"), use_lora=True) is None


def test_bf16_lora_passes_keep_float32_adapters_and_match_float32_training():
    _, ref = tiny_lora(torch.float32)
    for p in ref.parameters():  # the bf16 base's weights, computed in float32: the reference of the arithmetic
        if not p.requires_grad:
            p.data = p.data.to(torch.bfloat16).float()
    ref_logits, ref_grads = adapter_grads(ref, None)
    _, model = tiny_lora(torch.float32)
    for p in model.parameters():  # the same adapters over a bf16 base
        if not p.requires_grad:
            p.data = p.data.to(torch.bfloat16)
    logits, grads = adapter_grads(model, torch.bfloat16)
    assert logits.dtype == torch.float32
    assert all(g is not None and g.dtype == torch.float32 for g in grads.values())
    assert all(p.dtype == torch.float32 for p in model.parameters() if p.requires_grad)
    # bf16 arithmetic: close to float32's, not equal
    assert (logits - ref_logits).abs().max() < 0.03  # logits up to 0.45
    assert not torch.equal(logits, ref_logits)
    for name, g in grads.items():  # measured: 1-2% relative
        rel = (g - ref_grads[name]).norm() / ref_grads[name].norm().clamp_min(1e-12)
        assert rel < 0.06, name


def test_peft_input_casting_is_off_inside_and_restored_after():
    _, model = tiny_lora(torch.bfloat16)
    layers = [m for m in model.modules() if hasattr(m, "cast_input_dtype_enabled")]
    assert layers and all(m.cast_input_dtype_enabled for m in layers)
    with train_precision(model, "cpu", torch.bfloat16):
        assert not any(m.cast_input_dtype_enabled for m in layers)
        assert torch.is_autocast_enabled("cpu")
    assert all(m.cast_input_dtype_enabled for m in layers)
    with train_precision(model, "cpu", None):  # float32: nothing changes
        assert all(m.cast_input_dtype_enabled for m in layers)
        assert not torch.is_autocast_enabled("cpu")


@pytest.mark.parametrize("masked", [False, True])
def test_sdpa_float32_is_float32_attention_returned_in_the_query_dtype(masked):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    _, model = tiny_lora(torch.bfloat16)
    attn = next(m for m in model.modules() if type(m).__name__.endswith("Attention"))
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 6, 8, generator=g)
    k, v = torch.randn(2, 2, 6, 8, generator=g), torch.randn(2, 2, 6, 8, generator=g)
    mask = None
    if masked:  # a causal boolean mask with the first key of row 0 padded away
        mask = torch.ones(2, 1, 6, 6, dtype=torch.bool).tril()
        mask[0, :, :, 0] = False
        mask[0, :, 0, 0] = True
    ref, _ = sdpa_attention_forward(attn, q, k, v, mask, is_causal=mask is None)
    out, _ = sdpa_float32(attn, q.bfloat16(), k.bfloat16(), v.bfloat16(), mask, is_causal=mask is None)
    assert out.dtype == torch.bfloat16
    assert (out.float() - ref).abs().max() < 0.05
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast would put SDPA back in bf16: it is off inside
        again, _ = sdpa_float32(attn, q.bfloat16(), k.bfloat16(), v.bfloat16(), mask, is_causal=mask is None)
    assert torch.equal(again, out)


def test_float32_attention_only_for_bf16_training_on_the_cpu():
    _, model = tiny_lora(torch.bfloat16)
    base = model.get_base_model()
    assert not use_float32_attention(model, torch.device("cpu"), computes_bf16=False)
    assert not use_float32_attention(model, torch.device("cuda"), computes_bf16=True)
    assert base.config._attn_implementation == "sdpa"
    ids, mask = batch()
    with torch.no_grad():
        before = model(input_ids=ids, attention_mask=mask).logits.float()
    assert use_float32_attention(model, torch.device("cpu"), computes_bf16=True)
    assert base.config._attn_implementation == SDPA_FLOAT32
    with torch.no_grad():
        after = model(input_ids=ids, attention_mask=mask).logits.float()
    valid = mask.bool()
    assert (after - before)[valid].abs().max() < 0.1  # the same model up to bf16 rounding of the attention
    assert not use_float32_attention(model, torch.device("cpu"), computes_bf16=True)  # already switched


def test_load_trainable_in_bf16_on_the_cpu_trains_with_float32_attention(tmp_path):
    tok = train_tiny_tokenizer(TEXTS, 300)
    build_tiny_model(SMALL, tok, seed=0).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    cfg = ModelConfig(name=str(tmp_path), dtype="bfloat16", lora={"r": 4, "alpha": 8})
    model = load_trainable(str(tmp_path), cfg, use_lora=True)
    assert model.get_base_model().config._attn_implementation == SDPA_FLOAT32
    assert model.get_base_model().dtype == torch.bfloat16
    f32 = load_trainable(str(tmp_path), cfg.model_copy(update={"dtype": "float32"}), use_lora=True)
    assert f32.get_base_model().config._attn_implementation == "sdpa"


def test_cpu_bf16_slowdown_is_a_measured_ratio():
    slowdown = cpu_bf16_slowdown()
    assert 0 < slowdown < 1e4 and slowdown == cpu_bf16_slowdown()  # measured once a process


def test_bf16_training_is_refused_on_a_cpu_whose_bf16_matmuls_are_too_slow(monkeypatch):
    """The measured slowdown against the limit: every CPU is too slow for a limit of 0 (the error names the
    setting and the fix), none for an infinite one; a GPU, float32 training and the override skip the check."""
    monkeypatch.delenv(ALLOW_SLOW_BF16_ENV, raising=False)
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match=r"^model.dtype=bfloat16: this CPU has no fast bfloat16 matrix path") as e:
        check_cpu_bf16(cpu, True, "model.dtype=bfloat16", limit=0.0)
    assert "x as long as a float32 one here (measured now)" in str(e.value)
    assert f"set model.dtype=float32 (or {ALLOW_SLOW_BF16_ENV}=1" in str(e.value)
    check_cpu_bf16(cpu, True, "model.dtype=bfloat16", limit=float("inf"))
    check_cpu_bf16(cpu, False, "model.dtype=float32", limit=0.0)
    check_cpu_bf16(torch.device("cuda", 0), True, "model.dtype=bfloat16", limit=0.0)
    monkeypatch.setenv(ALLOW_SLOW_BF16_ENV, "1")
    check_cpu_bf16(cpu, True, "model.dtype=bfloat16", limit=0.0)


def test_load_trainable_checks_the_cpu_before_training_in_bf16(tmp_path, monkeypatch):
    """load_trainable of a bf16 model on this CPU: refused exactly when this CPU's measured bf16 slowdown is over
    the limit (an AVX2-only CPU: about 60x), else loaded."""
    from grpoflow.tasks.model import precision

    monkeypatch.delenv(ALLOW_SLOW_BF16_ENV, raising=False)
    tok = train_tiny_tokenizer(TEXTS, 300)
    build_tiny_model(SMALL, tok, seed=0).save_pretrained(tmp_path)
    cfg = ModelConfig(name=str(tmp_path), dtype="bfloat16", lora={"r": 4, "alpha": 8})
    if cpu_bf16_slowdown() > precision.MAX_CPU_BF16_SLOWDOWN:
        with pytest.raises(ValueError, match="model.dtype=bfloat16: this CPU has no fast bfloat16"):
            load_trainable(str(tmp_path), cfg, use_lora=True)
    else:
        assert load_trainable(str(tmp_path), cfg, use_lora=True).get_base_model().dtype == torch.bfloat16
    monkeypatch.setattr(precision, "MAX_CPU_BF16_SLOWDOWN", 0.0)  # any CPU over the limit: refused, loudly
    with pytest.raises(ValueError, match="model.dtype=bfloat16: this CPU has no fast bfloat16"):
        load_trainable(str(tmp_path), cfg, use_lora=True)
