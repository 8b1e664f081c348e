"""End to end: the real Prefect flow on a micro config, logging to a real MLflow store."""

from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from flows.cli import main

MICRO = Path(__file__).parents[1] / "fixtures" / "micro.yaml"
STAGES = {"data", "sft", "grpo", "eval", "export"}


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs")
    assert main(["run", str(MICRO), f"run.output_dir={out}", "run.name=e2e"]) == 0
    return out


@pytest.mark.slow
def test_pipeline_writes_every_stage(finished_run):
    ws = finished_run / "e2e"
    for stage in STAGES:
        assert (ws / stage / "manifest.json").is_file(), stage
    assert yaml.safe_load((ws / "config.yaml").read_text())["grpo"]["max_steps"] == 3
    assert (ws / "export" / "adapter" / "adapter_model.safetensors").is_file()
    assert list((ws / "export" / "merged").glob("*.safetensors"))
    assert (ws / "eval" / "report.md").read_text().startswith("Evaluation on 8 held-out rows")


@pytest.mark.slow
def test_mlflow_layout(finished_run):
    client = MlflowClient(f"sqlite:///{finished_run / 'mlflow.db'}")
    exp = client.get_experiment_by_name("grpoflow")
    runs = client.search_runs([exp.experiment_id])
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert len(parents) == 1
    parent = parents[0]
    assert parent.info.status == "FINISHED"
    assert parent.data.tags["prefect_flow_run_id"]
    assert parent.data.params["grpo.loss_type"] == "dapo"
    assert "accuracy_after" in parent.data.metrics
    children = {
        r.data.tags["grpoflow.stage"]: r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id
    }
    assert set(children) == STAGES
    assert all(r.info.status == "FINISHED" for r in children.values())

    grpo = children["grpo"].info.run_id
    for key in (
        "rewards/correctness/mean",
        "rewards/proximity/std",
        "rewards/strict_format/mean",
        "reward",
        "loss",
        "completions/mean_length",
        "step_time",
        "entropy",
    ):
        history = client.get_metric_history(grpo, key)
        assert [m.step for m in history] == [1, 2, 3], key
    assert [m.step for m in client.get_metric_history(children["sft"].info.run_id, "loss")] == list(range(1, 21))
    grpo_art = {a.path for a in client.list_artifacts(grpo)}
    assert {"learning_curves.png", "history.jsonl", "completions"} <= grpo_art
    assert len(client.list_artifacts(grpo, "completions")) == 2  # steps 2 and 3 (log_completions_steps=2, last)
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert "config.yaml" in artifacts
    assert "report.json" in {a.path for a in client.list_artifacts(children["eval"].info.run_id)}
    export_art = {a.path for a in client.list_artifacts(children["export"].info.run_id)}
    assert {"adapter", "merged"} <= export_art
    # the merged model is registered (the local SQLite store has a registry too) and, the first, is champion
    champion = client.get_model_version_by_alias("grpoflow-tiny", "champion")
    assert champion.run_id == children["export"].info.run_id and champion.source.endswith("/merged")
    assert parent.data.tags["registered_model"] == f"grpoflow-tiny/{champion.version}"


@pytest.mark.slow
def test_export_matches_trained_model(finished_run):
    import json

    manifest = json.loads((finished_run / "e2e" / "export" / "manifest.json").read_text())
    assert manifest["verify_prompts"] == 2
    assert manifest["verify_matches"] == 2


def test_bad_config_fails_before_any_model_is_loaded(tmp_path, capsys):
    rc = main(["run", str(MICRO), f"run.output_dir={tmp_path}", "grpo.num_generations=1"])
    assert rc == 2
    assert "grpo.num_generations" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())
