"""One owner per workspace (tasks/storage/lock.py): a second process is refused naming the holder, a dead holder's
lock is taken over with a warning; on S3 the lease is renewed while its holder lives and taken over once expired."""

import logging
import os
import signal
import socket
import subprocess
import sys
import time
import uuid

import pytest

from grpoflow.tasks.storage.lock import LEASE, LOCK_FILE, WorkspaceBusy, holds, workspace_lock
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
    with caplog.at_level(logging.WARNING), workspace_lock(store, "resume"):
        assert f"took over the lease of pid {proc.pid}" in caplog.text and "that process is gone" in caplog.text
