"""The Store contract (tasks/storage/store.py), one suite run against both stores: a LocalStore on tmp_path and an
S3Store on a real SeaweedFS server. Plus the S3Store's folder transfers: many files at once through one
TransferManager, markers only after every other file is up."""

import os
import stat
import threading
import time
import uuid
from pathlib import Path

import pytest

from grpoflow.tasks.config.storage import StorageConfig
from grpoflow.tasks.storage import s3
from grpoflow.tasks.storage.store import Entry, LocalStore, S3Store, Store, fsync_tree, open_store, write_atomic

MARK = "trainer_state.json"


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path) -> Store:
    settings = StorageConfig(cache_dir=str(tmp_path / "cache"), outage_budget_s=5)
    if request.param == "local":
        return open_store(tmp_path / "ws", settings)
    server = request.getfixturevalue("env")
    return open_store(f"s3://{server.bucket}/stores/{uuid.uuid4().hex[:8]}", settings)


def _other_machine(store: Store, tmp_path) -> Store:
    """The same location seen from another machine: for S3 an empty cache; a local folder is its own copy."""
    if isinstance(store, S3Store):
        return S3Store(store.location, StorageConfig(cache_dir=str(tmp_path / "other-cache")))
    return store


def _tree(root, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def test_open_store_picks_the_store_by_location(env, tmp_path):
    assert isinstance(open_store(tmp_path / "a"), LocalStore)
    remote = open_store(f"s3://{env.bucket}/p/r1", StorageConfig(cache_dir=str(tmp_path / "c")))
    assert isinstance(remote, S3Store) and isinstance(remote, Store)
    assert remote.location == f"s3://{env.bucket}/p/r1" and remote.where == env.endpoint
    assert remote.local_root == (tmp_path / "c").resolve() / env.bucket / "p" / "r1"
    with pytest.raises(ValueError, match="not a valid bucket name"):
        open_store("s3://Bad_Bucket/x")


def test_write_read_exists(store, tmp_path):
    assert store.read("a/b.json") is None and not store.exists("a/b.json")
    store.write("a/b.json", b'{"x": 1}')
    assert store.read("a/b.json") == b'{"x": 1}' and store.exists("a/b.json")
    assert (store.local_root / "a" / "b.json").read_bytes() == b'{"x": 1}'  # the local copy in step
    assert _other_machine(store, tmp_path).read("a/b.json") == b'{"x": 1}'
    store.write("a/b.json", b"two")
    assert store.read("a/b.json") == b"two" and (store.local_root / "a" / "b.json").read_bytes() == b"two"


def test_a_failed_write_leaves_the_old_content(store, monkeypatch):
    store.write("run.json", b"old")

    def broken(fd, *args, **kwargs):  # the disk fails while the new bytes are written
        raise OSError("disk full")

    with monkeypatch.context() as m, pytest.raises(OSError, match="disk full"):
        m.setattr(os, "fdopen", broken)
        store.write("run.json", b"new content")
    assert store.read("run.json") == b"old" and (store.local_root / "run.json").read_bytes() == b"old"
    assert sorted(p.name for p in store.local_root.iterdir()) == ["run.json"]  # no temp file left behind


def test_write_atomic_replaces_whole(tmp_path):
    path = write_atomic(tmp_path / "d" / "f.txt", b"1" * 10)
    write_atomic(path, b"2")
    assert path.read_bytes() == b"2" and [p.name for p in path.parent.iterdir()] == ["f.txt"]


def _record_fsyncs(monkeypatch) -> list[tuple[str, object]]:
    """os.fsync recorded (what it synced, with the target's state at that moment) and still called: an fsync's
    effect cannot be observed without pulling the power, so the test checks what is synced and when."""
    calls: list[tuple[str, object]] = []
    real = os.fsync

    def fsync(fd):
        st = os.fstat(fd)
        target = Path(os.readlink(f"/proc/self/fd/{fd}"))
        calls.append(("dir" if stat.S_ISDIR(st.st_mode) else "file", target))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return calls


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="reads fd targets from /proc")
def test_write_atomic_fsyncs_the_file_before_the_rename_and_the_folder_after(tmp_path, monkeypatch):
    calls = _record_fsyncs(monkeypatch)
    renamed: list[int] = []
    real_replace = os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: (renamed.append(len(calls)), real_replace(a, b)))
    path = write_atomic(tmp_path / "d" / "manifest.json", b"{}")
    kinds = [k for k, _ in calls]
    assert kinds == ["file", "dir"], calls
    assert calls[0][1].parent == path.parent and calls[0][1].name.startswith(".manifest.json.")  # the temp file
    assert renamed == [1]  # the file was synced before the rename, the folder after it
    assert calls[1][1] == path.parent


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="reads fd targets from /proc")
def test_fsync_tree_syncs_every_file_and_folder(tmp_path, monkeypatch):
    (tmp_path / "ck" / "sub").mkdir(parents=True)
    for name in ("a.bin", "sub/b.bin"):
        (tmp_path / "ck" / name).write_bytes(b"x")
    calls = _record_fsyncs(monkeypatch)
    fsync_tree(tmp_path / "ck")
    synced = {(k, p.relative_to(tmp_path).as_posix()) for k, p in calls}
    assert synced == {("file", "ck/a.bin"), ("file", "ck/sub/b.bin"), ("dir", "ck"), ("dir", "ck/sub")}


