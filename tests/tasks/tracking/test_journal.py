"""The tracking journal and its background sender against real stores: a SQLite file, and an `mlflow server`
stopped mid-run and started again on the same port and store. Logging never waits on the server; every point
arrives once, in order; what a server that stays down misses is sent later by ``replay``."""

import math
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from grpoflow.flows.stages import PIPELINE
from grpoflow.tasks.config import config_from_dict
from grpoflow.tasks.tracking.journal import JOURNAL_DIR, Journal, backoff_s, group
from grpoflow.tasks.tracking.sender import replay
from grpoflow.tasks.tracking.tracker import RunLogger, stage_run, start_pipeline_run
from tests.restartable import RestartableMlflow


def _run(client: MlflowClient, tmp: Path) -> str:
    exp = client.create_experiment(f"e{time.time_ns()}", artifact_location=(tmp / "art").as_uri())
    return client.create_run(exp).info.run_id


def _steps(client: MlflowClient, run_id: str, key: str) -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run_id, key))


def test_backoff_and_grouping_keep_order_within_mlflow_limits():
    assert [backoff_s(n) for n in (1, 2, 3, 5, 6, 20)] == [1, 2, 4, 16, 30, 30]
    ops = [(i + 1, {"op": "batch", "m": [[f"k{i}", 1.0, 0, i]] * 400, "p": [], "t": []}) for i in range(3)]
    ops.insert(1, (9, {"op": "status", "status": "RUNNING"}))
    grouped = group(ops)
    assert [op["op"] for _, op in grouped] == ["batch", "status", "batch"]
    assert [len(op["m"]) for _, op in grouped if op["op"] == "batch"] == [400, 800]
    assert grouped[-1][0] == 3  # the offset after the last merged line


def test_non_finite_metric_values_round_trip_through_the_journal(tmp_path):
    """NaN and +-inf (a diverging loss) are written so that the sender reads back the same floats."""
    journal = Journal(tmp_path / JOURNAL_DIR, "run-x")
    journal.append({"op": "batch", "m": [["a", float("nan"), 0, 1], ["b", float("inf"), 0, 1], ["c", -math.inf, 0, 1]]})
    journal.close()
    [(_, op)] = Journal(tmp_path / JOURNAL_DIR, "run-x").pending()
    values = [v for _, v, _, _ in op["m"]]
    assert math.isnan(values[0]) and values[1] == math.inf and values[2] == -math.inf


def test_sqlite_store_gets_everything_once_in_order(tmp_path):
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    rid = _run(client, tmp_path)
    logger = RunLogger(client, rid, tmp_path / JOURNAL_DIR, flush_timeout_s=60)
    for step in range(1, 41):
        logger.log_metrics({"loss": 1 / step, "reward": step}, step=step)
    logger.log_params({"a": {"b": 1}})
    logger.set_tags({"t": "v"})
    logger.log_dict({"x": 1}, "summary.json")
    logger.log_table({"q": ["a", "b"]}, "tables/t.json")
    assert logger.end(True)
    run = client.get_run(rid)
    assert run.info.status == "FINISHED" and run.data.params == {"a.b": "1"} and run.data.tags["t"] == "v"
    assert _steps(client, rid, "loss") == list(range(1, 41))
    assert {a.path for a in client.list_artifacts(rid)} >= {"summary.json", "tables"}
    journal = Journal(tmp_path / JOURNAL_DIR, rid)
    assert journal.pending_count() == 0 and journal.sent() == journal.size() > 0
    assert not journal.files.exists()  # the artifacts' copies go once sent


@pytest.mark.slow
def test_server_outage_blocks_no_logging_call_and_loses_nothing(tmp_path):
    with RestartableMlflow(tmp_path / "server") as server:
        client = MlflowClient(server.url)
        rid = _run(client, tmp_path)
        logger = RunLogger(client, rid, tmp_path / JOURNAL_DIR, flush_timeout_s=60, request_timeout_s=2)
        for step in range(1, 11):
            logger.log_metrics({"loss": 1 / step}, step=step)
        assert logger.flush(60)
        server.kill()
        slowest = 0.0
        for step in range(11, 31):  # the server is down: each call returns at once
            t0 = time.perf_counter()
            logger.log_metrics({"loss": 1 / step}, step=step)
            logger.set_tags({"last_step": step})
            slowest = max(slowest, time.perf_counter() - t0)
            time.sleep(0.2)
        # a call that waited on the server would take request_timeout_s (2 s); the journal's fsync per step takes a
        # few ms on an idle disk and tens on a busy CI runner's, so the bound sits well between the two
        assert slowest < 0.5, f"a logging call waited {slowest:.3f} s on a dead server"
        assert not logger.reachable and logger.journal.pending_count() > 0
        server.start()
        assert logger.end(True)
        run = client.get_run(rid)
        assert run.info.status == "FINISHED" and run.data.tags["last_step"] == "30"
        assert _steps(client, rid, "loss") == list(range(1, 31))


