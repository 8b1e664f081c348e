"""One owner per workspace (tasks/storage/lock.py): a second process is refused naming the holder, a dead holder's
lock is taken over with a warning; on S3 the lease is renewed while its holder lives and taken over once expired."""

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import uuid

import pytest

from grpoflow.tasks.storage.lock import LEASE, LOCK_FILE, WorkspaceBusy, current_pid_space, holds, workspace_lock
from grpoflow.tasks.storage.store import open_store

HOLD = """
import sys, time
from grpoflow.tasks.storage.lock import workspace_lock
from grpoflow.tasks.storage.store import open_store
with workspace_lock(open_store(sys.argv[1]), "holder test", ttl_s=float(sys.argv[2])):
    print("held", flush=True)
    time.sleep(600)
"""


def _holder(location: str, ttl_s: float = 60.0) -> subprocess.Popen:
    """A real second process holding ``location``, once it printed that it does."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, location, str(ttl_s)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def _kill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def test_a_second_process_is_refused_naming_the_holder_then_takes_over_when_it_dies(tmp_path, caplog):
    store = open_store(tmp_path / "run")
    proc = _holder(str(tmp_path / "run"))
    try:
        with pytest.raises(WorkspaceBusy) as e, workspace_lock(store, "test"):
            pass
        msg = str(e.value)
        assert f"pid {proc.pid} on host " in msg and "(holder test)" in msg and "since 20" in msg
        assert str(tmp_path / "run") in msg and f"kill {proc.pid}" in msg
    finally:
        _kill(proc)  # SIGKILL: no release, the file still names it; the kernel dropped the flock
    assert str(proc.pid) in (tmp_path / "run" / LOCK_FILE).read_text()
    with caplog.at_level(logging.WARNING), workspace_lock(store, "test"):
        assert holds(store)
        assert str(os.getpid()) in (tmp_path / "run" / LOCK_FILE).read_text()
    assert f"took over the lock left by pid {proc.pid}" in caplog.text and "process is gone" in caplog.text
    assert (tmp_path / "run" / LOCK_FILE).read_text() == ""  # released: emptied
    assert not holds(store)


def test_the_lock_is_reentrant_within_a_process_and_released_on_error(tmp_path):
    store = open_store(tmp_path)
    with pytest.raises(RuntimeError, match="boom"), workspace_lock(store, "outer"):
        with workspace_lock(store, "inner"):
            assert holds(store)
        assert holds(store)  # the inner block left the outer one's hold
        raise RuntimeError("boom")
    assert not holds(store)
    proc = _holder(str(tmp_path))  # free for another process again
    _kill(proc)


def test_s3_lease_refuses_while_renewed_and_is_taken_over_once_expired(env, caplog):
    location = f"s3://{env.bucket}/lock-{uuid.uuid4().hex[:8]}/run"
    store = open_store(location)
    proc = _holder(location, ttl_s=3)  # renewed every second: a margin for a loaded machine
    try:
        time.sleep(6.5)  # two lease lifetimes: only a renewed lease is still valid
        with pytest.raises(WorkspaceBusy, match=f"pid {proc.pid} on host .*holder test"), workspace_lock(store, "t"):
            pass
    finally:
        _kill(proc)
    assert store.read(LEASE) is not None  # a killed holder leaves its lease
    lease = store.read(LEASE).replace(f'"host": "{socket.gethostname()}"'.encode(), b'"host": "elsewhere"')
    store.write(LEASE, lease)  # as if it ran on another machine: only its expiry tells that it is gone
    with pytest.raises(WorkspaceBusy, match="on host elsewhere"):  # not expired yet
        with workspace_lock(store, "t", ttl_s=30):
            pass
    time.sleep(3.2)
    with caplog.at_level(logging.WARNING), workspace_lock(store, "taker", ttl_s=3):
        assert (
            f"took over the lease of pid {proc.pid} on host elsewhere" in caplog.text and "not renewed" in caplog.text
        )
        assert b'"taker"' in store.read(LEASE)
    assert store.read(LEASE) is None  # released: deleted


def test_s3_lease_of_a_dead_process_on_this_host_is_taken_over_at_once(env, caplog):
    location = f"s3://{env.bucket}/lock-{uuid.uuid4().hex[:8]}/run"
    store = open_store(location)
    proc = _holder(location)  # ttl 60 s
    _kill(proc)
    lease = store.read(LEASE)
    assert json.loads(lease)["pid_space"] == current_pid_space() != ""
    # the same host name in another PID namespace (a container on the host's network): its pid means nothing here
    for other in ("", f"{current_pid_space()}0"):  # none recorded (older grpoflow), another namespace
        store.write(LEASE, lease.replace(current_pid_space().encode(), other.encode()))
        with pytest.raises(WorkspaceBusy, match=f"pid {proc.pid} on host"), workspace_lock(store, "t"):
            pass
    store.write(LEASE, lease)
    with caplog.at_level(logging.WARNING), workspace_lock(store, "resume"):
        assert f"took over the lease of pid {proc.pid}" in caplog.text and "that process is gone" in caplog.text


WRITER = """
import sys, time
from grpoflow.tasks.storage.lock import workspace_lock
from grpoflow.tasks.storage.store import open_store
store = open_store(sys.argv[1])
with workspace_lock(store, "writer test", ttl_s=float(sys.argv[2])):
    print("held", flush=True)
    for i in range(600):
        store.write("grpo/owner.txt", f"writer-{i}".encode())  # a stage writing its files, again and again
        time.sleep(0.1)