def test_list_and_delete(store):
    for name in ("s/a.txt", "s/sub/b.txt", "s2/c.txt"):
        store.write(name, name.encode())
    listed = store.list("s/")
    assert [e.name for e in listed] == ["s/a.txt", "s/sub/b.txt"]
    assert all(isinstance(e, Entry) and e.size == len(e.name) and e.etag for e in listed)
    assert [e.name for e in store.list()] == ["s/a.txt", "s/sub/b.txt", "s2/c.txt"]
    before = {e.name: e.etag for e in store.list("s/")}["s/a.txt"]
    time.sleep(0.01)
    store.write("s/a.txt", b"S/A.TXT")  # same size, other content: another digest
    assert {e.name: e.etag for e in store.list("s/")}["s/a.txt"] != before
    store.delete(["s/sub/b.txt", "s/missing.txt", "s/a.txt"])  # a missing name is fine
    assert store.list("s/") == [] and not (store.local_root / "s" / "sub").exists()
    assert store.exists("s2/c.txt")


def test_delete_folder_deletes_markers_first(store, monkeypatch):
    for name in ("ck/a.bin", f"ck/{MARK}", "ck/z/b.bin", "keep/x"):
        store.write(name, b"x")
    order: list[list[str]] = []
    if isinstance(store, S3Store):
        real = store.client.delete_objects
        monkeypatch.setattr(store.client, "delete_objects", lambda uris: (order.append(list(uris)), real(uris))[1])
    else:
        real = store.delete
        monkeypatch.setattr(store, "delete", lambda names: (order.append(list(names)), real(names))[1])
    store.delete_folder("ck", markers=(MARK,))
    assert order[0] and all(n.endswith(MARK) for n in order[0])  # the marker went first, alone
    assert not any(n.endswith(MARK) for batch in order[1:] for n in batch)
    assert [e.name for e in store.list()] == ["keep/x"] and not (store.local_root / "ck").exists()


def test_sync_up_and_down_of_a_folder(store, tmp_path):
    """For a LocalStore the local folder is the store: both syncs move nothing and lose nothing."""
    files = {"ckpt/a.bin": "aaa", "ckpt/deep/er/b.bin": "bb", f"ckpt/{MARK}": "{}", "ckpt/skip.tmp": "t"}
    _tree(store.local_root, files)
    sent = store.sync_up("ckpt", markers=(MARK,), exclude=("skip.tmp",))
    remote = isinstance(store, S3Store)
    if remote:
        assert sent == ["ckpt/a.bin", "ckpt/deep/er/b.bin", f"ckpt/{MARK}"]  # markers last
        assert [e.name for e in store.list("ckpt/")] == sorted(sent)  # the excluded file stays local
    else:
        assert sent == []
    assert store.sync_up("ckpt", markers=(MARK,), exclude=("skip.tmp",)) == []  # unchanged: nothing moves

    (store.local_root / "ckpt" / "a.bin").write_text("AAA")  # same size, other bytes
    (store.local_root / "ckpt" / "deep" / "er" / "b.bin").unlink()
    assert store.sync_up("ckpt", delete=True, exclude=("skip.tmp",)) == (["ckpt/a.bin"] if remote else [])
    assert [e.name for e in store.list("ckpt/") if not e.name.endswith(".tmp")] == ["ckpt/a.bin", f"ckpt/{MARK}"]

    other = _other_machine(store, tmp_path)
    got = other.sync_down("ckpt", markers=(MARK,))
    assert got == (["ckpt/a.bin", f"ckpt/{MARK}"] if remote else [])
    assert (other.local_root / "ckpt" / "a.bin").read_text() == "AAA"
    assert other.sync_down("ckpt") == []  # unchanged: nothing moves
    if remote:  # a stale local file goes with delete=True, an excluded one stays
        _tree(other.local_root, {"ckpt/stale.bin": "s", "ckpt/keep.txt": "k"})
        other.sync_down("ckpt", delete=True, exclude=("keep.txt",))
        assert not (other.local_root / "ckpt" / "stale.bin").exists()
        assert (other.local_root / "ckpt" / "keep.txt").exists()


