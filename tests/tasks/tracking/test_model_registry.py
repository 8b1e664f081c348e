"""Registered exports load from the registry (a real `mlflow server`): an adapter-only export is registered as
MLflow's transformers flavour with its peft adapter, and ``models:/NAME/VERSION`` gives the same logits and the
same greedy answer as the merged export of the same adapter, with the workspace (base, adapter, merged folders)
gone. An adapter on a hub base (a hub cache written here, the hub offline) registers the repo and commit, no base
weights, and loads to the base-plus-adapter's logits and answer."""

import shutil
from pathlib import Path

import mlflow.artifacts
import mlflow.pyfunc
import mlflow.transformers
import pytest
import torch
import yaml
from mlflow.tracking import MlflowClient
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpoflow.tasks.config import load_config
from grpoflow.tasks.stages.common import base_model_path
from grpoflow.tasks.stages.data import prepare_data
from grpoflow.tasks.stages.export import run_export
from grpoflow.tasks.storage.workspace import Workspace
from grpoflow.tasks.tracking.model_registry import log_adapter_model
from grpoflow.tasks.tracking.registry import register_pipeline_model
from grpoflow.tasks.tracking.tracker import RunLogger
from tests.adapters import save_trained_adapter
from tests.hub_cache import offline_hub, write_hub_cache
from tests.paths import MICRO

NAME = "grpoflow-adapter-registry-test"
SETTINGS = [
    "export.gguf=[]",
    "export.merged_dtype=float32",  # the merged reference in the adapter's dtype: equal logits up to float error
    "grpo.max_completion_length=12",
    "eval.max_new_tokens=12",
    f"tracking.registered_model={NAME}",
]
HUB_REPO = "grpoflow-test/tiny-base"  # the tiny base as a hub repo, in a hub cache the test writes
PROMPT = "<|im_start|>user\nWhat is 7 + 5?<|im_end|>\n<|im_start|>assistant\n"


def logits(model, tokenizer, prompt: str) -> torch.Tensor:
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        return model(input_ids=ids).logits[0].float()


