"""A journal survives what a crash or a full disk leaves in it: a torn last line is cut off into <name>.torn with a
warning naming the file and byte offset, a line that is not JSON is quarantined instead of stopping the sender, and
two processes marking the journal sent never share a temporary file."""

import json
import logging
import multiprocessing
from pathlib import Path

from mlflow.tracking import MlflowClient

from grpoflow.tasks.tracking.journal import JOURNAL_DIR, Journal
from grpoflow.tasks.tracking.sender import replay


def _lines(n: int, start: int = 1) -> list[dict]:
    return [{"op": "batch", "m": [["loss", 1.0 / s, 1000 + s, s]], "p": [], "t": []} for s in range(start, start + n)]


def _write(folder: Path, name: str, ops: list[dict], torn: bytes = b"") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.jsonl"
    path.write_bytes(b"".join(json.dumps(op, separators=(",", ":")).encode() + b"\n" for op in ops) + torn)
    return path


def _run(tmp: Path) -> tuple[MlflowClient, str]:
    client = MlflowClient(f"sqlite:///{tmp / 'mlflow.db'}")
    exp = client.create_experiment("e", artifact_location=(tmp / "art").as_uri())
    return client, client.create_run(exp).info.run_id


def test_the_next_writer_cuts_a_torn_last_line_and_keeps_it_aside(tmp_path, caplog):
    folder = tmp_path / JOURNAL_DIR
    path = _write(folder, "r1", _lines(3), torn=b'{"op":"batch","m":[["loss",0.2')
    good = path.stat().st_size - len(b'{"op":"batch","m":[["loss",0.2')
    with caplog.at_level(logging.WARNING):
        journal = Journal(folder, "r1")
        journal.append(_lines(1, start=4)[0])  # a resumed process appends after the crash
        journal.close()
    assert f"{path}" in caplog.text and f"at byte {good}" in caplog.text
    ops = [op for _, op in journal.pending()]
    assert [op["m"][0][3] for op in ops] == [1, 2, 3, 4]  # every line parses: the sender is not blocked
    torn = json.loads((folder / "r1.torn").read_text())
    assert torn["offset"] == good and torn["text"].startswith('{"op":"batch"')


def test_a_torn_line_followed_by_a_good_one_is_quarantined_and_the_good_one_sent(tmp_path, caplog):
    """A journal an older version appended to after a crash: the torn bytes and the next line share a line."""
    client, rid = _run(tmp_path)
    folder = tmp_path / JOURNAL_DIR
    a, b = _lines(2)
    path = _write(folder, rid, [a])
    with path.open("ab") as f:
        f.write(b'{"op":"batch","m":[["lo' + json.dumps(b, separators=(",", ":")).encode() + b"\n")
        f.write(b"not json at all\n")
    with caplog.at_level(logging.WARNING):
        done = replay(folder, client.tracking_uri, timeout=30)
    assert done[rid].left == 0
    assert sorted(m.step for m in client.get_metric_history(rid, "loss")) == [1, 2]
    assert caplog.text.count(str(path)) >= 2 and len((folder / f"{rid}.torn").read_text().splitlines()) == 2


def test_replay_cuts_a_torn_tail_no_writer_holds_and_sends_the_rest(tmp_path, caplog):
    client, rid = _run(tmp_path)
    folder = tmp_path / JOURNAL_DIR
    path = _write(folder, rid, _lines(5), torn=b'{"op":"ba')
    with caplog.at_level(logging.WARNING):
        done = replay(folder, client.tracking_uri, timeout=30)
    assert done[rid].left == 0 and str(path) in caplog.text
    assert sorted(m.step for m in client.get_metric_history(rid, "loss")) == [1, 2, 3, 4, 5]
    assert path.read_bytes().endswith(b"\n")


def test_a_live_writers_partial_line_is_left_alone(tmp_path):
    folder = tmp_path / JOURNAL_DIR
    writer = Journal(folder, "r")
    writer.append(_lines(1)[0])
    with writer.path.open("ab") as f:  # the writer in the middle of a line
        f.write(b'{"op":"ba')
    Journal(folder, "r").repair()
    assert writer.path.read_bytes().endswith(b'{"op":"ba') and not (folder / "r.torn").exists()
    writer.close()


def _mark(folder: str, n: int) -> None:
    journal = Journal(Path(folder), "r")
    for i in range(1, n + 1):
        journal.mark_sent(i)


def test_two_processes_marking_sent_never_collide(tmp_path):
    folder = tmp_path / JOURNAL_DIR
    folder.mkdir()
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_mark, args=(str(folder), 300)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0]  # the shared .sent.tmp raised FileNotFoundError in the loser
    assert Journal(folder, "r").sent() == 300 and not list(folder.glob("*.tmp"))