def test_guarded_runs_the_upload_and_returns_its_result(store):
    calls = []
    assert store.guarded(lambda: calls.append(1) or "done", "an upload") == "done" and calls == [1]
    with pytest.raises(ValueError, match="not an S3 error"):  # other errors are not retried
        store.guarded(lambda: (_ for _ in ()).throw(ValueError("not an S3 error")), "an upload")


def test_guarded_retries_an_s3_error_within_the_budget(env, tmp_path):
    store = open_store(f"s3://{env.bucket}/guarded", StorageConfig(cache_dir=str(tmp_path), outage_budget_s=30))
    failures = [s3.S3Error("endpoint away")]

    def upload():
        if failures:
            raise failures.pop()
        store.write("x", b"1")

    store.guarded(upload, "x")
    assert store.read("x") == b"1"


# ------------------------------------------------------------------------------------------ S3 transfers
def _in_flight(client, operation: str):
    """Record, through the client's own events, how many ``operation`` requests were in flight at once."""
    state = {"now": 0, "most": 0, "threads": set(), "done": []}
    lock = threading.Lock()

    def before(params, **kw):
        with lock:
            state["now"] += 1
            state["most"] = max(state["most"], state["now"])
            state["threads"].add(threading.get_ident())
        time.sleep(0.05)  # each request takes a moment: sequential requests never overlap

    def after(**kw):
        with lock:
            state["now"] -= 1
            state["done"].append(kw["context"].get("key"))

    def key(params, context, **kw):
        context["key"] = params["Key"]

    events = (
        (f"before-parameter-build.s3.{operation}", key),
        (f"before-call.s3.{operation}", before),
        (f"after-call.s3.{operation}", after),
    )
    for name, fn in events:
        client.meta.events.register(name, fn)
    return state, lambda: [client.meta.events.unregister(name, fn) for name, fn in events]


def test_a_folder_goes_up_many_files_at_once_and_its_marker_last(env, tmp_path):
    settings = StorageConfig(cache_dir=str(tmp_path / "cache"))  # its own client (one per settings)
    store = S3Store(f"s3://{env.bucket}/many/{uuid.uuid4().hex[:8]}", settings)
    _tree(store.local_root, {**{f"ck/part-{i:02d}.bin": f"{i}" * 1000 for i in range(24)}, f"ck/{MARK}": "{}"})
    state, stop = _in_flight(s3.s3_client(settings), "PutObject")
    try:
        sent = store.sync_up("ck", markers=(MARK,))
    finally:
        stop()
    assert len(sent) == 25 and len(state["done"]) == 25
    assert state["most"] > 1 and len(state["threads"]) > 1, state  # several PUTs in flight, on several threads
    assert state["done"][-1].endswith(MARK)  # the marker started only after every other file was up

    other = S3Store(store.location, StorageConfig(cache_dir=str(tmp_path / "other")))
    state, stop = _in_flight(s3.s3_client(other.settings), "GetObject")
    try:
        got = other.sync_down("ck", markers=(MARK,))
    finally:
        stop()
    assert len(got) == 25 and state["most"] > 1 and state["done"][-1].endswith(MARK)
    assert (other.local_root / "ck" / "part-07.bin").read_text() == "7" * 1000


def test_a_failed_transfer_names_the_uri_and_the_endpoint(env, tmp_path):
    store = S3Store(f"s3://no-such-bucket-{uuid.uuid4().hex[:6]}/x", StorageConfig(cache_dir=str(tmp_path)))
    _tree(store.local_root, {"f/a.txt": "a"})
    with pytest.raises(s3.S3NotFoundError, match=f"s3://no-such-bucket-.*/x/f/.*{env.endpoint}"):
        store.sync_up("f")