def greedy_answer(model, tokenizer, prompt: str, max_new_tokens: int) -> str:
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(input_ids=ids, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def trained_adapter(cfg, base: str, out: Path) -> Path:
    """A LoRA adapter on ``base`` with non-zero updates, as GRPO leaves them (it changes the logits), saved with the
    tokenizer at ``out``. Seeded (peft draws lora_A from torch's global generator): the same adapter whichever
    test ran before, one whose greedy answer on PROMPT is not whitespace alone (the tiny base is untrained: its
    answers are noise, for most seeds newlines, which the pyfunc's strip leaves empty)."""
    return save_trained_adapter(cfg, base, out, init_seed=5)


def test_adapter_export_registers_a_model_that_loads_and_matches_the_merged_one(mlflow_server, tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)  # what models:/ URIs resolve against
    cfg = load_config(MICRO, SETTINGS)
    ws = Workspace(tmp_path / "ws")
    prepare_data(cfg, ws)
    base = base_model_path(cfg, ws)
    trained = trained_adapter(cfg, base, tmp_path / "trained-adapter")
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


def test_an_adapter_on_a_hub_base_registers_the_repo_and_commit_and_loads_offline(mlflow_server, tmp_path, monkeypatch):
    """The hub-id path with no hub: the tiny base is written into a hub cache as ``HUB_REPO`` and the hub is
    offline. The registered model names the repo and the commit the run pinned (main has moved on since), holds no
    base weights, and loads (base and tokenizer from the cache) to the logits and greedy answer of the base with
    the adapter applied by peft."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    name = f"{NAME}-hub"
    cfg = load_config(MICRO, [*SETTINGS, f"tracking.registered_model={name}"])
    ws = Workspace(tmp_path / "ws")
    prepare_data(cfg, ws)
    base = base_model_path(cfg, ws)
    adapter = trained_adapter(cfg, base, tmp_path / "trained-adapter")
    cache = tmp_path / "hf" / "hub"
    commit = write_hub_cache(cache, HUB_REPO, Path(base))
    offline_hub(monkeypatch, cache)

    tokenizer = AutoTokenizer.from_pretrained(HUB_REPO)
    hub_base = AutoModelForCausalLM.from_pretrained(HUB_REPO)
    base_logits = logits(hub_base, tokenizer, PROMPT)
    direct = PeftModel.from_pretrained(hub_base, adapter).eval()
    direct_logits = logits(direct, tokenizer, PROMPT)
    assert (direct_logits - base_logits).abs().max() > 1e-2  # the adapter is not a no-op
    direct_answer = greedy_answer(direct, tokenizer, PROMPT, cfg.eval.max_new_tokens)

    client = MlflowClient(mlflow_server)
    exp = client.create_experiment("adapter-hub-registry-test")
    parent, run = (client.create_run(exp).info.run_id for _ in range(2))
    export = {"adapter_path": str(adapter), "base_model": HUB_REPO, "mlflow_run_id": run}
    grown = Path(shutil.copytree(adapter, tmp_path / "adapter-with-a-new-token"))
    grown_tokenizer = AutoTokenizer.from_pretrained(grown)
    grown_tokenizer.add_tokens(["<tool>"])
    grown_tokenizer.save_pretrained(grown)
    with pytest.raises(ValueError, match=f"tokenizer in {grown} has a vocabulary other than {HUB_REPO}@{commit}"):
        log_adapter_model(client, run, str(grown), HUB_REPO, name, PROMPT, 4)  # it would load the hub's tokenizer
    # a push to the repo after the run pinned its commit (model.revision): the base stays the commit it trained on
    (tmp_path / "pushed").mkdir()
    (tmp_path / "pushed" / "config.json").write_text("{}")
    assert write_hub_cache(cache, HUB_REPO, tmp_path / "pushed") != commit
    pinned = cfg.model_copy(update={"model": cfg.model.model_copy(update={"name": HUB_REPO, "revision": commit})})
    reg = register_pipeline_model(client, pinned, parent, export, None, None)
    shutil.rmtree(tmp_path / "ws")  # the base folder the cache was written from: only the hub cache holds it now
    shutil.rmtree(adapter)

    uri = f"models:/{name}/{reg.version}"
    saved = Path(mlflow.artifacts.download_artifacts(uri, dst_path=str(tmp_path / "registered")))
    flavour = yaml.safe_load((saved / "MLmodel").read_text())["flavors"]["transformers"]
    assert (flavour["source_model_name"], flavour["source_model_revision"]) == (HUB_REPO, commit)
    assert (flavour["tokenizer_name"], flavour["tokenizer_revision"]) == (HUB_REPO, commit)
    assert "model_binary" not in flavour and "local_base_model_path" not in flavour
    files = sorted(str(f.relative_to(saved)) for f in saved.rglob("*") if f.is_file())
    assert [f for f in files if f.endswith(".safetensors")] == ["peft/adapter_model.safetensors"], files
    assert not (saved / "model").exists()  # no base weights: the base is the hub's, at the commit

    components = mlflow.transformers.load_model(uri, return_type="components")
    assert isinstance(components["model"], PeftModel)
    torch.testing.assert_close(logits(components["model"], components["tokenizer"], PROMPT), direct_logits)
    answer = mlflow.pyfunc.load_model(uri).predict([PROMPT])
    assert direct_answer.strip() and answer == [direct_answer.strip()]  # mlflow strips the pipeline's answer


def test_a_hub_base_neither_reachable_nor_cached_is_refused_by_name(mlflow_server, tmp_path, monkeypatch):
    offline_hub(monkeypatch, tmp_path / "hf" / "hub")
    client = MlflowClient(mlflow_server)
    run = client.create_run(client.create_experiment("adapter-hub-refused")).info.run_id
    (tmp_path / "adapter_config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="base model grpoflow-test/not-cached is neither a local folder"):
        log_adapter_model(client, run, str(tmp_path), "grpoflow-test/not-cached", NAME, "q", 4)


def test_a_champion_registered_as_an_adapter_warm_starts_as_base_plus_adapter(mlflow_server, tmp_path, monkeypatch):
    """The continuous flow's champion download (tasks/ops/continuous.py champion_model) of an adapter-only export
    (export.merged: false): the registered MLflow model holds the base under model/ and the adapter under peft/, and
    the folder GRPO warm-starts from is the two merged, with the logits of the base with the adapter applied."""
    from grpoflow.tasks.ops.continuous import champion_model

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    name = f"{NAME}-champion"
    cfg = load_config(MICRO, [*SETTINGS, f"tracking.registered_model={name}", f"tracking.uri={mlflow_server}"])
    ws = Workspace(tmp_path / "ws")
    prepare_data(cfg, ws)
    base = base_model_path(cfg, ws)
    adapter = trained_adapter(cfg, base, tmp_path / "trained-adapter")
    tokenizer = AutoTokenizer.from_pretrained(adapter)
    base_model = AutoModelForCausalLM.from_pretrained(base)
    base_logits = logits(base_model, tokenizer, PROMPT)
    direct_logits = logits(PeftModel.from_pretrained(base_model, adapter).eval(), tokenizer, PROMPT)
    assert (direct_logits - base_logits).abs().max() > 1e-2  # the adapter is not a no-op

    client = MlflowClient(mlflow_server)
    exp = client.create_experiment("champion-adapter")
    parent, run = (client.create_run(exp).info.run_id for _ in range(2))
    export = {"adapter_path": str(adapter), "base_model": base, "mlflow_run_id": run}
    assert register_pipeline_model(client, cfg, parent, export, {"accuracy_after": 0.5}, None).promoted  # the first
    folder, info = champion_model(cfg, tmp_path / "champion")
    assert info["name"] == name and not (Path(folder) / "adapter_config.json").exists()
    champion = AutoModelForCausalLM.from_pretrained(folder)
    torch.testing.assert_close(logits(champion, AutoTokenizer.from_pretrained(folder), PROMPT), direct_logits)
