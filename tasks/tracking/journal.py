"""Tracking that never blocks training: a journal per MLflow run and a background thread that sends it.

Every metric, param, tag, artifact and status change of a run is appended to
``<workspace>/tracking-journal/<run_id>.jsonl`` by the calling thread (a local write, no network), one JSON
object a line; one background thread per run sends the lines in order and records in ``<run_id>.sent`` the
byte offset sent so far. A server that does not answer stops nothing: the journal keeps growing, the thread
retries with its own backoff (1, 2, 4 ... 30 s) and replays the rest in order when the server answers again.
``<run_id>.store.json`` records the store the journal was written for (tasks/tracking/journal_store.py):
``grpoflow sync`` refuses to send it to another one.

Why our own journal rather than MLflow's ``synchronous=False``: MLflow's AsyncLoggingQueue (3.x) keeps its
batches in an unbounded in-memory queue, and a batch whose send fails is logged as an error and dropped; nothing
survives the process, nothing is replayed. Here a killed process loses nothing it logged: the next
``grpoflow resume`` or ``grpoflow sync RUN_DIR`` sends the rest.

Nothing is lost or duplicated: the offset advances only after the store accepted a line, so a crash between the
two resends that line, and the store absorbs the repeat: a metric point is keyed by (key, step, timestamp, value)
(the timestamp is taken when the point is logged and kept in the journal; MLflow's SQL store ignores a point it
already holds), a param may be logged again with the same value, tags, artifacts, whole tables and status overwrite,
and a model line finds the model it created (tasks/tracking/entities.py). Only an item the store refuses as invalid
is dropped (tasks/tracking/refusal.py); every other failure is retried.

Durability: each line is written and flushed at once (the sender, and a process that dies next, see it whole);
:meth:`Journal.sync` (fsync) runs at the end of each logged step and on close, so a machine that loses power loses
at most the last step. A crash or a full disk mid-write can still leave a torn last line: the next writer of the
journal (or ``sync``/``resume`` when no writer holds it) cuts it off into ``<run_id>.torn`` with a warning naming
the file and byte offset, and a complete line that is not JSON is quarantined there too instead of stopping the
sender. A writer holds a shared ``flock`` on the journal while open, so a torn tail is cut only when nobody writes.

Sends to an http(s) server use no HTTP retries of MLflow's own and a short timeout (``tracking.request_timeout_s``):
MLflow's defaults retry for minutes, which would hide a server that is back behind a long backoff.
"""

from __future__ import annotations

import fcntl
import json
import logging
import math
import os
import threading
import time
from pathlib import Path
from typing import Any, BinaryIO

log = logging.getLogger(__name__)
JOURNAL_DIR = "tracking-journal"
WARN_EVERY_S = 60.0
MAX_BACKOFF_S = 30.0
BATCH_LIMITS = {"m": 1000, "p": 100, "t": 100}  # MLflow's log_batch limits (metrics, params, tags)
OP_START = b'{"op":'  # every line begins so (json.dumps with compact separators, "op" first)