@pytest.mark.slow
def test_a_server_still_down_at_the_end_leaves_the_journal_and_replay_sends_it(tmp_path):
    with RestartableMlflow(tmp_path / "server") as server:
        client = MlflowClient(server.url)
        rid = _run(client, tmp_path)
        logger = RunLogger(client, rid, tmp_path / JOURNAL_DIR, flush_timeout_s=2, request_timeout_s=1)
        logger.log_metrics({"loss": 1.0}, step=1)
        assert logger.flush(60)
        server.kill()
        for step in range(2, 6):
            logger.log_metrics({"loss": 1 / step}, step=step)
        logger.log_text("kept", "notes/n.txt")
        t0 = time.perf_counter()
        assert not logger.end(True)  # bounded: flush_timeout_s, not MLflow's minutes of retries
        assert time.perf_counter() - t0 < 10
        left = Journal(tmp_path / JOURNAL_DIR, rid).pending_count()
        assert left >= 4
        server.start()
        assert {k: r.left for k, r in replay(tmp_path / JOURNAL_DIR, server.url, timeout=60).items()} == {rid: 0}
        assert replay(tmp_path / JOURNAL_DIR, server.url, timeout=60) == {}  # nothing twice
        assert _steps(client, rid, "loss") == [1, 2, 3, 4, 5]
        assert client.get_run(rid).info.status == "FINISHED"
        assert [a.path for a in client.list_artifacts(rid, "notes")] == ["notes/n.txt"]


def test_a_stage_attempt_with_the_same_key_continues_its_run_without_repeating_steps(tmp_path):
    cfg = config_from_dict({"run": {"output_dir": str(tmp_path), "name": "r"}})
    parent = start_pipeline_run(cfg)
    root = tmp_path / "r"
    with pytest.raises(RuntimeError), stage_run(cfg, parent.run_id, PIPELINE["grpo"], root, "key1") as first:
        for step in range(1, 6):
            first.log_metrics({"loss": float(step)}, step=step)
        raise RuntimeError("killed at step 5")
    client = first.client
    assert client.get_run(first.run_id).info.status == "FAILED"
    with stage_run(cfg, parent.run_id, PIPELINE["grpo"], root, "key1") as again:  # resumed from checkpoint-3
        assert again.run_id == first.run_id and client.get_run(first.run_id).info.status == "RUNNING"
        for step in range(4, 9):
            again.log_metrics({"loss": 10.0 + step}, step=step)
    run = client.get_run(first.run_id)
    assert run.info.status == "FINISHED" and run.data.tags["grpoflow.steps_logged_before_resume"] == "5"
    history = {m.step: m.value for m in client.get_metric_history(first.run_id, "loss")}
    assert sorted(m.step for m in client.get_metric_history(first.run_id, "loss")) == list(range(1, 9))
    assert history[5] == 5.0 and history[6] == 16.0  # steps it held kept, later ones from the new attempt
    with stage_run(cfg, parent.run_id, PIPELINE["grpo"], root, "key2") as other:  # another key: the stage starts over
        assert other.run_id != first.run_id
    parent.end(True)


def test_an_artifact_rewritten_before_it_was_sent_is_not_sent_to_the_old_run(tmp_path, caplog):
    """An artifact line left unsent (the server down at the stage's end) and its file rewritten since (the stage
    ran again under another key): the old run must not get the new attempt's file. Before, the sender read the
    path at send time and the old run's report.json said "NEW". A file left as it was is sent."""
    import logging

    store = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    rid = _run(store, tmp_path)
    ws = tmp_path / "ws"
    (ws / "eval").mkdir(parents=True)
    report, kept = ws / "eval" / "report.json", ws / "eval" / "report.md"
    report.write_text('{"attempt": "OLD"}')
    kept.write_text("# old attempt\n")
    down = MlflowClient("http://127.0.0.1:9")
    logger = RunLogger(down, rid, ws / JOURNAL_DIR, flush_timeout_s=1, request_timeout_s=0.5)
    logger.log_artifact(report)
    logger.log_artifact(kept)
    logger.close()
    report.write_text('{"attempt": "NEW, another key"}')  # the stage's folder emptied and written again
    with caplog.at_level(logging.WARNING):
        done = replay(ws / JOURNAL_DIR, f"sqlite:///{tmp_path / 'mlflow.db'}", 30, force_store=True)
    assert {k: r.left for k, r in done.items()} == {rid: 0}
    assert sorted(a.path for a in store.list_artifacts(rid)) == ["report.md"]
    assert f"artifact {report} changed since it was logged" in caplog.text
