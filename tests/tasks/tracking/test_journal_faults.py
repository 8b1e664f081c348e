"""Fault injection against a real `mlflow server` (one for the module): the journal keeps every line until the
store has it. `grpoflow sync` refuses a journal written for another store; an auth and rate-limit outage (a proxy
answering 401/403/429 before forwarding) loses nothing; a torn last line costs only itself; one key MLflow refuses
costs only that key, not its batch."""

import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from grpoflow.tasks.tracking.journal import JOURNAL_DIR, Journal
from grpoflow.tasks.tracking.journal_store import store_record
from grpoflow.tasks.tracking.sender import replay
from grpoflow.tasks.tracking.tracker import RunLogger
from tests.proxies import FlakyProxy

pytestmark = [pytest.mark.faults, pytest.mark.slow]


def _run(client: MlflowClient) -> str:
    exp = client.get_experiment_by_name("faults") or client.get_experiment(client.create_experiment("faults"))
    return client.create_run(exp.experiment_id).info.run_id


def _steps(client: MlflowClient, rid: str, key: str = "loss") -> list[int]:
    return sorted(m.step for m in client.get_metric_history(rid, key))


def _workspace(tmp: Path, server: str, rid: str, steps: int, torn: bytes = b"") -> Path:
    """A run workspace whose journal (written for ``server``) holds ``steps`` unsent loss points."""
    run_dir = tmp / "runs" / "r"
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(f"run:\n  name: r\n  output_dir: {tmp / 'runs'}\n")
    journal = Journal(run_dir / JOURNAL_DIR, rid, store=store_record(server, "faults"))
    for step in range(1, steps + 1):
        journal.append({"op": "batch", "m": [["loss", 1.0 / step, 1000 + step, step]], "p": [], "t": []})
    journal.close()
    with journal.path.open("ab") as f:
        f.write(torn)
    return run_dir


def _sync(run_dir: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}  # a fresh shell, as in the issue
    cmd = [sys.executable, "-m", "grpoflow.flows.cli", "sync", str(run_dir), "--timeout", "60", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)


def test_sync_refuses_a_journal_written_for_another_store(mlflow_server, tmp_path):
    client = MlflowClient(mlflow_server)
    rid = _run(client)
    run_dir = _workspace(tmp_path, mlflow_server, rid, steps=5)
    res = _sync(run_dir)  # no $MLFLOW_TRACKING_URI: the default store would be <runs>/mlflow.db
    assert res.returncode == 2, res.stderr
    assert mlflow_server in res.stderr and str(tmp_path / "runs" / "mlflow.db") in res.stderr
    assert "--force-store" in res.stderr
    assert Journal(run_dir / JOURNAL_DIR, rid).pending_count() == 5  # nothing dropped
    res = _sync(run_dir, "--tracking-uri", mlflow_server)
    assert res.returncode == 0, res.stderr
    assert _steps(client, rid) == [1, 2, 3, 4, 5]


def test_an_auth_and_rate_limit_outage_loses_nothing(mlflow_server, tmp_path):
    client = MlflowClient(mlflow_server)
    rid = _run(client)
    with FlakyProxy(mlflow_server, [401, 403, 429]) as proxy:
        logger = RunLogger(MlflowClient(proxy.url), rid, tmp_path / JOURNAL_DIR, flush_timeout_s=60)
        for step in range(1, 21):
            logger.log_metrics({"loss": 1 / step, "rewards/bonus/mean": step}, step=step)
        assert logger.end(True)
        assert proxy.answered[:3] == [401, 403, 429] and 200 in proxy.answered
    assert logger.sender.dropped == []
    assert _steps(client, rid) == list(range(1, 21)) and _steps(client, rid, "rewards/bonus/mean") == list(range(1, 21))
    assert client.get_run(rid).info.status == "FINISHED"


def test_sync_sends_the_good_lines_of_a_journal_with_a_torn_last_line(mlflow_server, tmp_path):
    client = MlflowClient(mlflow_server)
    rid = _run(client)
    run_dir = _workspace(tmp_path, mlflow_server, rid, steps=4, torn=b'{"op":"batch","m":[["loss",0.1')
    res = _sync(run_dir, "--tracking-uri", mlflow_server)
    assert res.returncode == 0, res.stderr
    path = run_dir / JOURNAL_DIR / f"{rid}.jsonl"
    assert re.search(rf"tracking journal {re.escape(str(path))}: a torn last line .* at byte \d+", res.stderr)
    assert "Traceback" not in res.stderr
    assert _steps(client, rid) == [1, 2, 3, 4]


