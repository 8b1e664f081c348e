"""run.device and the training precision: resolution, clear refusals, and what bf16 means for LoRA and full
fine-tuning (run on the CPU, where torch.autocast to bfloat16 works as on a GPU)."""

import ast

import pytest
import torch

from grpoflow.tasks.config import GRPOConfig, ModelConfig, PipelineConfig
from grpoflow.tasks.model.device import activate_device, model_device, resolve_device, select_device
from grpoflow.tasks.model.loading import load_trainable, train_dtypes
from tests.paths import MICRO, REPO
from tests.tasks.grpo.test_trainer import make, make_trainer


def test_resolve_device_on_a_machine_without_a_gpu():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto") == (torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
    if not torch.cuda.is_available():
        for spec in ("cuda", "cuda:1"):
            with pytest.raises(ValueError, match=r"run.device: 'cuda.*torch sees none"):
                resolve_device(spec)
    with pytest.raises(ValueError, match="run.device: 'gpu'"):
        resolve_device("gpu")


def test_activate_device_makes_a_gpu_current_and_leaves_the_cpu_alone():
    """The seam of run.device=cuda:N (only a GPU runs torch.cuda.set_device): the setter it is given is called with
    that GPU; a bare cuda gets the current GPU's index; the CPU sets nothing."""
    calls = []
    assert activate_device(torch.device("cuda", 1), calls.append) == torch.device("cuda", 1)
    assert calls == [torch.device("cuda", 1)]
    assert activate_device(torch.device("cuda"), calls.append, current_index=lambda: 3) == torch.device("cuda", 3)
    assert calls[-1] == torch.device("cuda", 3)
    calls.clear()
    assert activate_device(torch.device("cpu"), calls.append) == torch.device("cpu")
    assert select_device("cpu", calls.append) == torch.device("cpu")
    assert select_device("cpu", calls.append, local_rank=1) == torch.device("cpu")  # gloo on CPU processes
    assert calls == []
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="run.device: 'cuda:1'"):
            select_device("cuda:1", calls.append)
        assert calls == []  # refused before anything is set


STAGES = REPO / "tasks" / "stages"
LOADERS = {"load_trainable", "load_causal_lm", "load_with_adapter"}


def calls_in(tree: ast.AST) -> list[ast.Call]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)]


def test_every_stage_that_loads_a_model_selects_its_device():
    """A stage module that loads a model onto a device (a loader called with device=, positionally for
    load_trainable) takes that device from select_device (which makes it the current CUDA device), never from
    resolve_device alone."""
    computing = {}
    for path in sorted(STAGES.glob("*.py")):
        calls = calls_in(ast.parse(path.read_text()))
        onto_device = [
            c
            for c in calls
            if c.func.id in LOADERS
            and (any(k.arg == "device" for k in c.keywords) or (c.func.id == "load_trainable" and len(c.args) > 3))
        ]
        if onto_device:
            computing[path.stem] = {c.func.id for c in calls}
    assert {"sft", "grpo_setup", "evaluate"} <= computing.keys()  # grpo loads its policy in grpo_setup.py
    for stage, calls in computing.items():
        assert "select_device" in calls and "resolve_device" not in calls, stage


def test_config_checks_device_and_refuses_float16_training():
    assert PipelineConfig().run.device == "auto"
    assert PipelineConfig.model_validate({"run": {"device": "cuda:3"}}).run.device == "cuda:3"
    with pytest.raises(ValueError, match="run.device"):
        PipelineConfig.model_validate({"run": {"device": "gpu0"}})
    with pytest.raises(ValueError, match="model.dtype=float16.*bfloat16"):
        PipelineConfig.model_validate({"model": {"dtype": "float16"}})


def test_train_dtypes():
    bf16 = ModelConfig(dtype="bfloat16")
    assert train_dtypes(bf16, use_lora=True) == (None, None)  # bf16 base, float32 adapters
    assert train_dtypes(bf16, use_lora=False) == (torch.float32, torch.bfloat16)  # float32 master, bf16 autocast
    assert train_dtypes(ModelConfig(), use_lora=False) == (None, None)  # the CPU default: float32, no autocast


