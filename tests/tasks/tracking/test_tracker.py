"""Tests for tasks/tracking/tracker.py against real MLflow stores (a SQLite file in tmp_path; one `mlflow server`):
where the runs go (tracking_uri's precedence, the experiment's artifact folder), the parent run and the nested
stage runs (parent tag, name, FINISHED / FAILED), what a journaled logger delivers once it ends, the disabled
logger, and omitted constant metrics. The journal's own delivery and outages: test_journal.py."""

from __future__ import annotations

import json
import math
import sys

import pytest
import yaml
from mlflow.tracking import MlflowClient

from grpoflow.flows.stages import PIPELINE
from grpoflow.tasks.config import config_from_dict
from grpoflow.tasks.tracking import run_meta
from grpoflow.tasks.tracking.journal import JOURNAL_DIR, Journal
from grpoflow.tasks.tracking.tracker import (
    PARENT_TAG,
    STAGE_RUNS,
    RunLogger,
    end_run,
    experiment_id,
    flatten,
    logger_for,
    run_url,
    stage_run,
    start_pipeline_run,
    tracking_uri,
    unsent,
)


@pytest.fixture(autouse=True)
def _no_env_uri(monkeypatch):
    """Each test chooses its store; an MLFLOW_TRACKING_URI of the shell must not redirect it."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


def _cfg(tmp_path, **sections):
    return config_from_dict({"run": {"output_dir": str(tmp_path / "out"), "name": "r"}, **sections})


# ---------------------------------------------------------------------------- where the runs go
def test_tracking_uri_precedence_config_then_environment_then_sqlite_in_the_output_folder(tmp_path, monkeypatch):
    default = f"sqlite:///{tmp_path / 'out' / 'mlflow.db'}"
    assert tracking_uri(_cfg(tmp_path)) == default
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://env-host:5000")
    assert tracking_uri(_cfg(tmp_path)) == "http://env-host:5000"
    assert tracking_uri(_cfg(tmp_path, tracking={"uri": "http://cfg-host:5000"})) == "http://cfg-host:5000"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "")  # set but empty: as unset
    assert tracking_uri(_cfg(tmp_path)) == default


def test_an_s3_output_dir_keeps_the_sqlite_store_and_artifacts_in_its_local_mirror(tmp_path):
    cache = tmp_path / "cache"
    cfg = config_from_dict(
        {"run": {"output_dir": "s3://bucket/team/runs", "name": "r"}, "storage": {"cache_dir": str(cache)}}
    )
    mirror = cache / "bucket" / "team" / "runs"
    assert tracking_uri(cfg) == f"sqlite:///{mirror / 'mlflow.db'}"
    mirror.mkdir(parents=True)
    client = MlflowClient(tracking_uri(cfg))
    exp = experiment_id(client, cfg)
    assert client.get_experiment(exp).artifact_location == (mirror / "mlartifacts").as_uri()
    assert experiment_id(client, cfg) == exp  # found by name, not created twice
    assert (mirror / "mlflow.db").is_file()


def test_the_parent_run_lands_in_the_experiment_mlflow_experiment_name_names(tmp_path, monkeypatch):
    """MLflow's convention: a config without tracking.experiment logs to $MLFLOW_EXPERIMENT_NAME's experiment."""
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "named-by-env")
    cfg = _cfg(tmp_path)
    (tmp_path / "out").mkdir()
    parent = start_pipeline_run(cfg)
    assert parent.end(True)
    client = MlflowClient(tracking_uri(cfg))
    assert client.get_experiment(client.get_run(parent.run_id).info.experiment_id).name == "named-by-env"


def test_flatten_joins_nested_keys_with_dots():
    assert flatten({"a": {"b": 1, "c": {"d": None}}, "e": [1, 2]}) == {"a.b": 1, "a.c.d": None, "e": [1, 2]}
    assert flatten({}) == {}


# ---------------------------------------------------------------------------- pipeline and stage runs
@pytest.fixture
def pipeline(tmp_path):
    """A pipeline run in <tmp>/out/mlflow.db; its config and logger."""
    cfg = _cfg(tmp_path, grpo={"learning_rate": 3e-6})
    (tmp_path / "out").mkdir()
    parent = start_pipeline_run(cfg, tags={"extra": "yes"})
    yield cfg, parent
    parent.end(True)


def test_the_pipeline_run_holds_the_config_as_params_and_artifact(pipeline, tmp_path):
    cfg, parent = pipeline
    assert parent.journal is not None and parent.journal.folder == tmp_path / "out" / "r" / JOURNAL_DIR
    assert parent.end(True)
    client = MlflowClient(tracking_uri(cfg))
    run = client.get_run(parent.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "r"
    assert run.data.params["grpo.learning_rate"] == "3e-06" and run.data.params["run.name"] == "r"
    assert run.data.tags["extra"] == "yes" and PARENT_TAG not in run.data.tags
    assert client.get_experiment(run.info.experiment_id).tags["mlflow.experimentKind"] == "custom_model_development"
    local = client.download_artifacts(parent.run_id, "config.yaml", str(tmp_path))
    assert yaml.safe_load(open(local))["grpo"]["learning_rate"] == 3e-6
    assert run.info.artifact_uri.startswith((tmp_path / "out" / "mlartifacts").as_uri())
    assert unsent(tmp_path / "out" / "r") == 0


def test_a_stage_run_is_nested_under_the_parent_named_and_recorded(pipeline, tmp_path):
    cfg, parent = pipeline
    root = tmp_path / "out" / "r"
    with stage_run(cfg, parent.run_id, PIPELINE["grpo"], root, key="k1") as stage:
        assert stage and stage.run_id != parent.run_id
        assert stage.client.get_run(stage.run_id).info.status == "RUNNING"
        stage.log_metrics({"loss": 0.5}, step=1)
    run = stage.client.get_run(stage.run_id)
    assert run.info.status == "FINISHED" and run.info.end_time is not None
    assert run.data.tags[PARENT_TAG] == parent.run_id
    assert run.info.run_name == run_meta.stage_name(cfg, PIPELINE["grpo"]) and run.info.run_name.endswith("lr 3e-6")
    assert run.info.experiment_id == stage.client.get_run(parent.run_id).info.experiment_id
    assert run.data.metrics == {"loss": 0.5}
    recorded = json.loads((root / STAGE_RUNS).read_text())["grpo"]
    assert recorded == {"run_id": stage.run_id, "key": "k1", "tracking_uri": tracking_uri(cfg)}


def test_a_stage_that_raises_ends_its_run_failed_and_the_error_goes_on(pipeline, tmp_path):
    cfg, parent = pipeline
    with (
        pytest.raises(ZeroDivisionError),
        stage_run(cfg, parent.run_id, PIPELINE["eval"], tmp_path / "out" / "r") as stage,
    ):
        stage.log_metrics({"accuracy": 0.25}, step=0)
        1 / 0  # noqa: B018
    run = stage.client.get_run(stage.run_id)
    assert run.info.status == "FAILED" and run.data.metrics == {"accuracy": 0.25}  # logged before the error: kept
    assert stage.client.get_run(parent.run_id).info.status == "RUNNING"  # the parent is the caller's to end


def test_without_a_parent_run_a_stage_logs_nothing(tmp_path):
    cfg = _cfg(tmp_path)
    with stage_run(cfg, None, PIPELINE["grpo"]) as stage:
        assert not stage and stage.run_id is None
        stage.log_metrics({"loss": 1.0}, step=1)
    assert not (tmp_path / "out").exists()  # no store, no journal, no stage_runs.json


def test_a_stage_run_on_a_server_that_does_not_answer_fails_at_once(tmp_path):
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = _cfg(tmp_path, tracking={"uri": f"http://127.0.0.1:{port}"})
    with pytest.raises(ConnectionError, match=rf"stage sft cannot start: MLflow tracking server .*:{port}"):
        with stage_run(cfg, "parent-id", PIPELINE["sft"], tmp_path):
            pass


# ---------------------------------------------------------------------------- the journaled logger
def test_params_metrics_tags_and_artifacts_arrive_once_the_logger_ends(pipeline, tmp_path):
    cfg, parent = pipeline
    root = tmp_path / "out" / "r"
    folder = tmp_path / "plots"
    folder.mkdir()
    (folder / "a.png").write_bytes(b"png")
    (folder / "b.txt").write_text("b")
    single = tmp_path / "history.jsonl"
    single.write_text('{"step": 1}\n')
    with stage_run(cfg, parent.run_id, PIPELINE["sft"], root) as stage:
        stage.log_params({"sft": {"epochs": 2, "lr": 1e-4}})
        stage.log_metrics({"loss": 2.0, "skipped_none": None}, step=1)
        stage.log_metrics({"loss": 1.0}, step=2)
        stage.set_tags({"result": "ok", "dropped": None})
        stage.log_dict({"x": 1}, "summary.yaml")
        stage.log_text("hello", "notes/n.txt")
        stage.log_table({"q": ["a"], "score": [1.0]}, "tables/t.json")
        stage.log_artifact(folder, "plots")
        stage.log_artifact(single)
    client = stage.client
    run = client.get_run(stage.run_id)
    assert run.data.params == {"sft.epochs": "2", "sft.lr": "0.0001"}
    assert [(m.step, m.value) for m in client.get_metric_history(stage.run_id, "loss")] == [(1, 2.0), (2, 1.0)]
    assert set(run.data.metrics) == {"loss"}  # None is not a point
    assert run.data.tags["result"] == "ok" and "dropped" not in run.data.tags
    paths = {a.path for a in client.list_artifacts(stage.run_id)}
    assert {"summary.yaml", "notes", "tables", "plots", "history.jsonl"} <= paths
    assert {a.path for a in client.list_artifacts(stage.run_id, "plots")} == {"plots/a.png", "plots/b.txt"}
    summary = client.download_artifacts(stage.run_id, "summary.yaml", str(tmp_path / "dl"))
    assert yaml.safe_load(open(summary)) == {"x": 1}
    table = client.download_artifacts(stage.run_id, "tables/t.json", str(tmp_path / "dl"))
    assert json.load(open(table))["columns"] == ["q", "score"]
    assert unsent(root) == 0


def test_unsent_counts_the_records_the_journals_still_hold(tmp_path):
    root = tmp_path / "ws"
    assert unsent(root) == 0  # no journal folder yet
    a, b = Journal(root / JOURNAL_DIR, "run-a"), Journal(root / JOURNAL_DIR, "run-b", "rank0")
    for i in range(3):
        a.append({"op": "batch", "m": [["loss", 1.0, 0, i]], "p": [], "t": []})
    b.append({"op": "status", "status": "FINISHED", "end_time": 1})
    assert unsent(root) == 4


def test_omitted_constant_metrics_are_not_logged_and_say_why(pipeline, tmp_path):
    cfg, parent = pipeline
    client = MlflowClient(tracking_uri(cfg))
    logger = logger_for(cfg, client, parent.run_id, tmp_path / "out" / "r", name="omit")
    logger.log_metrics({"kl": 0.3}, step=1)  # before the omission: kept
    logger.omit_constant({"kl": "beta = 0", "clip_ratio/": "one iteration"})
    logger.log_metrics({"kl": 0.0, "clip_ratio/low_mean": 0.0, "clip_ratio/high": 0.0, "clip_ratios": 1.0}, step=2)
    logger.log_metrics({"reward": 0.5}, step=2)
    assert logger.flush(60)
    run = client.get_run(parent.run_id)
    assert set(run.data.metrics) == {"kl", "clip_ratios", "reward"}  # a prefix omits its folder only
    assert [m.step for m in client.get_metric_history(parent.run_id, "kl")] == [1]
    assert run.data.tags["metric_omitted.kl"] == "beta = 0"
    assert run.data.tags["metric_omitted.clip_ratio"] == "one iteration"
    assert logger.close()


def test_a_disabled_logger_logs_nothing_and_never_fails(tmp_path):
    logger = RunLogger.disabled()
    assert not logger and logger.reachable and logger.params == {}
    logger.omit_constant({"kl": "beta = 0"})
    logger.log_metrics({"loss": 1.0}, step=1)
    logger.log_params({"a": {"b": 1}})
    logger.set_tags({"t": "v"})
    logger.set_status("FINISHED")
    logger.log_dict({"x": 1}, "x.json")
    logger.log_text("t", "t.txt")
    logger.log_table({"a": [1]}, "t.json")
    logger.log_artifact(tmp_path / "missing.bin")  # not even read
    logger.log_model("m", str(tmp_path), {}, 1)
    assert logger.params == {}  # nothing recorded, not even locally
    assert logger.flush() and logger.end(False) and end_run(logger, True) and logger.close()
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------- a tracking server
def test_pipeline_and_stage_runs_on_a_server(mlflow_server, tmp_path):
    cfg = _cfg(tmp_path, tracking={"uri": mlflow_server, "experiment": "tracker-test"})
    parent = start_pipeline_run(cfg)
    root = tmp_path / "out" / "r"
    with stage_run(cfg, parent.run_id, PIPELINE["data"], root) as stage:
        stage.log_metrics({"rows": 100.0}, step=0)
        stage.log_text("hello", "notes/n.txt")
    assert parent.end(True)
    client = MlflowClient(mlflow_server)
    run = client.get_run(stage.run_id)
    assert run.info.status == "FINISHED" and run.data.tags[PARENT_TAG] == parent.run_id
    assert run.data.metrics == {"rows": 100.0} and run.info.run_name == run_meta.stage_name(cfg, PIPELINE["data"])
    assert [a.path for a in client.list_artifacts(stage.run_id, "notes")] == ["notes/n.txt"]
    assert client.get_run(parent.run_id).info.status == "FINISHED"
    assert not (tmp_path / "out" / "mlflow.db").exists()  # the server's store, not the default one
    exp = run.info.experiment_id
    assert run_url(client, stage.run_id) == (
        f"{mlflow_server.rstrip('/')}/#/experiments/{exp}/runs/{stage.run_id}?workflowType=machine_learning"
    )
    assert unsent(root) == 0


def test_non_finite_metrics_reach_the_server_and_warn_once_per_metric(mlflow_server, tmp_path, caplog):
    """A diverging run's NaN and infinite points are logged, through the journal and the sender's REST path, as
    MLflow stores them (NaN as NaN, +-inf as the largest float its SQL store holds); None is still no point. The
    first non-finite value of each metric is warned about, once."""
    cfg = _cfg(tmp_path, tracking={"uri": mlflow_server, "experiment": "non-finite"})
    parent = start_pipeline_run(cfg)
    with caplog.at_level("WARNING", logger="grpoflow.tasks.tracking.tracker"):
        parent.log_metrics({"loss": 1.0, "kl": 0.1, "skipped": None}, step=1)
        parent.log_metrics({"loss": float("nan"), "kl": float("inf")}, step=2)
        parent.log_metrics({"loss": float("nan"), "kl": float("-inf")}, step=3)
        parent.log_metrics({"loss": 0.5, "kl": 0.2}, step=4)
    assert parent.flush(60)
    client = MlflowClient(mlflow_server)
    loss = [(m.step, m.value) for m in client.get_metric_history(parent.run_id, "loss")]
    assert [step for step, _ in loss] == [1, 2, 3, 4] and loss[0][1] == 1.0 and loss[3][1] == 0.5
    assert math.isnan(loss[1][1]) and math.isnan(loss[2][1])
    kl = {m.step: m.value for m in client.get_metric_history(parent.run_id, "kl")}
    assert kl[2] >= sys.float_info.max and kl[3] <= -sys.float_info.max and kl[4] == 0.2
    assert "skipped" not in client.get_run(parent.run_id).data.metrics
    warned = [r.getMessage() for r in caplog.records if "logged as it is" in r.getMessage()]
    assert len(warned) == 2 and any("metric loss is nan at step 2" in w for w in warned)
    assert any("metric kl is inf at step 2" in w for w in warned)
    assert parent.end(True)
