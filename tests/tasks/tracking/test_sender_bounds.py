"""The sender keeps its time bounds whatever the server does: a bounded drain (`grpoflow sync --timeout`, resume's
replay, a stage's close within tracking.flush_timeout_s) returns within its bound plus a small margin against a
server that accepts connections and never answers, for every kind of line (artifacts, tables and models go
through MlflowClient, whose own HTTP retries and 120 s timeout took minutes), and stops between lines when the
server answers but the backlog is bigger than the time; what is not sent stays in the journal."""

import threading
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from grpoflow.tasks.tracking.journal import JOURNAL_DIR, Journal
from grpoflow.tasks.tracking.journal_store import store_record
from grpoflow.tasks.tracking.sender import replay
from grpoflow.tasks.tracking.tracker import RunLogger
from tests.proxies import FlakyProxy, SilentServer

pytestmark = [pytest.mark.faults, pytest.mark.slow]
MARGIN_S = 3.0  # thread start, imports, the last request's teardown: not a performance bound
RID = "0" * 32


def _line(kind: str, tmp: Path) -> dict:
    """One journal line of ``kind`` whose file (if any) exists under ``tmp``."""
    (tmp / "report.md").write_text("# report\n")
    (tmp / "start.json").write_text('{"columns":["q"],"data":[["a"]]}')
    return {
        "batch": {"op": "batch", "m": [["loss", 1.0, 1000, 1]], "p": [], "t": []},
        "artifact": {"op": "artifact", "path": str(tmp / "report.md"), "dir": None},
        "table": {"op": "table", "path": str(tmp / "start.json"), "file": "completions/start.json", "whole": True},
        "model": {"op": "model", "name": "m", "path": str(tmp), "params": {}, "step": 1},
    }[kind]


def _in_thread(fn, bound: float):
    """``fn()``'s result, or None when it has not returned within ``bound`` + MARGIN_S (left running, a daemon)."""
    out = []
    thread = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    thread.start()
    thread.join(bound + MARGIN_S)
    return out[0] if out else None


@pytest.mark.parametrize("kind", ["batch", "artifact", "table", "model"])
def test_a_bounded_replay_returns_in_time_from_a_server_that_never_answers(tmp_path, kind):
    with SilentServer() as server:
        folder = tmp_path / JOURNAL_DIR
        journal = Journal(folder, RID, store=store_record(server.url, "x"))
        journal.append(_line(kind, tmp_path))
        journal.append(_line("batch", tmp_path))
        journal.close()
        t0 = time.monotonic()
        done = _in_thread(lambda: replay(folder, server.url, timeout=2, request_timeout_s=10), 2)
        assert done is not None, f"replay(timeout=2) still sending after {time.monotonic() - t0:.0f} s"
    assert done[RID].left == 2 and Journal(folder, RID).pending_count() == 2


def test_a_stage_close_returns_in_time_and_its_sender_stops(tmp_path):
    """The stage's end against a server that never answers: close() returns within tracking.flush_timeout_s and
    the sender's thread has stopped (before, it went on in MLflow's retries after close() returned)."""
    (tmp_path / "report.md").write_text("# report\n")
    with SilentServer() as server:
        folder = tmp_path / JOURNAL_DIR
        logger = RunLogger(MlflowClient(server.url), RID, folder, flush_timeout_s=3, request_timeout_s=1)
        logger.log_artifact(tmp_path / "report.md")
        logger.log_table({"q": ["a"]}, "completions/start.json")
        logger.log_model("m", str(tmp_path), {}, step=1)
        logger.log_metrics({"loss": 1.0}, step=1)
        t0 = time.monotonic()
        sent = _in_thread(lambda: logger.end(True), 3)
        assert sent is False, f"close(3 s) still waiting after {time.monotonic() - t0:.0f} s"
        assert not logger.sender._thread.is_alive()
    assert Journal(folder, RID).pending_count() == 5  # the four lines and the status


def test_a_bounded_replay_stops_between_lines_when_the_backlog_outlasts_it(mlflow_server, tmp_path):
    """The server answers, slowly (a proxy adds 0.3 s a request): 30 artifact lines need about 20 s; replay with
    a 1.5 s bound returns in time, and every line is either on the server or still in the journal."""
    client = MlflowClient(mlflow_server)
    exp = client.get_experiment_by_name("bounds") or client.get_experiment(client.create_experiment("bounds"))
    rid = client.create_run(exp.experiment_id).info.run_id
    folder = tmp_path / JOURNAL_DIR
    with FlakyProxy(mlflow_server, [], delay_s=0.3) as proxy:
        journal = Journal(folder, rid, store=store_record(proxy.url, "bounds"))
        for i in range(30):
            (tmp_path / f"a{i}.txt").write_text(str(i))
            journal.append({"op": "artifact", "path": str(tmp_path / f"a{i}.txt"), "dir": None})
        journal.close()
        done = _in_thread(lambda: replay(folder, proxy.url, timeout=1.5, request_timeout_s=10), 1.5)
        assert done is not None, "replay(timeout=1.5) still sending"
    sent = {a.path for a in client.list_artifacts(rid)}
    assert 0 < done[rid].left < 30 and len(sent) + done[rid].left >= 30
    assert Journal(folder, rid).pending_count() == done[rid].left
