"""End to end: the real Prefect flow on a micro config, logging to a real MLflow store."""

import json
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient
from PIL import Image

from grpoflow.flows.cli import main
from tests.paths import MICRO

STAGES = {"data", "sft", "grpo", "eval", "export"}


def read_table(client: MlflowClient, run_id: str, name: str) -> dict[str, list]:
    """An MLflow table artifact (pandas 'split' JSON) as {column: values}."""
    data = json.loads(Path(client.download_artifacts(run_id, name)).read_text())
    return {c: [row[i] for row in data["data"]] for i, c in enumerate(data["columns"])}


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
    report = json.loads((ws / "eval" / "report.json").read_text())
    assert report["rows"] == 8 and report["sampling"]["n"] == 4 and report["sampling"]["temperature"] == 1.0
    for label in ("before", "after"):
        m = report[label]
        assert m["rows"] == 8
        assert 0 <= m["pass_at_1"] <= m["pass_at_4"] <= 1
        for key in ("accuracy", "format_compliance", "sampled/format_compliance"):
            assert 0 <= m[key] <= 1, key
        assert 0 < m["mean_completion_length"] <= 16
        for f in ("correctness", "proximity", "strict_format"):
            assert f"rewards/{f}/mean" in m and f"rewards/{f}/std" in m
    assert report["accuracy_gain"] == report["after"]["accuracy"] - report["before"]["accuracy"]


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
    # the time outside the training loops (tasks/tracking/timeline.py), measured by the run itself
    t = parent.data.metrics
    for key in ("startup/imports_s", "startup/prefect_server_s", "startup/to_first_sft_loop_s", "stage/data_s"):
        assert t[key] > 0, key
    assert 0 < t["stage_overhead/sft_s"] < t["stage/sft_s"] and 0 < t["stage_overhead/grpo_s"] < t["stage/grpo_s"]
    assert 0 < t["run/loop_s"] < t["run/wall_s"] and 0 < t["run/outside_loop_share"] < 1
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
    # three tables under fixed names: the first, middle ((3 + 1) // 2) and last step
    tables = {a.path: a for a in client.list_artifacts(grpo, "completions")}
    assert set(tables) == {"completions/start.json", "completions/middle.json", "completions/end.json"}
    for name, step in (("start", 1), ("middle", 2), ("end", 3)):
        table = read_table(client, grpo, f"completions/{name}.json")
        assert set(table["step"]) == {step}
        assert len(table["completion"]) == 8  # the round: 2 prompts x 4 generations
        assert {"reward", "advantage", "rewards/correctness", "rewards/proximity"} <= set(table)
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert "config.yaml" in artifacts
    ev = children["eval"].info.run_id
    assert {"report.json", "report.md", "accuracy.png", "eval"} <= {a.path for a in client.list_artifacts(ev)}
    assert {a.path for a in client.list_artifacts(ev, "eval")} == {
        "eval/completions_before.json",
        "eval/completions_after.json",
    }
    for label in ("before", "after"):
        table = read_table(client, ev, f"eval/completions_{label}.json")
        assert len(table["completion"]) == 8
        assert {"correct", "rewards/correctness", "rewards/strict_format", "samples_correct_of_4"} <= set(table)
        assert client.get_run(ev).data.metrics[f"{label}/accuracy"] == sum(table["correct"]) / 8
    png = Path(client.download_artifacts(ev, "accuracy.png"))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert Image.open(png).size[0] > 300
    export_art = {a.path for a in client.list_artifacts(children["export"].info.run_id)}
    assert {"adapter", "merged"} <= export_art
    # the merged model is registered (the local SQLite store has a registry too) and, the first, is champion
    champion = client.get_model_version_by_alias("grpoflow-tiny", "champion")
    assert champion.run_id == children["export"].info.run_id
    # as an MLflow transformers model: a LoggedModel output of the export run, with its MLmodel file
    (output,) = children["export"].outputs.model_outputs
    assert champion.source == client.get_logged_model(output.model_id).artifact_location
    assert (Path(champion.source.removeprefix("file://")) / "MLmodel").is_file()
    assert parent.data.tags["registered_model"] == f"grpoflow-tiny/{champion.version}"


@pytest.mark.slow
def test_export_matches_trained_model(finished_run):

    manifest = json.loads((finished_run / "e2e" / "export" / "manifest.json").read_text())["summary"]
    assert manifest["verify_prompts"] == 2 and manifest["verify_tokens"] > 0
    assert manifest["verify_max_logprob_gap"] <= manifest["verify_tolerance"] == 0.0625  # float32 -> float16
    assert 0.0 <= manifest["verify_greedy_agreement"] <= 1.0


def test_bad_config_fails_before_any_model_is_loaded(tmp_path, capsys):
    rc = main(["run", str(MICRO), f"run.output_dir={tmp_path}", "grpo.num_generations=1"])
    assert rc == 2
    assert "grpo.num_generations" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())
