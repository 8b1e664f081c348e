"""Against a real `mlflow server` on 127.0.0.1 (SQLite backend, --workers 1, artifacts served by it): the
pipeline logs over HTTP, the UI answers, the run's model is registered and the champion alias follows the
held-out accuracy."""

import urllib.request
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from grpoflow.flows.cli import main
from grpoflow.tasks.tracking.registry import ACCURACY_TAG, register_run_model
from tests.paths import MICRO


@pytest.fixture(scope="module")
def server(mlflow_server):
    return mlflow_server


def test_champion_alias_follows_accuracy(server, tmp_path):
    client = MlflowClient(server)
    exp = client.create_experiment("registry-test")
    runs = [client.create_run(exp).info.run_id for _ in range(4)]
    name = "grpoflow-registry-test"
    src = [f"{client.get_run(r).info.artifact_uri}/merged" for r in runs]
    first = register_run_model(client, name, "champion", src[0], runs[0], 0.30)
    better = register_run_model(client, name, "champion", src[1], runs[1], 0.50)
    worse = register_run_model(client, name, "champion", src[2], runs[2], 0.40)
    unknown = register_run_model(client, name, "champion", src[3], runs[3], None)
    assert (first.promoted, better.promoted, worse.promoted, unknown.promoted) == (True, True, False, False)
    champion = client.get_model_version_by_alias(name, "champion")
    assert champion.version == better.version and champion.tags[ACCURACY_TAG] == "0.500000"
    assert "does not beat" in client.get_model_version(name, worse.version).tags["champion_decision"]
    assert [v.run_id for v in client.search_model_versions(f"name='{name}'", order_by=["version_number ASC"])] == runs


@pytest.mark.slow
def test_pipeline_logs_to_the_server_and_registers_its_model(server, tmp_path):
    out = tmp_path / "runs"
    args = ["run", str(MICRO), f"run.output_dir={out}", f"tracking.uri={server}", "tracking.experiment=server-e2e"]
    assert main([*args, "run.name=one"]) == 0
    assert main([*args, "run.name=two"]) == 0
    with urllib.request.urlopen(server + "/", timeout=10) as r:  # the UI
        assert r.status == 200 and b"<html" in r.read(2000).lower()
    client = MlflowClient(server)
    exp = client.get_experiment_by_name("server-e2e")
    parents = [r for r in client.search_runs([exp.experiment_id]) if "mlflow.parentRunId" not in r.data.tags]
    assert sorted(r.info.run_name for r in parents) == ["one", "two"]
    assert all(r.info.status == "FINISHED" for r in parents)
    assert not (out / "mlflow.db").exists()  # nothing went to the local default store
    versions = client.search_model_versions("name='grpoflow-tiny'", order_by=["version_number ASC"])
    assert len(versions) == 2
    champion = client.get_model_version_by_alias("grpoflow-tiny", "champion")
    acc = {v.version: float(v.tags[ACCURACY_TAG]) for v in versions}
    assert acc[champion.version] == max(acc.values())  # ties keep the first
    for p in parents:
        assert p.data.tags["registered_model"].startswith("grpoflow-tiny/")
        assert p.data.tags["champion_decision"]
    # the registered merged weights are real artifacts on the server
    files = {Path(f.path).name for f in client.list_artifacts(versions[0].run_id, "merged")}
    assert "config.json" in files and any(f.endswith(".safetensors") for f in files)
