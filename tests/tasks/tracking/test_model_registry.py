"""Registered exports load from the registry (a real `mlflow server`): an adapter-only export is registered as
MLflow's transformers flavour with its peft adapter, and ``models:/NAME/VERSION`` gives the same logits and the
same greedy answer as the merged export of the same adapter, with the workspace (base, adapter, merged folders)
gone."""

import shutil

import mlflow.pyfunc
import mlflow.transformers
import pytest
import torch
from mlflow.tracking import MlflowClient
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpoflow.tasks.config import load_config
from grpoflow.tasks.model.loading import add_lora, load_causal_lm, load_tokenizer
from grpoflow.tasks.stages.common import base_model_path
from grpoflow.tasks.stages.data import prepare_data
from grpoflow.tasks.stages.export import run_export
from grpoflow.tasks.storage.workspace import Workspace
from grpoflow.tasks.tracking.model_registry import log_adapter_model
from grpoflow.tasks.tracking.registry import register_pipeline_model
from grpoflow.tasks.tracking.tracker import RunLogger
from tests.paths import MICRO

NAME = "grpoflow-adapter-registry-test"
SETTINGS = [
    "export.gguf=[]",
    "export.merged_dtype=float32",  # the merged reference in the adapter's dtype: equal logits up to float error
    "grpo.max_completion_length=12",
    "eval.max_new_tokens=12",
    f"tracking.registered_model={NAME}",
]
PROMPT = "<|im_start|>user\nWhat is 7 + 5?<|im_end|>\n<|im_start|>assistant\n"


def logits(model, tokenizer, prompt: str) -> torch.Tensor:
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        return model(input_ids=ids).logits[0].float()


def test_adapter_export_registers_a_model_that_loads_and_matches_the_merged_one(mlflow_server, tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)  # what models:/ URIs resolve against
    cfg = load_config(MICRO, SETTINGS)
    ws = Workspace(tmp_path / "ws")
    prepare_data(cfg, ws)
    base = base_model_path(cfg, ws)
    model = add_lora(load_causal_lm(base, cfg.model), cfg.model.lora)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # non-zero updates, as GRPO leaves: the adapter changes the logits
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=gen))
    trained = tmp_path / "trained-adapter"
    model.save_pretrained(trained)
    load_tokenizer(base, cfg.model).save_pretrained(trained)
    ex = run_export(cfg, ws, RunLogger.disabled(), base, str(trained), True)
    assert ex["base_model"] == base and "adapter_path" in ex and "merged_path" in ex

    tokenizer = AutoTokenizer.from_pretrained(ex["merged_path"])
    merged_logits = logits(AutoModelForCausalLM.from_pretrained(ex["merged_path"]), tokenizer, PROMPT)
    base_logits = logits(AutoModelForCausalLM.from_pretrained(base), tokenizer, PROMPT)
    assert (merged_logits - base_logits).abs().max() > 1e-2  # the adapter is not a no-op

    client = MlflowClient(mlflow_server)
    exp = client.create_experiment("adapter-registry-test")
    parent, adapter_run, merged_run = (client.create_run(exp).info.run_id for _ in range(3))
    adapter_only = {"adapter_path": ex["adapter_path"], "base_model": base, "mlflow_run_id": adapter_run}
    merged_only = {"merged_path": ex["merged_path"], "mlflow_run_id": merged_run}
    adapter_reg = register_pipeline_model(client, cfg, parent, adapter_only, None, None)
    merged_reg = register_pipeline_model(client, cfg, parent, merged_only, None, None)
    assert adapter_reg.name == merged_reg.name == NAME
    version = client.get_model_version(NAME, adapter_reg.version)
    assert version.run_id == adapter_run and not version.source.endswith("/adapter")  # an MLflow model, not the folder
    shutil.rmtree(tmp_path / "ws")  # base, adapter and merged folders: the registry must hold what loading needs
    shutil.rmtree(trained)

    uri = f"models:/{NAME}/{adapter_reg.version}"
    components = mlflow.transformers.load_model(uri, return_type="components")
    assert isinstance(components["model"], PeftModel)  # the adapter, applied on the base at load time
    registered_logits = logits(components["model"], components["tokenizer"], PROMPT)
    torch.testing.assert_close(registered_logits, merged_logits, atol=1e-4, rtol=1e-4)

    adapter_answer = mlflow.pyfunc.load_model(uri).predict([PROMPT])
    merged_answer = mlflow.pyfunc.load_model(f"models:/{NAME}/{merged_reg.version}").predict([PROMPT])
    assert len(adapter_answer) == 1 and adapter_answer[0].strip()  # a generated answer, not an empty one
    assert adapter_answer == merged_answer


def test_an_adapter_folder_without_its_config_is_refused_by_name(mlflow_server, tmp_path):
    client = MlflowClient(mlflow_server)
    run = client.create_run(client.create_experiment("adapter-refused")).info.run_id
    with pytest.raises(FileNotFoundError, match=f"adapter_config.json in the exported adapter folder {tmp_path}"):
        log_adapter_model(client, run, str(tmp_path), "missing-base", NAME, "q", 4)