def file_state(path: Path) -> str | None:
    """What an artifact's files are now, in 16 hex digits: a digest of each file's relative name, size and
    modification time (a folder's files, in order); None when ``path`` is gone. An artifact line records it when
    logged; the sender sends the path only while it is the same (:func:`grpoflow.tasks.tracking.sender.send`)."""
    import hashlib

    if not path.exists():
        return None
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    h = hashlib.sha256()
    for f in files:
        st = f.stat()
        h.update(f"{f.relative_to(path) if path.is_dir() else f.name}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


def backoff_s(failures: int) -> float:
    """Seconds before the next try after ``failures`` consecutive failed sends: min(2^(failures-1), 30)."""
    return min(2.0 ** max(failures - 1, 0), MAX_BACKOFF_S)


class Journal:
    """The append-only log of one run's tracking calls (``<folder>/<name>.jsonl``) and its sent offset.

    ``store``: what :meth:`append` records in ``<name>.store.json`` the first time (the redacted tracking URI and
    experiment the lines are meant for); None writes nothing (a journal read to be sent)."""

    def __init__(self, folder: Path, run_id: str, name: str | None = None, store: dict[str, Any] | None = None):
        self.folder = Path(folder)
        self.run_id = run_id
        self.name = name or run_id
        self.path = self.folder / f"{self.name}.jsonl"
        self.offset_path = self.folder / f"{self.name}.sent"
        self.store_path = self.folder / f"{self.name}.store.json"
        self.torn_path = self.folder / f"{self.name}.torn"
        self.files = self.folder / f"{self.name}.files"  # what log_dict/log_text/log_table wrote, until sent
        self.store = store
        self._lock = threading.Lock()
        self._seq = 0
        self._fh: BinaryIO | None = None  # opened on the first append (reading a journal creates nothing)
        self._unsynced = False

    @staticmethod
    def run_of(path: Path) -> str:
        return path.name.split(".", 1)[0]

    def _open(self) -> BinaryIO:
        self.folder.mkdir(parents=True, exist_ok=True)
        fh = self.path.open("ab")
        self._cut_torn_tail(fh)
        fcntl.flock(fh, fcntl.LOCK_SH)  # a writer is here: nobody cuts the line it may be in the middle of
        if self.store is not None and not self.store_path.exists():
            _write_atomic(self.store_path, json.dumps(self.store, indent=2).encode())
        return fh

    def append(self, op: dict[str, Any]) -> None:
        """Write one line and flush it (the sender reads it next); fsync waits for :meth:`sync`."""
        # allow_nan: a NaN or infinite metric is written as NaN / Infinity / -Infinity, which json.loads reads back
        # (JSON proper has no such numbers; this file is read only by this module), so it reaches MLflow as it was
        line = (json.dumps(op, separators=(",", ":"), allow_nan=True) + "\n").encode()
        with self._lock:
            if self._fh is None:
                self._fh = self._open()
            self._fh.write(line)
            self._fh.flush()
            self._unsynced = True

    def sync(self) -> None:
        """fsync what was appended since the last call (end of a logged step, close)."""
        with self._lock:
            if self._fh is not None and self._unsynced:
                os.fsync(self._fh.fileno())
                self._unsynced = False

    def close(self) -> None:
        self.sync()
        with self._lock:
            if self._fh is not None:
                self._fh.close()  # releases the flock
                self._fh = None

    def repair(self) -> None:
        """Cut a torn last line off (into ``<name>.torn``, with a warning) unless a writer holds the journal."""
        if not self.path.is_file():
            return
        with self.path.open("ab") as fh:
            self._cut_torn_tail(fh)

    def _cut_torn_tail(self, fh: BinaryIO) -> None:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return  # a live writer: its last line may be half written right now
        try:
            size = os.fstat(fh.fileno()).st_size
            start = _last_line_start(self.path, size)
            if start == size:
                return
            with self.path.open("rb") as f:
                f.seek(start)
                torn = f.read()
            self.quarantine(start, torn, "a torn last line (the process died or the disk filled mid-write)")
            os.ftruncate(fh.fileno(), start)
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)

    def quarantine(self, offset: int, data: bytes, why: str) -> None:
        """Keep ``data`` (found at byte ``offset``) in ``<name>.torn`` and say so, naming the file and offset."""
        record = {"offset": offset, "why": why, "text": data.decode("utf-8", "replace")}
        with self.torn_path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        log.warning(
            "tracking journal %s: %s at byte %d (%d bytes) not sent; kept in %s",
            self.path,
            why,
            offset,
            len(data),
            self.torn_path,
        )

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
        """Record ``offset`` as sent: a temporary file of this process and thread, then an atomic rename (two
        processes sending the same journal never share a temporary file); an offset never moves back."""
        if offset <= self.sent():
            return
        tmp = self.folder / f"{self.name}.sent.{os.getpid()}-{threading.get_ident()}.tmp"
        _write_atomic(self.offset_path, str(offset).encode(), tmp)

    def size(self) -> int:
        try:
            return self.path.stat().st_size
        except OSError:
            return 0

    def pending(self, limit: float = 2000) -> list[tuple[int, dict[str, Any]]]:
        """Up to ``limit`` unsent lines as (offset after the line, op); a partial last line (being written) waits.
        A complete line that is not JSON comes as ``{"op": "bad", "offset", "text"}`` (the sender quarantines it);
        one that holds a whole line after a torn one (an older journal appended after a crash) keeps that line."""
        out: list[tuple[int, dict[str, Any]]] = []
        start = self.sent()
        try:
            with self.path.open("rb") as f:
                f.seek(start)
                pos = start
                for raw in f:
                    if not raw.endswith(b"\n"):
                        break
                    out.extend(_parse(raw, pos))
                    pos += len(raw)
                    out[-1] = (pos, out[-1][1])
                    if len(out) >= limit:
                        break
        except FileNotFoundError:
            pass
        return out

    def pending_steps(self) -> dict[str, int]:
        """{metric key: last step} of the unsent lines: steps a reopened run holds once they are sent, so a resumed
        stage must not log them again (RunLogger.reopened)."""
        out: dict[str, int] = {}
        for _, op in self.pending(limit=math.inf):
            for key, _, _, step in op.get("m", ()) if op["op"] == "batch" else ():
                out[key] = max(out.get(key, -1), int(step))
        return out

    def pending_count(self) -> int:
        try:
            with self.path.open("rb") as f:
                f.seek(self.sent())
                return sum(1 for raw in f if raw.endswith(b"\n"))
        except FileNotFoundError:
            return 0


def _parse(raw: bytes, pos: int) -> list[tuple[int, dict[str, Any]]]:
    """The op(s) of one complete line at byte ``pos``: the op; or a "bad" op for what is not JSON, followed by the
    whole line after it when a torn line and a good one share it."""
    try:
        return [(pos, json.loads(raw))]
    except ValueError:
        pass
    cut = raw.rfind(OP_START)
    if cut > 0:
        try:
            op = json.loads(raw[cut:])
        except ValueError:
            pass
        else:
            return [(pos, {"op": "bad", "offset": pos, "text": raw[:cut].decode("utf-8", "replace")}), (pos, op)]
    return [(pos, {"op": "bad", "offset": pos, "text": raw.decode("utf-8", "replace")})]


def _last_line_start(path: Path, size: int) -> int:
    """The byte after the last newline of the file (``size`` when it ends with one, 0 when it holds none)."""
    with path.open("rb") as f:
        pos = size
        while pos > 0:
            n = min(65536, pos)
            pos -= n
            f.seek(pos)
            i = f.read(n).rfind(b"\n")
            if i >= 0:
                return pos + i + 1
    return 0


def _write_atomic(path: Path, data: bytes, tmp: Path | None = None) -> None:
    """``data`` in ``path`` whole or not at all, across a power loss too: the temporary file is on disk (fsync)
    before the rename, so the rename never points ``path`` at a file whose blocks were not yet written (an empty
    sent offset reads 0, and the whole journal, its tables too, would be sent again)."""
    tmp = tmp or path.with_name(f"{path.name}.{os.getpid()}-{threading.get_ident()}.tmp")
    with tmp.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


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
