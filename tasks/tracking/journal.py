"""Tracking that never blocks training: a journal per MLflow run and a background thread that sends it.

Every metric, param, tag, artifact and status change of a run is appended to
``<workspace>/tracking-journal/<run_id>.jsonl`` by the calling thread (a local write, no network), one JSON
object a line; one background thread per run sends the lines in order and records in ``<run_id>.sent`` the
byte offset sent so far. A server that does not answer stops nothing: the journal keeps growing, the thread
retries with its own backoff (1, 2, 4 ... 30 s) and replays the rest in order when the server answers again.

Why our own journal rather than MLflow's ``synchronous=False``: MLflow's AsyncLoggingQueue (3.x) keeps its
batches in an unbounded in-memory queue, and a batch whose send fails is logged as an error and dropped; nothing
survives the process, nothing is replayed. Here a killed process loses nothing it logged: the next
``grpoflow resume`` or ``grpoflow sync RUN_DIR`` sends the rest.

Nothing is lost or duplicated: the offset advances only after the store accepted a line, so a crash between the
two resends that line, and the store absorbs the repeat: a metric point is keyed by (key, step, timestamp, value)
(the timestamp is taken when the point is logged and kept in the journal; MLflow's SQL store ignores a point it
already holds), a param may be logged again with the same value, tags, artifacts and status overwrite. A line the
store refuses (a 4xx answer: an invalid value) is skipped with a warning, never retried forever.

Sends to an http(s) server use no HTTP retries of MLflow's own and a short timeout (``tracking.request_timeout_s``):
MLflow's defaults retry for minutes, which would hide a server that is back behind a long backoff.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)
JOURNAL_DIR = "tracking-journal"
WARN_EVERY_S = 60.0
MAX_BACKOFF_S = 30.0
BATCH_LIMITS = {"m": 1000, "p": 100, "t": 100}  # MLflow's log_batch limits (metrics, params, tags)


def backoff_s(failures: int) -> float:
    """Seconds before the next try after ``failures`` consecutive failed sends: min(2^(failures-1), 30)."""
    return min(2.0 ** max(failures - 1, 0), MAX_BACKOFF_S)


class Journal:
    """The append-only log of one run's tracking calls (``<folder>/<name>.jsonl``) and its sent offset."""

    def __init__(self, folder: Path, run_id: str, name: str | None = None):
        self.folder = Path(folder)
        self.run_id = run_id
        self.name = name or run_id
        self.path = self.folder / f"{self.name}.jsonl"
        self.offset_path = self.folder / f"{self.name}.sent"
        self.files = self.folder / f"{self.name}.files"  # what log_dict/log_text/log_table wrote, until sent
        self._lock = threading.Lock()
        self._seq = 0
        self._made = False  # the folder, made on the first append (reading a journal creates nothing)

    @staticmethod
    def run_of(path: Path) -> str:
        return path.name.split(".", 1)[0]

    def append(self, op: dict[str, Any]) -> None:
        line = json.dumps(op, separators=(",", ":")) + "\n"
        with self._lock:
            if not self._made:
                self.folder.mkdir(parents=True, exist_ok=True)
                self._made = True
            with self.path.open("a") as f:
                f.write(line)

    def blob(self, name: str, data: bytes) -> Path:
        """A file under <name>.files/<n>/ holding ``data`` (the artifact as it was when logged)."""
        with self._lock:
            self._seq += 1
            folder = self.files / f"{time.time_ns()}-{self._seq}"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / Path(name).name
        path.write_bytes(data)
        return path

    def sent(self) -> int:
        try:
            return int(self.offset_path.read_text().strip() or 0)
        except (OSError, ValueError):
            return 0

    def mark_sent(self, offset: int) -> None:
        tmp = self.offset_path.with_suffix(".sent.tmp")
        tmp.write_text(str(offset))
        os.replace(tmp, self.offset_path)

    def size(self) -> int:
        try:
            return self.path.stat().st_size
        except OSError:
            return 0

    def pending(self, limit: int = 2000) -> list[tuple[int, dict[str, Any]]]:
        """Up to ``limit`` unsent lines as (offset after the line, op); a partial last line (being written) waits."""
        out: list[tuple[int, dict[str, Any]]] = []
        start = self.sent()
        try:
            with self.path.open("rb") as f:
                f.seek(start)
                pos = start
                for raw in f:
                    if not raw.endswith(b"\n"):
                        break
                    pos += len(raw)
                    out.append((pos, json.loads(raw)))
                    if len(out) >= limit:
                        break
        except FileNotFoundError:
            pass
        return out

    def pending_count(self) -> int:
        try:
            with self.path.open("rb") as f:
                f.seek(self.sent())
                return sum(1 for raw in f if raw.endswith(b"\n"))
        except FileNotFoundError:
            return 0


def group(ops: list[tuple[int, dict[str, Any]]]) -> list[tuple[int, dict[str, Any]]]:
    """Consecutive ``batch`` lines merged into one batch within MLflow's limits (order kept): fewer requests."""
    out: list[tuple[int, dict[str, Any]]] = []
    for end, op in ops:
        prev = out[-1][1] if out else None
        if (
            prev is not None
            and op["op"] == "batch"
            and prev["op"] == "batch"
            and all(len(prev.get(k, ())) + len(op.get(k, ())) <= n for k, n in BATCH_LIMITS.items())
            and sum(len(prev.get(k, ())) + len(op.get(k, ())) for k in BATCH_LIMITS) <= 1000
        ):
            merged = {"op": "batch", **{k: [*prev.get(k, ()), *op.get(k, ())] for k in BATCH_LIMITS}}
            out[-1] = (end, merged)
        else:
            out.append((end, op))
    return out


def permanent(exc: BaseException) -> bool:
    """An error that a retry cannot fix: MLflow's answer with a 4xx status (an invalid value, a deleted run)."""
    from mlflow.exceptions import MlflowException, RestException

    if isinstance(exc, RestException | MlflowException):
        try:
            return 400 <= exc.get_http_status_code() < 500
        except Exception:
            return False
    return False
