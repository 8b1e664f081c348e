"""The background thread that sends a run's journal (tasks/tracking/journal.py) to MLflow, and ``replay`` for what a
previous process left unsent (``grpoflow sync``, ``grpoflow resume``).

While the server does not answer, the thread warns once, then every minute (how long, how much is buffered, where),
and once more when it answers again. :meth:`Sender.close` waits at most ``timeout`` seconds for the journal to be
sent, ``replay`` at most its ``timeout``: each stops between lines at its deadline, and every request it makes is
one try that ends by then (tasks/tracking/bounds.py); what is left stays in the journal with a one-line message.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from grpoflow.tasks.tracking.bounds import bounded, out_of_time
from grpoflow.tasks.tracking.journal import WARN_EVERY_S, Journal, backoff_s, file_state, group
from grpoflow.tasks.tracking.journal_store import describe, other_store
from grpoflow.tasks.tracking.refusal import NOT_ACTIVE, first_line, send_splitting

log = logging.getLogger("grpoflow.tracking")


class FastClient:
    """What the sender calls: log_batch, update_run, artifacts. For an http(s) server the run calls go through
    MLflow's REST store with no retries of its own and a ``request_timeout_s`` timeout; other stores (SQLite)
    through MlflowClient. The rest (artifacts, tables, models) through MlflowClient, bounded the same way while the
    sender sends (tasks/tracking/bounds.py)."""

    def __init__(self, uri: str, request_timeout_s: float):
        from mlflow.tracking import MlflowClient

        self.uri = uri
        self.request_timeout_s = request_timeout_s
        self.client = MlflowClient(uri)
        self.rest = None
        if uri.lower().startswith(("http://", "https://")):
            self.rest = _fast_rest_store(uri, request_timeout_s)

    def log_batch(self, run_id: str, metrics, params, tags) -> None:
        if self.rest is not None:
            self.rest.log_batch(run_id, metrics, params, tags)
        else:
            self.client.log_batch(run_id, metrics=metrics, params=params, tags=tags, synchronous=True)

    def update_run(self, run_id: str, status: str, end_time: int | None) -> None:
        from mlflow.entities import RunStatus

        if self.rest is not None:
            self.rest.update_run_info(run_id, RunStatus.from_string(status), end_time, None)
        elif end_time is None:
            self.client.update_run(run_id, status=status)
        else:
            self.client.set_terminated(run_id, status, end_time)


def _fast_rest_store(uri: str, timeout: float):
    """MLflow's RestStore whose requests make one try with ``timeout``: the sender does its own backoff."""
    from mlflow.store.tracking.rest_store import RestStore
    from mlflow.utils.credentials import get_default_host_creds
    from mlflow.utils.proto_json_utils import parse_dict
    from mlflow.utils.rest_utils import http_request, verify_rest_response

    class OneTryRestStore(RestStore):
        def _call_endpoint(self, api, json_body=None, endpoint=None, retry_timeout_seconds=None, response_proto=None):
            import json

            path, method = self._METHOD_TO_INFO[api]
            kwargs: dict[str, Any] = {"params" if method == "GET" else "json": json.loads(json_body or "{}")}
            response = http_request(
                self.get_host_creds(),
                endpoint or path,
                method,
                max_retries=0,
                backoff_factor=0,
                backoff_jitter=0,
                timeout=timeout,
                **kwargs,
            )
            response = verify_rest_response(response, endpoint or path)
            proto = response_proto or api.Response()
            if response.status_code != 204 and response.text:
                parse_dict(js_dict=json.loads(response.text), message=proto)
            return proto

    return OneTryRestStore(lambda: get_default_host_creds(uri))


KINDS = {"m": "metric", "p": "param", "t": "tag"}


def send(client: FastClient, run_id: str, op: dict[str, Any]) -> None:
    """Carry out one journal line against the store."""
    from mlflow.entities import Metric, Param, RunTag

    kind = op["op"]
    if kind == "batch":
        metrics = [Metric(k, float(v), int(ts), int(step)) for k, v, ts, step in op.get("m", ())]
        client.log_batch(
            run_id, metrics, [Param(k, v) for k, v in op.get("p", ())], [RunTag(k, v) for k, v in op.get("t", ())]
        )
    elif kind == "status":
        client.update_run(run_id, op["status"], op.get("end_time"))
    elif kind == "artifact":
        path = Path(op["path"])
        if not path.exists():
            log.warning("run %s: artifact %s no longer exists; not sent", run_id, path)
        elif op.get("state") is not None and file_state(path) != op["state"]:  # a line of an older journal: none
            log.warning(
                "run %s: artifact %s changed since it was logged (its stage ran again); not sent, so the run does "
                "not get another attempt's files", run_id, path,
            )  # fmt: skip
        elif path.is_dir():
            client.client.log_artifacts(run_id, str(path), op.get("dir"))
        else:
            client.client.log_artifact(run_id, str(path), op.get("dir"))
    elif kind == "table" and op.get("whole"):
        from grpoflow.tasks.tracking.entities import log_table_file

        log_table_file(client.client, run_id, op["path"], op["file"])
    elif kind == "table":  # a line of an older journal: its rows, which MLflow appends to the run's table
        import json

        client.client.log_table(run_id, data=json.loads(Path(op["path"]).read_text()), artifact_file=op["file"])
    elif kind == "model":
        from grpoflow.tasks.tracking.entities import log_model_output

        log_model_output(client.client, run_id, op["name"], op["path"], op["params"], op["step"])
    else:
        raise ValueError(f"unknown journal line {kind!r}")


