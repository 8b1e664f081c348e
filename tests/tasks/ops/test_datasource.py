"""The continuous flow's source listing and ledger: which files count as new, and that recording is atomic."""

import hashlib
import json
import time

import pytest

from grpoflow.tasks.ops.datasource import STATE_PREFIX, DataFile, Ledger, list_source, sha256_file, state_location


def write(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_lists_data_files_only_with_name_size_and_hash(tmp_path):
    a = write(tmp_path / "a.jsonl", [{"question": "What is 1 + 2?", "answer": "3"}])
    write(tmp_path / "sub" / "b.csv", [])
    (tmp_path / "notes.txt").write_text("not data")
    write(tmp_path / ".c.jsonl", [{"x": 1}])  # hidden: an upload in progress
    write(tmp_path / "_tmp" / "d.jsonl", [{"x": 1}])  # under a hidden folder
    files = list_source(str(tmp_path))
    assert [f.name for f in files] == ["a.jsonl", "sub/b.csv"]
    assert files[0] == DataFile("a.jsonl", str(a.resolve()), a.stat().st_size, sha256_file(a))


def test_missing_source_names_the_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        list_source(str(tmp_path / "nowhere"))


def test_ledger_consumes_once_and_sees_rewrites(tmp_path):
    src = tmp_path / "src"
    write(src / "a.jsonl", [{"question": "q1", "answer": "1"}])
    write(src / "b.jsonl", [{"question": "q2", "answer": "2"}])
    ledger = Ledger(tmp_path / "state" / "ledger.json")
    assert ledger.entries() == []
    new = ledger.new_files(list_source(str(src)))
    assert [f.name for f in new] == ["a.jsonl", "b.jsonl"]
    ledger.record(new, cycle="c1")
    assert ledger.new_files(list_source(str(src))) == []
    assert [e["cycle"] for e in json.loads(ledger.path.read_text())["consumed"]] == ["c1", "c1"]
    assert [p.name for p in ledger.path.parent.iterdir()] == ["ledger.json"]  # no temporary file left

    write(src / "a.jsonl", [{"question": "q1", "answer": "7"}])  # same name and size, other content
    write(src / "c.jsonl", [{"question": "q3", "answer": "3"}])
    again = ledger.new_files(list_source(str(src)))
    assert [f.name for f in again] == ["a.jsonl", "c.jsonl"]
    ledger.record(again, cycle="c2")
    assert len(ledger.entries()) == 4 and ledger.new_files(list_source(str(src))) == []


def test_state_location():
    """Where the continuous flow keeps its ledger: never a local folder named 's3:'."""
    assert state_location("/data/in", "s3://b/state", "runs") == "s3://b/state"
    assert state_location("s3://b/in", "/var/state", "runs") == "/var/state"
    assert state_location("/data/in", None, "s3://b/runs") == "s3://b/runs/continuous"
    assert state_location("s3://b/in/", None, "s3://b/runs") == "s3://b/runs/continuous"
    assert state_location("s3://b/in/", None, "/runs") == f"s3://b/in/{STATE_PREFIX}"
    assert state_location("/data/in", None, "/runs") == "/runs/continuous"


def test_a_broken_ledger_is_an_error_naming_it(tmp_path):
    path = tmp_path / "ledger.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="ledger.json"):
        Ledger(path).keys()


def test_s3_prefix_source_lists_fetches_and_gathers(seaweedfs, monkeypatch, tmp_path):
    """An s3://bucket/prefix source on a real S3 server: data objects only, identified by ETag; a rewritten object
    is new again; fetch and gather read the bytes back."""
    from grpoflow.tasks.config import StorageConfig
    from grpoflow.tasks.ops.continuous import gather
    from grpoflow.tasks.ops.datasource import fetch
    from grpoflow.tasks.storage import s3

    for k, v in seaweedfs.env().items():
        monkeypatch.setenv(k, v)
    store = s3.S3Client(StorageConfig(cache_dir=str(tmp_path / "cache")))
    prefix = f"s3://{seaweedfs.bucket}/incoming-{tmp_path.name}"
    a = write(tmp_path / "a.jsonl", [{"question": "What is 1 + 2?", "answer": "3"}])
    b = write(tmp_path / "b.jsonl", [{"question": "What is 2 + 2?", "answer": "4"}])
    store.upload_file(a, f"{prefix}/a.jsonl")
    store.upload_file(b, f"{prefix}/sub/b.jsonl")
    store.upload_file(b, f"{prefix}/.uploading.jsonl")  # hidden: skipped
    store.put_bytes(b"notes", f"{prefix}/notes.txt")  # not a data file
    files = list_source(prefix)
    assert [f.name for f in files] == ["a.jsonl", "sub/b.jsonl"]
    assert files[0].uri == f"{prefix}/a.jsonl" and files[0].size == a.stat().st_size
    assert files[0].hash == hashlib.md5(a.read_bytes()).hexdigest()  # single-part ETag
    assert fetch(files[1], tmp_path / "dl").read_bytes() == b.read_bytes()

    # the ledger on S3 too, under the hidden prefix the listing skips: what a restarted worker pod reads back
    state = state_location(prefix, None, str(tmp_path / "runs"))
    assert state == f"{prefix}/{STATE_PREFIX}"
    ledger = Ledger(f"{state}/ledger.json", StorageConfig(cache_dir=str(tmp_path / "cache")))
    assert ledger.entries() == []
    ledger.record(files, cycle="c1")
    assert [e["cycle"] for e in store.get_json(f"{state}/ledger.json")["consumed"]] == ["c1", "c1"]
    assert [f.name for f in list_source(prefix)] == ["a.jsonl", "sub/b.jsonl"]  # the ledger is no data file
    restarted = Ledger(f"{state}/ledger.json")  # a new process: nothing local, everything from S3
    assert restarted.new_files(list_source(prefix)) == []
    write(tmp_path / "a.jsonl", [{"question": "What is 5 + 5?", "answer": "10"}])
    store.upload_file(tmp_path / "a.jsonl", f"{prefix}/a.jsonl")
    assert [f.name for f in restarted.new_files(list_source(prefix))] == ["a.jsonl"]
    assert not (tmp_path / "s3:").exists() and not list(tmp_path.glob("**/ledger.json"))
    store.put_bytes(b"{not json", f"{state}/ledger.json")
    with pytest.raises(ValueError, match=f"ledger {state}/ledger.json: not a grpoflow ledger"):
        restarted.keys()

    out, rows, bad, changed, *_ = gather(list_source(prefix), tmp_path / "cycle" / "train.jsonl")
    assert bad == [] and changed == []
    assert rows == 2
    assert [json.loads(line)["answer"] for line in out.read_text().splitlines()] == ["10", "4"]


def _trained_answers(path):
    return [json.loads(line)["answer"] for line in path.read_text().splitlines()]


def test_a_file_rewritten_after_listing_is_left_for_the_next_cycle(tmp_path):
    """The cycle lists a.jsonl (version 1), then the writer rewrites it before the cycle reads it: the cycle must not
    train on version 2 while the ledger records version 1's identity (version 2 would then train again next cycle);
    it leaves the file out, unrecorded, and the next cycle trains version 2 once."""
    from grpoflow.tasks.ops.continuous import gather

    src = tmp_path / "src"
    write(src / "a.jsonl", [{"question": "q1", "answer": "1"}])
    write(src / "b.jsonl", [{"question": "q2", "answer": "2"}])
    ledger = Ledger(tmp_path / "state" / "ledger.json")
    listed = ledger.new_files(list_source(str(src)))
    write(src / "a.jsonl", [{"question": "q1", "answer": "1"}, {"question": "q3", "answer": "3"}])  # appended
    out, rows, bad, changed, *_ = gather(listed, tmp_path / "cycle" / "train.jsonl")
    assert bad == [] and [f.name for f in changed] == ["a.jsonl"]
    assert _trained_answers(out) == ["2"] and rows == 1  # version 2 of a.jsonl not trained under version 1's name
    ledger.record([f for f in listed if f not in changed], cycle="c1")
    again = ledger.new_files(list_source(str(src)))
    assert [f.name for f in again] == ["a.jsonl"]  # the next cycle: version 2, once
    out, rows, bad, changed, *_ = gather(again, tmp_path / "cycle2" / "train.jsonl")
    assert _trained_answers(out) == ["1", "3"] and changed == []
    ledger.record(again, cycle="c2")
    assert ledger.new_files(list_source(str(src))) == []


def test_a_file_rewritten_while_read_trains_what_was_listed(tmp_path, monkeypatch):
    """The check and the load read the file one after the other: a rewrite between them must not make the cycle
    check one version and train another; both read the snapshot whose hash the listing took."""
    from grpoflow.tasks.ops.continuous import gather

    src = tmp_path / "src"
    a = write(src / "a.jsonl", [{"question": "q1", "answer": "1"}])
    listed = list_source(str(src))

    def check(f, path):  # the writer rewrites a.jsonl right after the check read it
        write(a, [{"question": "q1", "answer": "BAD"}])
        return None

    out, rows, bad, changed, *_ = gather(listed, tmp_path / "cycle" / "train.jsonl", check=check)
    assert _trained_answers(out) == ["1"] and changed == [] and bad == []


def test_the_ledger_write_is_durable(tmp_path, monkeypatch):
    """A power loss right after a cycle must not leave an empty or old ledger: the temporary file is fsynced before
    the rename, and the folder after it."""
    import os

    synced = []
    real = os.fsync

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    src = tmp_path / "src"
    write(src / "a.jsonl", [{"question": "q1", "answer": "1"}])
    ledger = Ledger(tmp_path / "state" / "ledger.json")
    ledger.record(list_source(str(src)), cycle="c1")
    assert len(synced) == 2 and synced[0].endswith(".tmp") and synced[1] == str(tmp_path / "state")


def test_s3_object_rewritten_or_deleted_after_listing_is_left_for_the_next_cycle(seaweedfs, monkeypatch, tmp_path):
    """On a real S3 server: an object overwritten after the listing (its ETag changed) is not downloaded as the
    listed version (If-Match), a deleted one does not fail the cycle; both are left out, unrecorded."""
    from grpoflow.tasks.config import StorageConfig
    from grpoflow.tasks.ops.continuous import gather
    from grpoflow.tasks.storage import s3

    for k, v in seaweedfs.env().items():
        monkeypatch.setenv(k, v)
    store = s3.S3Client(StorageConfig(cache_dir=str(tmp_path / "cache")))
    prefix = f"s3://{seaweedfs.bucket}/rewritten-{tmp_path.name}"
    for name, answer in (("a", "1"), ("b", "2"), ("c", "3")):
        store.put_bytes(json.dumps({"question": "q", "answer": answer}).encode() + b"\n", f"{prefix}/{name}.jsonl")
    listed = list_source(prefix)
    store.put_bytes(b'{"question": "q", "answer": "1"}\n{"question": "q", "answer": "9"}\n', f"{prefix}/a.jsonl")
    store.delete_objects([f"{prefix}/c.jsonl"])
    out, rows, bad, changed, *_ = gather(listed, tmp_path / "cycle" / "train.jsonl")
    assert bad == [] and [f.name for f in changed] == ["a.jsonl", "c.jsonl"]
    assert _trained_answers(out) == ["2"]
    ledger = Ledger(tmp_path / "ledger.json")
    ledger.record([f for f in listed if f not in changed], cycle="c1")
    again = ledger.new_files(list_source(prefix))
    assert [f.name for f in again] == ["a.jsonl"]
    out, rows, bad, changed, *_ = gather(again, tmp_path / "cycle2" / "train.jsonl")
    assert _trained_answers(out) == ["1", "9"] and changed == []


def test_an_s3_file_uploaded_again_with_another_etag_is_recognised_by_its_bytes(seaweedfs, monkeypatch, tmp_path):
    """On a real S3 server: the same file uploaded again in parts (a multipart ETag, not the MD5 of the first
    upload) lists as new, but its snapshot's sha256 is the one the ledger recorded: gather leaves it out as
    ``same`` with the entry it repeats, and once recorded so the next listing skips it. New bytes under the same
    name still train, and a file the ledger recorded before sha256s were (no sha256) cannot be recognised."""
    from grpoflow.tasks.config import StorageConfig
    from grpoflow.tasks.ops.continuous import gather
    from grpoflow.tasks.storage import s3

    for k, v in seaweedfs.env().items():
        monkeypatch.setenv(k, v)
    parts = StorageConfig(cache_dir=str(tmp_path / "cache"), multipart_threshold_mb=5, multipart_chunksize_mb=5)
    store = s3.S3Client(parts)
    prefix = f"s3://{seaweedfs.bucket}/reuploaded-{tmp_path.name}"
    rows = [{"question": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(160_000)]  # 6.2 MiB
    big = write(tmp_path / "big.jsonl", rows)
    assert big.stat().st_size > 6 << 20
    store.put_bytes(big.read_bytes(), f"{prefix}/big.jsonl")  # one part: the ETag is the bytes' MD5
    ledger = Ledger(tmp_path / "ledger.json")
    first = gather(ledger.new_files(list_source(prefix)), tmp_path / "c1" / "train.jsonl", seen=ledger.contents())
    assert first.rows == len(rows) and first.same == [] and first.files[0].sha256 == sha256_file(big)
    ledger.record(first.files, cycle="c1")

    store.upload_file(big, f"{prefix}/big.jsonl")  # the same bytes in two parts: another ETag
    again = ledger.new_files(list_source(prefix))
    assert [f.name for f in again] == ["big.jsonl"] and again[0].hash != first.files[0].hash
    got = gather(again, tmp_path / "c2" / "train.jsonl", seen=ledger.contents())
    assert got.rows == 0 and got.files == [] and [(f.name, e["cycle"]) for f, e in got.same] == [("big.jsonl", "c1")]
    ledger.same_content(got.same, cycle="c2")
    assert ledger.new_files(list_source(prefix)) == []
    assert ledger.entries()[-1]["same_as"] == {"key": first.files[0].key, "cycle": "c1"}

    write(big, [*rows, {"question": "What is 1 + 0?", "answer": "1"}])  # new bytes, the same name
    store.upload_file(big, f"{prefix}/big.jsonl")
    changed = gather(ledger.new_files(list_source(prefix)), tmp_path / "c3" / "train.jsonl", seen=ledger.contents())
    assert changed.rows == len(rows) + 1 and changed.same == []
    older = Ledger(tmp_path / "older.json")  # recorded by grpoflow before sha256s: by key only
    older.record([DataFile(f.name, f.uri, f.size, f.hash) for f in first.files], cycle="c1")
    assert older.contents() == {}


def test_an_s3_ledger_is_not_written_once_the_state_folders_lease_was_taken(seaweedfs, monkeypatch, tmp_path):
    """A continuous flow paused past its lease (a suspended VM) and taken over must not write its older ledger over
    the new holder's: the ledger's PUT checks the lease first, as every workspace write does."""
    from grpoflow.tasks.storage.lock import LEASE, Holder, WorkspaceLost, workspace_lock
    from grpoflow.tasks.storage.s3 import S3Client
    from grpoflow.tasks.storage.store import open_store

    for k, v in seaweedfs.env().items():
        monkeypatch.setenv(k, v)
    state = f"s3://{seaweedfs.bucket}/state-{tmp_path.name}"
    ledger = Ledger(f"{state}/ledger.json")
    first, second = (DataFile(n, f"{state}/{n}", 1, "e") for n in ("a.jsonl", "b.jsonl"))
    with pytest.raises(WorkspaceLost), workspace_lock(open_store(state), "continuous", ttl_s=2):
        ledger.record([first])
        S3Client().put_bytes(Holder(command="taker").dumps(), f"{state}/{LEASE}")  # the taker's lease now
        time.sleep(1.2)  # past ttl/2: the next write renews first, If-Match the version it wrote last
        ledger.record([second])
    assert [e["name"] for e in ledger.entries()] == ["a.jsonl"]
