"""QLoRA on CPU: a 4-bit NF4 base (bitsandbytes) with LoRA adapters trains with GRPO and 8-bit AdamW,
and the stages around it (eval on the 4-bit model, export merged into the full-precision base) work."""

import warnings
from pathlib import Path

import bitsandbytes as bnb
import pytest
import torch
import transformers.modeling_utils

from grpoflow.tasks.config import GRPOConfig, ModelConfig, load_config
from grpoflow.tasks.model.loading import load_trainable
from grpoflow.tasks.runtime.tracking import RunLogger
from grpoflow.tasks.runtime.workspace import Workspace
from grpoflow.tasks.stages.data import prepare_data
from grpoflow.tasks.stages.evaluate import run_eval
from grpoflow.tasks.stages.export import run_export
from grpoflow.tasks.stages.grpo import run_grpo
from grpoflow.tasks.stages.sft import run_sft
from tests.tasks.test_grpo_trainer import make, make_trainer

MICRO = Path(__file__).parents[1] / "fixtures" / "micro.yaml"


def test_4bit_base_with_lora_trains_with_8bit_adamw(tmp_path):
    tok, model = make(lora=False)
    model.save_pretrained(tmp_path / "base")
    tok.save_pretrained(tmp_path / "base")
    cfg = ModelConfig(name=str(tmp_path / "base"), load_in_4bit=True)
    cfg = cfg.model_copy(update={"lora": cfg.lora.model_copy(update={"r": 64, "target_modules": "all-linear"})})
    qmodel = load_trainable(str(tmp_path / "base"), cfg, use_lora=True)

    quantized = {n: m for n, m in qmodel.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
    assert len(quantized) == 14  # q, k, v, o, gate, up, down in each of the 2 layers
    assert all(m.weight.dtype == torch.uint8 and m.weight.quant_type == "nf4" for m in quantized.values())
    # bitsandbytes' AVX512-BF16 CPU path (bf16 compute, weights repacked in place) is off: compute stays float32
    assert not any(getattr(m, "support_avx512bf16_for_cpu", False) for m in quantized.values())
    base_bytes = {n: m.weight.detach().clone() for n, m in quantized.items()}
    lora_before = {n: p.detach().clone() for n, p in qmodel.named_parameters() if p.requires_grad}
    assert lora_before and all("lora_" in n for n in lora_before)

    g = GRPOConfig(
        max_steps=2,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=1,
        num_generations=4,
        max_completion_length=6,
        learning_rate=1e-2,
        optim="adamw_8bit",
        save_steps=100,
    )
    trainer = make_trainer(g, tok, qmodel, tmp_path / "ckpt")
    result = trainer.train()

    assert result["steps"] == 2 and all(torch.isfinite(torch.tensor(h["loss"])) for h in trainer.history)
    assert isinstance(trainer.optimizer, bnb.optim.AdamW8bit)
    states = [s for s in trainer.optimizer.state.values() if "state1" in s]
    assert any(s["state1"].dtype == torch.uint8 for s in states)  # 8-bit moments for tensors >= 4096 elements
    changed = [n for n, p in qmodel.named_parameters() if p.requires_grad and not torch.equal(p, lora_before[n])]
    assert changed
    for n, m in quantized.items():
        assert torch.equal(m.weight, base_bytes[n]), n  # the 4-bit base is frozen


def save_tiny_base(tmp_path) -> str:
    tok, model = make(lora=False)
    model.save_pretrained(tmp_path / "base")
    tok.save_pretrained(tmp_path / "base")
    return str(tmp_path / "base")


def test_4bit_gradient_checkpointing_stays_non_reentrant(tmp_path, monkeypatch):
    """The flag torch receives. gradient_checkpointing_enable binds ``checkpoint`` (modeling_utils' import of
    torch.utils.checkpoint.checkpoint) and the kwargs it is given into a functools.partial that every decoder layer
    calls in a training forward. Replacing that name before the model is loaded puts a recorder inside the partial:
    it sees the keyword arguments each layer's call to torch's checkpoint carries, then runs the real one. peft's
    prepare_model_for_kbit_training re-enabled checkpointing with ``{}``: the recorder then saw no use_reentrant
    and torch fell back to the reentrant variant with a warning."""
    calls = []
    real = torch.utils.checkpoint.checkpoint

    def recording(fn, *args, **kwargs):
        calls.append(kwargs.get("use_reentrant", "not passed"))
        return real(fn, *args, **kwargs)

    monkeypatch.setattr(transformers.modeling_utils, "checkpoint", recording)
    base = save_tiny_base(tmp_path)
    cfg = ModelConfig(name=base, load_in_4bit=True, gradient_checkpointing=True)
    model = load_trainable(base, cfg, use_lora=True)
    assert any(isinstance(m, bnb.nn.Linear4bit) for m in model.modules())
    ids = torch.randint(3, 200, (2, 12))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(input_ids=ids, labels=ids).loss.backward()
    assert calls == [False, False]  # one call per decoder layer, each non-reentrant
    assert not [w for w in caught if "use_reentrant" in str(w.message)]
    grads = [p.grad for n, p in model.named_parameters() if "lora_B" in n]  # lora_A: zero until B moves
    assert grads and all(g is not None and torch.count_nonzero(g) > 0 for g in grads)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_4bit_base_keeps_model_dtype_outside_its_4bit_layers(tmp_path, dtype):
    """peft's prepare_model_for_kbit_training would cast embeddings, head and norms to float32 (loading.py's
    prepare_4bit_base says why grpoflow keeps them in model.dtype); the adapters are float32 either way."""
    base = save_tiny_base(tmp_path)
    model = load_trainable(base, ModelConfig(name=base, load_in_4bit=True, dtype=dtype), use_lora=True)
    inner = model.get_base_model()
    assert inner.get_input_embeddings().weight.dtype == getattr(torch, dtype)
    assert inner.get_output_embeddings().weight.dtype == getattr(torch, dtype)
    norms = {n: p.dtype for n, p in model.named_parameters() if "norm" in n}
    assert norms and set(norms.values()) == {getattr(torch, dtype)}
    lora = {p.dtype for n, p in model.named_parameters() if "lora_" in n}
    assert lora == {torch.float32}
    assert all(p.requires_grad == ("lora_" in n) for n, p in model.named_parameters())
    ids = torch.randint(3, 200, (2, 10))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss)


def test_qlora_pipeline_stages(tmp_path):
    cfg = load_config(
        MICRO,
        [
            "model.load_in_4bit=true",
            "grpo.optim=adamw_8bit",
            "grpo.max_steps=2",
            "sft.max_steps=4",
            "eval.max_samples=4",
        ],
    )
    ws = Workspace(tmp_path / "ws")
    off = RunLogger.disabled()
    prepare_data(cfg, ws)
    sft = run_sft(cfg, ws, off)
    grpo = run_grpo(cfg, ws, off, init_model=sft["model_path"])
    assert grpo["adapter"] and grpo["steps"] == 2
    ev = run_eval(cfg, ws, off, grpo["base_model"], grpo["model_path"], grpo["adapter"])
    assert 0.0 <= ev["accuracy_after"] <= 1.0
    ex = run_export(cfg, ws, off, grpo["base_model"], grpo["model_path"], grpo["adapter"])
    assert ex["verify_matches"] == ex["verify_prompts"] == 2  # merged fp16 = full-precision base + adapter