"""


def test_s3_holder_stalled_past_its_lease_stops_writing_once_taken_over(env):
    """A holder alive but stalled (SIGSTOP here; a VM paused, a network partition) past the lease's ttl is taken
    over, as it should be; when it wakes up it must not write over the new holder's files."""
    location = f"s3://{env.bucket}/lock-{uuid.uuid4().hex[:8]}/run"
    store = open_store(location)
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, location, "3"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "held"
        time.sleep(0.5)
        proc.send_signal(signal.SIGSTOP)
        time.sleep(5)  # past the 3 s ttl by the server's clock (1 s resolution)
        with workspace_lock(store, "taker", ttl_s=3):
            store.write("grpo/owner.txt", b"taker")
            proc.send_signal(signal.SIGCONT)
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
            assert store.read("grpo/owner.txt") == b"taker"  # the stalled holder wrote nothing after waking up
        assert proc.poll() not in (None, 0)  # it failed, naming why
        assert "no longer holds" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            _kill(proc)


def test_s3_a_renewal_gives_the_lease_a_new_etag_so_a_taker_that_read_it_before_loses(env):
    """A taker reads a lease that looks expired, the holder renews it that moment, the taker writes If-Match the
    version it read: the renewal must have changed that version (the same bytes again keep S3's MD5 ETag)."""
    location = f"s3://{env.bucket}/lock-{uuid.uuid4().hex[:8]}/run"
    store = open_store(location)
    uri = f"{location}/{LEASE}"
    with workspace_lock(store, "holder", ttl_s=1.5):  # renewed every 0.5 s
        _, read, _ = store.client.get_with_etag(uri)  # what a taker read
        time.sleep(1.5)  # the holder renews meanwhile
        assert store.client.put_if(b'{"command": "taker"}', uri, etag=read) is None  # the taker's If-Match fails
        assert b'"holder"' in store.read(LEASE)


def test_s3_holder_locks_its_local_copy_so_a_sync_of_that_folder_is_refused(env):
    """`grpoflow sync` of an S3 run's local copy (a local RUN_DIR, as docs/tracking.md has a user do for its
    journal) while the S3 run is live on this machine: refused naming the holder, as two senders of one journal
    would send its records twice. Before, only the S3 lease was taken and the local folder's lock was free."""
    location = f"s3://{env.bucket}/lock-{uuid.uuid4().hex[:8]}/run"
    store = open_store(location)
    proc = _holder(location)
    try:
        with pytest.raises(WorkspaceBusy, match=f"pid {proc.pid} on host .*holder test"):
            with workspace_lock(open_store(store.local_root), "grpoflow sync"):
                pass
    finally:
        _kill(proc)
    with workspace_lock(open_store(store.local_root), "grpoflow sync"):  # the holder gone: free
        pass


def test_a_child_started_with_the_held_fds_keeps_the_workspace_locked_until_it_exits(tmp_path):
    """GRPO's torchrun is started with the lock's descriptor (tasks/stages/grpo.py): when the holder dies (kill -9)
    while rank 0 still drains its checkpoint uploads, the workspace stays locked until that process exits too.
    Before, the lock was free the moment the holder died and a second run wrote beside the draining workers."""
    from grpoflow.tasks.storage.lock import held_fds

    store = open_store(tmp_path / "run")
    with workspace_lock(store, "holder"):
        fds = held_fds()
        assert len(fds) == 1
        child = subprocess.Popen(["sleep", "60"], pass_fds=fds)
    assert held_fds() == []  # let go here, as a killed holder does
    try:
        with pytest.raises(WorkspaceBusy), workspace_lock(store, "second"):
            pass
    finally:
        _kill(child)
    with workspace_lock(store, "third"):
        assert holds(store)