def deliver(client: FastClient, run_id: str, op: dict[str, Any]) -> list[tuple[str, str]]:
    """Send one (merged) journal line; returns what the store refused for good as (what, reason), e.g.
    ("metric 'rewards/<lambda>/mean'", "INVALID_PARAMETER_VALUE: ..."). A refused batch is bisected: the rest of it
    is sent. A passing failure raises (the line stays in the journal)."""
    if op["op"] != "batch":
        what = f"{op['op']} {op.get('path') or op.get('status') or op.get('name') or ''}".strip()
        return [(what, reason) for _, reason in send_splitting(lambda _: send(client, run_id, op), [op])]
    items = [(k, item) for k in KINDS for item in op.get(k, ())]

    def send_items(part):
        send(client, run_id, {"op": "batch", **{k: [item for kind, item in part if kind == k] for k in KINDS}})

    return [(f"{KINDS[k]} {item[0]!r}", reason) for (k, item), reason in send_splitting(send_items, items)]


class Sender:
    """One thread per journal: sends its lines in order, with backoff while the store does not answer."""

    def __init__(self, journal: Journal, uri: str, request_timeout_s: float = 10.0):
        self.journal = journal
        self.uri = uri
        self.request_timeout_s = request_timeout_s
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._idle = threading.Event()
        self.down_since: float | None = None
        self.failures = 0
        self._next_try = 0.0
        self._last_warn = 0.0
        self.last_error = ""
        self.dropped: list[str] = []  # what the store refused for good: "metric 'key'", ...
        self._client: FastClient | None = None
        self._deadline = float("inf")
        self._thread = threading.Thread(target=self._loop, name=f"mlflow-sender-{journal.run_id[:8]}", daemon=True)
        self._thread.start()

    @property
    def client(self) -> FastClient:
        if self._client is None:
            self._client = FastClient(self.uri, self.request_timeout_s)
        return self._client

    def wake(self) -> None:
        self._idle.clear()
        self._wake.set()

    @property
    def reachable(self) -> bool:
        return self.down_since is None

    def drain_once(self) -> bool:
        """Send what is pending now; True when the journal is fully sent, False after a failed send or at the
        deadline (checked between lines; each request ends by it too)."""
        while ops := self.journal.pending():
            for end, op in group(ops):
                if time.monotonic() >= self._deadline:
                    return False
                if op["op"] == "bad":
                    self.journal.quarantine(op["offset"], op["text"].encode(), "a line that is not JSON")
                    self.journal.mark_sent(end)
                    continue
                try:
                    with bounded(self.client.request_timeout_s, self._deadline):
                        refused = deliver(self.client, self.journal.run_id, op)
                except Exception as e:
                    if not out_of_time(e):  # the time ran out before a request: says nothing of the server
                        self._failed(e)
                    return False
                for what, reason in refused:
                    self.dropped.append(what)
                    log.warning(
                        "run %s: MLflow %s refused %s for good (%s); dropped from %s",
                        self.journal.run_id,
                        self.uri,
                        what,
                        reason,
                        self.journal.path,
                    )
                self.journal.mark_sent(end)
                self._recovered()
        return True

    def _failed(self, e: BaseException) -> None:
        now = time.monotonic()
        self.failures += 1
        self._next_try = now + backoff_s(self.failures)
        self.last_error = first_line(e)
        if self.down_since is None:
            self.down_since = now
        if now - self._last_warn >= WARN_EVERY_S or self.failures == 1:
            self._last_warn = now
            log.warning(
                "MLflow tracking %s unreachable for %.0f s (%s); training goes on, %d records of run %s buffered in %s",
                self.uri,
                now - self.down_since,
                self.last_error,
                self.journal.pending_count(),
                self.journal.run_id,
                self.journal.path,
            )

    def _recovered(self) -> None:
        if self.down_since is not None:
            log.warning(
                "MLflow tracking %s answers again after %.0f s; sending %d buffered records of run %s",
                self.uri,
                time.monotonic() - self.down_since,
                self.journal.pending_count(),
                self.journal.run_id,
            )
        self.down_since, self.failures = None, 0

    def _loop(self) -> None:
        while True:
            now = time.monotonic()
            stopping = self._stop.is_set()
            if stopping and now >= self._deadline:
                return
            if not self.failures:
                self._wake.wait(1.0)
            elif self._next_try > now:  # backing off: new lines do not shorten the wait, close() does
                self._wake.wait(min(self._next_try, self._deadline) - now)
                self._wake.clear()
                if time.monotonic() < self._next_try:
                    continue
            self._wake.clear()
            try:
                done = self.drain_once()
            except Exception as e:  # a bug in the sender must never reach training: keep the journal, say so
                log.error(
                    "run %s: tracking sender error %r; %s keeps the rest", self.journal.run_id, e, self.journal.path
                )
                self._failed(e)
                done = False
            if done:
                self._idle.set()
                if self._stop.is_set():
                    return

    def close(self, timeout: float) -> bool:
        """Stop after sending what is pending, waiting at most ``timeout`` s; True when all of it was sent."""
        self._deadline = time.monotonic() + timeout
        self._next_try = min(self._next_try, time.monotonic())  # one more try now, then the backoff within timeout
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout + 1.0)
        left = self.journal.pending_count()
        if left:
            why = f"not all sent in {timeout:g} s"  # it answers, but the backlog outlasted the time
            if self.down_since is not None:
                why = f"unreachable ({self.last_error or 'no answer in time'})"
            log.warning(
                "MLflow tracking %s %s: %d records of run %s stay in %s; `grpoflow sync RUN_DIR` or "
                "`grpoflow resume RUN_DIR` sends them",
                self.uri,
                why,
                left,
                self.journal.run_id,
                self.journal.path,
            )
        return left == 0

    def flush(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for everything appended so far to be sent (the thread keeps running)."""
        deadline = time.monotonic() + timeout
        while self.journal.pending_count():
            if self.failures:
                self._next_try = min(self._next_try, time.monotonic())
            self.wake()
            if time.monotonic() >= deadline:
                return False
            self._idle.wait(min(0.2, max(deadline - time.monotonic(), 0.01)))
        return True


@dataclass
class Replayed:
    """What ``replay`` did with one journal: records ``left`` unsent and why (``error``: the store's last answer;
    ``other_store``: the store it was written for, when that is not the one given and not forced), and the items
    the store refused for good (``dropped``: "metric 'key'", ...); ``deleted``: what to do when the records wait
    because their run or its experiment is deleted (tasks/tracking/deleted.py)."""

    left: int
    dropped: list[str] = field(default_factory=list)
    error: str = ""
    other_store: str = ""
    deleted: str = ""


def replay(
    folder: Path, uri: str, timeout: float, request_timeout_s: float = 10.0, force_store: bool = False
) -> dict[str, Replayed]:
    """Send what every journal in ``folder`` left unsent, each in order, retrying passing failures until ``timeout``
    s have gone by; {journal name: Replayed}. A journal written for another store than ``uri`` is not sent unless
    ``force_store``. A torn last line is cut off first (Journal.repair) unless a writer holds the journal."""
    out: dict[str, Replayed] = {}
    if not Path(folder).is_dir():
        return out
    deadline = time.monotonic() + timeout
    client = None
    for path in sorted(Path(folder).glob("*.jsonl")):
        journal = Journal(path.parent, Journal.run_of(path), path.stem)
        journal.repair()
        if journal.pending_count() == 0:
            continue
        if not force_store and (record := other_store(path, uri)) is not None:
            log.warning("tracking journal %s was written for %s, not %s: not sent", path, describe(record), uri)
            out[journal.name] = Replayed(journal.pending_count(), other_store=describe(record))
            continue
        client = client or FastClient(uri, request_timeout_s)
        sender = _Replayer(journal, client, deadline)
        while not sender.drain_once() and time.monotonic() < deadline:
            time.sleep(min(backoff_s(sender.failures), max(deadline - time.monotonic(), 0)))
        left = journal.pending_count()
        out[journal.name] = Replayed(left, sender.dropped, sender.last_error if left else "")
        if left and NOT_ACTIVE in sender.last_error:
            from grpoflow.tasks.tracking.deleted import deleted_note

            out[journal.name].deleted = deleted_note(client.client, journal, request_timeout_s)
        if left == 0:
            log.info("run %s: journal %s sent", journal.run_id, path)
    return out


class _Replayer(Sender):
    """A Sender without its thread (``replay`` drives it)."""

    def __init__(self, journal: Journal, client: FastClient, deadline: float):  # noqa: D107
        self.journal, self.uri, self._client, self._deadline = journal, client.uri, client, deadline
        self.down_since, self.failures, self._next_try, self._last_warn, self.last_error = None, 0, 0.0, 0.0, ""
        self.dropped = []