@pytest.fixture(scope="module")
def saved_tiny(tmp_path_factory):
    tok, model = make(lora=False)
    path = tmp_path_factory.mktemp("tiny") / "model"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def test_lora_in_bfloat16_keeps_float32_adapters(saved_tiny):
    cfg = ModelConfig(dtype="bfloat16")
    model = load_trainable(saved_tiny, cfg.model_copy(update={"lora": cfg.lora.model_copy(update={"r": 4})}), True)
    trainable = {p.dtype for p in model.parameters() if p.requires_grad}
    frozen = {p.dtype for p in model.parameters() if not p.requires_grad}
    assert trainable == {torch.float32} and frozen == {torch.bfloat16}
    assert model_device(model) == torch.device("cpu")


def test_full_fine_tuning_in_bfloat16_autocasts_over_float32_weights(saved_tiny, tmp_path):
    """Float32 master weights, bf16 matmuls in the forward passes (a hook sees the projections' outputs), and a
    GRPO optimizer step that changes the float32 weights."""
    from grpoflow.tasks.model.loading import load_tokenizer

    mcfg = ModelConfig(dtype="bfloat16")
    model = load_trainable(saved_tiny, mcfg, use_lora=False)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    _, autocast_dtype = train_dtypes(mcfg, use_lora=False)
    seen = []
    model.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    tok = load_tokenizer(saved_tiny, mcfg)
    cfg = GRPOConfig(max_steps=1, per_device_train_batch_size=4, num_generations=4, max_completion_length=8)
    trainer = make_trainer(cfg, tok, model, tmp_path, autocast_dtype=autocast_dtype)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    torch.manual_seed(0)  # the completions, so the round's rewards differ whatever ran before in this process
    trainer.train()
    assert trainer.history[-1]["reward_std"] > 0  # a gradient to step on
    assert torch.bfloat16 in seen  # the training forward ran under autocast
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters())
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert trainer.history[-1]["loss"] == trainer.history[-1]["loss"]  # not NaN


FULL_BF16_KL = ["model.lora.enabled=false", "export.adapter=false", "model.dtype=bfloat16", "grpo.beta=0.04"]


def test_grpo_stage_keeps_the_reference_model_in_the_training_dtype(tmp_path):
    """Full fine-tuning in bf16 with beta > 0: the policy trains float32 master weights under bf16 autocast, and its
    frozen reference is loaded in bf16, the dtype its forward runs in (half the memory of a float32 copy)."""
    from grpoflow.tasks.config import load_config
    from grpoflow.tasks.stages.data import prepare_data
    from grpoflow.tasks.stages.grpo import run_grpo
    from grpoflow.tasks.storage.workspace import Workspace
    from grpoflow.tasks.tracking.tracker import RunLogger

    cfg = load_config(MICRO, [*FULL_BF16_KL, "grpo.max_steps=1", "generation.backend=transformers"])
    ws = Workspace(tmp_path / "ws")
    prepare_data(cfg, ws)
    summary = run_grpo(cfg, ws, RunLogger.disabled())
    assert summary["steps"] == 1 and summary["reference_dtype"] == "bfloat16"
    import json

    history = [json.loads(line) for line in (ws.stage_dir("grpo") / "history.jsonl").read_text().splitlines()]
    # the reference's log-probs entered the loss: at step 1 it holds the policy's weights, so its KL is bf16 rounding
    assert 0 < history[0]["kl"] < 1e-3


def test_reference_dtype():
    from grpoflow.tasks.config import load_config
    from grpoflow.tasks.stages.grpo_setup import reference_dtype

    assert reference_dtype(load_config(MICRO, FULL_BF16_KL)) == torch.bfloat16
    # TR-DPO moves the reference by alpha * (policy - ref) each sync: bf16 would round small moves away
    assert reference_dtype(load_config(MICRO, [*FULL_BF16_KL, "grpo.sync_ref_model=true"])) == torch.float32
    assert reference_dtype(load_config(MICRO, ["model.lora.enabled=false", "export.adapter=false"])) is None
