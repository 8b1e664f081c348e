"""Only MLflow's 400 INVALID_PARAMETER_VALUE drops an item, and only that item: a refused batch is bisected and the
rest of it stored. Auth, rate-limit, not-found and server errors are passing. The store a journal was written for
is recorded without credentials and compared by what makes two URIs the same store."""

import json

import pytest
from mlflow.exceptions import MlflowException, RestException
from mlflow.tracking import MlflowClient

from grpoflow.tasks.tracking.journal import JOURNAL_DIR
from grpoflow.tasks.tracking.journal_store import other_store, redact_uri, store_key
from grpoflow.tasks.tracking.refusal import refused, send_splitting
from grpoflow.tasks.tracking.sender import FastClient, deliver, replay
from grpoflow.tasks.tracking.tracker import RunLogger


def _rest(status: int, code: str) -> RestException:
    e = RestException({"error_code": code, "message": "m"})
    assert e.get_http_status_code() == status
    return e


def test_only_invalid_parameter_value_is_refused_for_good():
    assert refused(_rest(400, "INVALID_PARAMETER_VALUE"))
    for e in (
        _rest(403, "PERMISSION_DENIED"),
        _rest(401, "UNAUTHENTICATED"),
        _rest(404, "RESOURCE_DOES_NOT_EXIST"),
        _rest(429, "REQUEST_LIMIT_EXCEEDED"),
        _rest(500, "INTERNAL_ERROR"),
        RestException(
            {
                "error_code": "INVALID_PARAMETER_VALUE",
                "message": "The run r must be in the 'active' state. Current state is deleted.",
            }
        ),  # the run's state (deleted in the UI, restorable), not the item's
        MlflowException("proxy said 400", error_code="BAD_REQUEST"),
        ConnectionError("refused"),
    ):
        assert not refused(e), e


def test_bisect_sends_all_but_the_refused_items_and_stops_on_a_passing_error():
    stored: list[int] = []

    def send(part):
        if any(x % 7 == 3 for x in part):
            raise _rest(400, "INVALID_PARAMETER_VALUE")
        stored.extend(part)

    out = send_splitting(send, list(range(20)))
    assert [x for x, _ in out] == [3, 10, 17] and sorted(stored) == [x for x in range(20) if x % 7 != 3]

    def down(part):
        raise _rest(403, "PERMISSION_DENIED")

    with pytest.raises(RestException):
        send_splitting(down, [1, 2])


def test_one_bad_key_in_a_merged_batch_costs_only_that_key(tmp_path):
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    rid = client.create_run(client.create_experiment("e", (tmp_path / "a").as_uri())).info.run_id
    metrics = [[f"m{i}", float(i), 1000, 1] for i in range(300)] + [["rewards/<lambda>/mean", 1.0, 1000, 1]]
    op = {"op": "batch", "m": metrics, "p": [["lr", "0.1"]], "t": [["t", "v"]]}
    dropped = deliver(FastClient(client.tracking_uri, 5), rid, op)
    assert [what for what, _ in dropped] == ["metric 'rewards/<lambda>/mean'"]
    run = client.get_run(rid)
    assert len(run.data.metrics) == 300 and run.data.params == {"lr": "0.1"} and run.data.tags["t"] == "v"


def test_the_journal_records_its_store_without_credentials(tmp_path):
    assert redact_uri("https://alice:s3cret@mlflow.example.com/x?token=abc&a=1") == (
        "https://***@mlflow.example.com/x?token=***&a=1"
    )
    assert store_key("HTTPS://u:p@MLflow.example.com/") == store_key("https://mlflow.example.com")
    assert store_key(f"sqlite:///{tmp_path}/x/../mlflow.db") == store_key(f"sqlite:///{tmp_path}/mlflow.db")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    rid = client.create_run(client.create_experiment("e", (tmp_path / "a").as_uri())).info.run_id
    logger = RunLogger(client, rid, tmp_path / JOURNAL_DIR, experiment="e")
    logger.log_metrics({"loss": 1.0}, step=1)
    assert logger.end(True)
    path = tmp_path / JOURNAL_DIR / f"{rid}.jsonl"
    assert json.loads(path.with_name(f"{rid}.store.json").read_text()) == {"tracking_uri": uri, "experiment": "e"}
    assert other_store(path, uri) is None
    assert other_store(path, f"sqlite:///{tmp_path / 'other.db'}")["tracking_uri"] == uri


def test_replay_leaves_a_journal_of_another_store_unless_forced(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    rid = client.create_run(client.create_experiment("e", (tmp_path / "a").as_uri())).info.run_id
    folder = tmp_path / JOURNAL_DIR
    folder.mkdir()
    (folder / f"{rid}.jsonl").write_text('{"op":"batch","m":[["loss",1.0,1000,1]],"p":[],"t":[]}\n')
    (folder / f"{rid}.store.json").write_text(json.dumps({"tracking_uri": "http://elsewhere:5000", "experiment": "e"}))
    done = replay(folder, uri, timeout=10)
    assert done[rid].left == 1 and done[rid].other_store.startswith("http://elsewhere:5000")
    assert replay(folder, uri, timeout=10, force_store=True)[rid].left == 0
    assert [m.step for m in client.get_metric_history(rid, "loss")] == [1]