def test_one_refused_key_in_a_batch_costs_only_that_key(mlflow_server, tmp_path, caplog):
    client = MlflowClient(mlflow_server)
    rid = _run(client)
    folder = tmp_path / JOURNAL_DIR
    journal = Journal(folder, rid, store=store_record(mlflow_server, "faults"))
    for step in range(1, 4):  # three lines the sender merges into one batch
        metrics = [[f"m{i}", float(i), 1000 + step, step] for i in range(100)]
        journal.append({"op": "batch", "m": [*metrics, ["rewards/<lambda>/mean", 1.0, 1000 + step, step]], "p": []})
    journal.close()
    with caplog.at_level(logging.WARNING):
        done = replay(folder, mlflow_server, timeout=60)
    assert done[rid].left == 0 and done[rid].dropped == ["metric 'rewards/<lambda>/mean'"] * 3
    assert "rewards/<lambda>/mean" in caplog.text
    run = client.get_run(rid)
    assert len(run.data.metrics) == 100 and _steps(client, rid, "m7") == [1, 2, 3]


def test_a_reopened_run_does_not_log_again_the_steps_its_journal_still_holds(mlflow_server, tmp_path):
    """The killed attempt sent steps 1-3 and left 4-6 in the run's journal (resume's replay ran out of
    tracking.flush_timeout_s); the stage reopens the run, which holds 1-3, and redoes 4-8 from its checkpoint. The
    journal's steps count as logged: each step once, the killed attempt's values kept (docs/tracking.md)."""
    client = MlflowClient(mlflow_server)
    rid = _run(client)
    folder = tmp_path / JOURNAL_DIR
    killed = RunLogger(client, rid, folder)
    for step in range(1, 4):
        killed.log_metrics({"loss": float(step)}, step=step)
    assert killed.close()
    journal = Journal(folder, rid)
    for step in range(4, 7):
        journal.append({"op": "batch", "m": [["loss", float(step), 1000 + step, step]], "p": [], "t": []})
    journal.close()
    again = RunLogger(client, rid, folder)
    again.reopened(client.get_run(rid))
    for step in range(4, 9):
        again.log_metrics({"loss": 10.0 + step}, step=step)
    assert again.end(True)
    history = client.get_metric_history(rid, "loss")
    assert sorted(m.step for m in history) == list(range(1, 9))
    assert {m.step: m.value for m in history}[6] == 6.0


def test_a_run_deleted_mid_stage_keeps_its_records_until_restored(mlflow_server, tmp_path, caplog):
    """Someone deletes the stage's run (or its experiment) in the UI while it trains. MLflow refuses every line with
    400 INVALID_PARAMETER_VALUE ("must be in the 'active' state"): that says nothing of the items, so nothing is
    dropped (nor bisected item by item, two requests per metric); the journal keeps it all, the message gives the
    reason, and once the run is restored (`mlflow runs restore`) replay sends every step and the status."""
    client = MlflowClient(mlflow_server)
    rid = _run(client)
    logger = RunLogger(client, rid, tmp_path / JOURNAL_DIR, flush_timeout_s=3)
    logger.log_metrics({f"m{i}": 1.0 for i in range(50)}, step=1)
    assert logger.flush(60)
    client.delete_run(rid)
    for step in range(2, 6):
        logger.log_metrics({f"m{i}": float(step) for i in range(50)}, step=step)
    with caplog.at_level(logging.WARNING):
        assert not logger.end(True)
    assert logger.sender.dropped == []
    assert "must be in the 'active' state. Current state is deleted" in caplog.text
    client.restore_run(rid)
    done = replay(tmp_path / JOURNAL_DIR, mlflow_server, timeout=60)
    assert done[rid].left == 0 and done[rid].dropped == []
    assert _steps(client, rid, "m7") == [1, 2, 3, 4, 5] and client.get_run(rid).info.status == "FINISHED"


def test_a_resumed_distributed_stage_does_not_log_its_redone_steps_again(mlflow_server, tmp_path):
    """With distributed.world_size > 1 rank 0 logs the GRPO steps (its own journal, grpo_worker.rank_tracker). The
    killed attempt logged steps 1-5; the stage reopens its run and the launch redoes 4-8 from checkpoint-3: rank 0
    skips what the reopened run holds, as a one-process stage does (docs/tracking.md)."""
    import json

    from grpoflow.tasks.config import config_from_dict
    from grpoflow.tasks.launch.dist import Comm
    from grpoflow.tasks.stages.grpo_launch import launch_spec
    from grpoflow.tasks.stages.grpo_worker import rank_tracker
    from grpoflow.tasks.storage.workspace import Workspace

    client = MlflowClient(mlflow_server)
    rid = _run(client)
    cfg = config_from_dict({"run": {"output_dir": str(tmp_path), "name": "r"}, "tracking": {"uri": mlflow_server}})
    ws = Workspace(tmp_path / "r", cfg.storage)
    killed = rank_tracker(cfg, {"run_id": rid, "tracking_uri": mlflow_server}, Comm(), ws)
    for step in range(1, 6):
        killed.log_metrics({"loss": float(step)}, step=step)
    assert killed.close()
    stage = RunLogger(client, rid, tmp_path / "r" / JOURNAL_DIR)  # what stage_run does on a resume
    stage.reopened(client.get_run(rid))
    spec = json.loads(json.dumps(launch_spec(cfg, ws, stage, "init-model", tmp_path / "launch")))
    rank0 = rank_tracker(cfg, spec, Comm(), ws)
    for step in range(4, 9):
        rank0.log_metrics({"loss": 10.0 + step}, step=step)
    assert rank0.close() and stage.end(True)
    assert _steps(client, rid) == list(range(1, 9))


