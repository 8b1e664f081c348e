"""QLoRA on CPU: a 4-bit NF4 base (bitsandbytes) with LoRA adapters trains with GRPO and 8-bit AdamW,
and the stages around it (eval on the 4-bit model, export merged into the full-precision base) work."""

import json
import warnings
from pathlib import Path

import bitsandbytes as bnb
import pytest
import torch
import transformers.modeling_utils
from transformers import AutoModelForCausalLM

from grpoflow.tasks.config import GRPOConfig, ModelConfig, load_config
from grpoflow.tasks.model.loading import load_tokenizer, load_trainable, load_with_adapter
from grpoflow.tasks.model.verify import logprob_tolerance, teacher_forced
from grpoflow.tasks.stages.data import prepare_data
from grpoflow.tasks.stages.evaluate import run_eval
from grpoflow.tasks.stages.export import run_export
from grpoflow.tasks.stages.grpo import run_grpo
from grpoflow.tasks.stages.sft import run_sft
from grpoflow.tasks.storage.workspace import Workspace
from grpoflow.tasks.tracking.tracker import RunLogger
from tests.paths import MICRO
from tests.tasks.grpo.test_trainer import make, make_trainer


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
    """data -> SFT (LoRA on a 4-bit base) -> GRPO (4-bit) -> eval -> export: every saved model folder is a plain
    16-bit checkpoint, SFT's merge landed in the unquantized base, and the merged export matches base + adapter."""
    cfg = load_config(
        MICRO,
        [
            "model.load_in_4bit=true",
            "sft.use_lora=true",
            "grpo.optim=adamw_8bit",
            "grpo.max_steps=2",
            "grpo.learning_rate=1e-2",
            "grpo.reward_funcs=[tests.tasks.grpo.test_trainer:length]",  # spread: the adapter moves
            "sft.max_steps=4",
            "eval.max_samples=4",
        ],
    )
    ws = Workspace(tmp_path / "ws")
    off = RunLogger.disabled()
    prepare_data(cfg, ws)
    sft = run_sft(cfg, ws, off)
    configs = {p.parent.name: json.loads(p.read_text()) for p in Path(sft["model_path"]).parent.glob("*/config.json")}
    assert set(configs) == {"model"} and "quantization_config" not in configs["model"]

    # SFT merged into the float32 base: each targeted weight moved by a rank <= r update (B @ A), the rest is
    # untouched. A merge into the 4-bit copy would add NF4 rounding noise of full rank to every linear.
    base = AutoModelForCausalLM.from_pretrained(sft["base_model"]).state_dict()
    tuned = AutoModelForCausalLM.from_pretrained(sft["model_path"]).state_dict()
    assert tuned.keys() == base.keys() and all(tuned[k].dtype == torch.float32 for k in tuned)
    moved = [k for k in base if not torch.equal(base[k], tuned[k])]
    assert moved and all(k.endswith("proj.weight") for k in moved)
    for k in moved:
        sv = torch.linalg.svdvals((tuned[k] - base[k]).double())
        assert sv[cfg.model.lora.r] < 1e-5 * sv[0], k

    # GRPO quantizes the plain checkpoint itself (the load run_grpo makes)
    grpo_model = load_trainable(sft["model_path"], cfg.model, use_lora=True)
    assert any(isinstance(m, bnb.nn.Linear4bit) for m in grpo_model.modules())
    del grpo_model
    grpo = run_grpo(cfg, ws, off, init_model=sft["model_path"])
    assert grpo["adapter"] and grpo["steps"] == 2 and grpo["base_model"] == sft["model_path"]
    ev = run_eval(cfg, ws, off, grpo["base_model"], grpo["model_path"], grpo["adapter"])
    assert 0.0 <= ev["accuracy_after"] <= 1.0
    ex = run_export(cfg, ws, off, grpo["base_model"], grpo["model_path"], grpo["adapter"])
    assert ex["verify_prompts"] == 2 and ex["verify_tokens"] > 0
    assert ex["verify_max_logprob_gap"] <= ex["verify_tolerance"] == logprob_tolerance("float32", "float16")
    assert 0.0 <= ex["verify_greedy_agreement"] <= 1.0

    saved = list((tmp_path / "ws").rglob("config.json"))
    assert {p.parent for p in saved} >= {Path(sft["model_path"]), Path(ex["merged_path"])}
    assert not [p for p in saved if "quantization_config" in json.loads(p.read_text())]

    # independently of the stage: the merged float16 folder against the float32 base + the GRPO adapter
    trained = load_with_adapter(grpo["base_model"], grpo["model_path"], cfg.model, quantize=False)
    merged = AutoModelForCausalLM.from_pretrained(ex["merged_path"], dtype=torch.float16).eval()
    assert not getattr(merged, "is_loaded_in_4bit", False)
    tok = load_tokenizer(grpo["model_path"], cfg.model)
    ids = tok("<reasoning>3 + 4 = 7</reasoning><answer>7</answer>", add_special_tokens=False)["input_ids"]
    want, _ = teacher_forced(trained, ids[:3], ids[3:])
    got, _ = teacher_forced(merged, ids[:3], ids[3:])
    gap = float((want - got).abs().max())
    assert gap <= logprob_tolerance("float32", "float16")
    # and the GRPO adapter matters: without it the log-probs move by far more than that gap
    with trained.disable_adapter():
        bare, _ = teacher_forced(trained, ids[:3], ids[3:])
    assert float((bare - want).abs().max()) > 10 * max(gap, ex["verify_max_logprob_gap"])