def test_a_model_whose_logging_failed_midway_is_logged_once(mlflow_server, tmp_path):
    """The model a stage logs at its end takes several requests (create, finalize, link to the run). A gateway
    that answers one of the later ones 403 (an expired token) leaves the line in the journal; sent again, it must
    not create a second LoggedModel for the run."""
    client = MlflowClient(mlflow_server)
    rid = _run(client)
    with FlakyProxy(mlflow_server, [403], only="PATCH /api/2.0/mlflow/logged-models/") as proxy:
        logger = RunLogger(MlflowClient(proxy.url), rid, tmp_path / JOURNAL_DIR, flush_timeout_s=60)
        logger.log_model("grpo-tiny", str(tmp_path / "model"), {"lr": 0.1}, step=8)
        assert logger.end(True)
        assert 403 in proxy.answered
    exp = client.get_run(rid).info.experiment_id
    models = client.search_logged_models([exp], filter_string=f"source_run_id = '{rid}'")
    assert [(m.name, str(m.status)) for m in models] == [("grpo-tiny", "READY")]
    assert [o.model_id for o in client.get_run(rid).outputs.model_outputs] == [models[0].model_id]


def _table(client: MlflowClient, rid: str, path: str, tmp: Path) -> list[list]:
    """The rows of the run's table artifact ``path`` (MLflow's format: pandas' "split" JSON)."""
    import pandas as pd

    return pd.read_json(client.download_artifacts(rid, path, str(tmp)), orient="split").values.tolist()


@pytest.mark.parametrize(
    "fail",
    ["POST /api/2.0/mlflow/runs/set-tag", "GET /api/2.0/mlflow/runs/get"],  # each the first after the upload
    ids=["on-the-tag", "on-the-run-read"],
)
def test_a_table_whose_logging_failed_after_its_upload_holds_each_row_once(mlflow_server, tmp_path, fail):
    """log_table is several requests (MLflow lists, downloads, joins and uploads the table, then reads the run and
    tags it). A gateway that answers a request after the upload 403 leaves the line in the journal; sent again,
    it must not append the rows a second time. Two tables logged to one file in one stage both stay, once each."""
    import json

    client = MlflowClient(mlflow_server)
    rid = _run(client)
    with FlakyProxy(mlflow_server, [403], only=fail, after="PUT /api/2.0/mlflow-artifacts/") as proxy:
        logger = RunLogger(MlflowClient(proxy.url), rid, tmp_path / JOURNAL_DIR, flush_timeout_s=60)
        logger.log_table({"step": [1, 1], "completion": ["a", "b"]}, "completions/start.json")
        assert logger.flush(60)
        assert 403 in proxy.answered
        logger.log_table({"step": [2], "completion": ["c"]}, "completions/start.json")
        assert logger.end(True)
    assert _table(client, rid, "completions/start.json", tmp_path) == [[1, "a"], [1, "b"], [2, "c"]]
    logged = json.loads(client.get_run(rid).data.tags["mlflow.loggedArtifacts"])
    assert logged == [{"path": "completions/start.json", "type": "table"}]


@pytest.mark.parametrize("deleted", ["run", "experiment"])
def test_records_of_a_deleted_run_say_so_and_how_to_restore_or_drop_them(mlflow_server, tmp_path, deleted):
    """The journal keeps a deleted run's records (above); what sync, resume and the model registration then say
    must be true: not that the server does not answer, but which run (or experiment) is deleted, how many records
    wait, how to restore it and send them, or which files to delete to drop them."""
    from grpoflow.tasks.tracking.deleted import registration_skipped

    client = MlflowClient(mlflow_server)
    exp = client.create_experiment(f"gone-{deleted}-{tmp_path.name}")
    rid = client.create_run(exp).info.run_id
    run_dir = tmp_path / "runs" / "r"
    folder = run_dir / JOURNAL_DIR
    journal = Journal(folder, rid, store=store_record(mlflow_server, "faults"))
    for step in range(1, 4):
        journal.append({"op": "batch", "m": [["loss", 1.0, 1000 + step, step]], "p": [], "t": []})
    journal.close()
    if deleted == "run":
        client.delete_run(rid)
        want = [f"MLflow run {rid} is deleted", f"mlflow runs restore --run-id {rid}"]
    else:
        client.delete_experiment(exp)
        want = [
            f"experiment {exp} (",
            f"of MLflow run {rid} is deleted",
            f"mlflow experiments restore --experiment-id {exp}",
        ]
    want += [f"3 records wait in {journal.path}", f"grpoflow sync {run_dir}", f"rm -r {folder}/{rid}.*"]
    done = replay(folder, mlflow_server, timeout=3)
    assert done[rid].left == 3 and all(w in done[rid].deleted for w in want), done[rid].deleted
    text = registration_skipped(run_dir, client, flushed=True)
    assert "does not answer" not in text and all(w in text for w in want), text
    assert "does not answer" in registration_skipped(run_dir, client, flushed=False)
