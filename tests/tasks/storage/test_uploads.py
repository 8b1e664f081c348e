"""Uploads that outlive an S3 outage (tasks/storage/uploads.py, Workspace.checkpoint_jobs): the retry budget and
backoff, the background queue (order, bound, failure), and a real `weed mini` killed and restarted under it."""

import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from grpoflow.tasks.config.storage import StorageConfig
from grpoflow.tasks.storage import s3
from grpoflow.tasks.storage.s3 import S3AccessError, S3Client, S3Error
from grpoflow.tasks.storage.uploads import StorageOutage, UploadQueue, backoff_s, drain_on_sigterm, retry_outage
from grpoflow.tasks.storage.workspace import Workspace
from tests.servers import SeaweedMini


def test_backoff_doubles_up_to_its_cap():
    assert [backoff_s(a, 10.0) for a in range(1, 7)] == [1.0, 2.0, 4.0, 8.0, 10.0, 10.0]


def test_an_outage_past_the_budget_names_the_endpoint_and_the_time_waited():
    calls = []

    def down():
        calls.append(time.monotonic())
        raise S3Error("s3://b/k: cannot reach the S3 endpoint http://x:1")

    t0 = time.monotonic()
    with pytest.raises(StorageOutage) as err:
        retry_outage(down, "http://x:1", "the upload of checkpoint-4", budget_s=1.5, backoff_cap_s=0.5)
    took = time.monotonic() - t0
    assert 1.5 <= took < 3.0, took
    assert len(calls) >= 3  # retried, with pauses of 1 s then the cap (0.5 s)
    msg = str(err.value)
    assert msg.startswith("S3 endpoint http://x:1 unreachable for 2 s (storage.outage_budget_s=1.5)"), msg
    assert "the upload of checkpoint-4" in msg and "cannot reach" in msg


def test_refused_credentials_are_not_waited_for():
    calls = []

    def refused():
        calls.append(1)
        raise S3AccessError("s3://b/k: access denied")

    with pytest.raises(S3AccessError):
        retry_outage(refused, "http://x:1", "an upload", budget_s=60)
    assert calls == [1]


def test_an_outage_inside_the_budget_is_waited_out_with_a_warning_each_way(caplog):
    left = [3]

    def flaky():
        if left[0]:
            left[0] -= 1
            raise S3Error("connection refused")

    with caplog.at_level(logging.WARNING, "grpoflow.tasks.storage.uploads"):
        retry_outage(flaky, "http://x:1", "an upload", budget_s=30, backoff_cap_s=0.2, queued=lambda: 2)
    text = caplog.text
    assert "S3 endpoint http://x:1 unreachable (connection refused); retrying an upload for up to 30 s" in text
    assert "2 checkpoint(s) queued; training goes on" in text
    assert "S3 endpoint http://x:1 answers again after 1 s; 2 checkpoint(s) queued" in text  # 1 + 0.2 + 0.2 s


def test_the_queue_runs_jobs_in_order_and_bounds_what_waits(caplog):
    gate = threading.Event()
    ran = []
    q = UploadQueue("http://x:1", budget_s=30, max_pending=2)

    def job(name):
        def run():
            gate.wait()
            ran.append(name)

        return run

    q.submit("checkpoint-1", job("checkpoint-1"))
    q.submit("checkpoint-2", job("checkpoint-2"))
    assert q.pending() == ["checkpoint-1", "checkpoint-2"]
    threading.Timer(0.5, gate.set).start()
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, "grpoflow.tasks.storage.uploads"):
        q.submit("checkpoint-3", job("checkpoint-3"))  # full: waits for checkpoint-1
    assert time.monotonic() - t0 >= 0.4
    assert "2 checkpoint upload(s) to http://x:1 pending (storage.max_pending_uploads=2): training waits" in caplog.text
    q.drain()
    assert ran == ["checkpoint-1", "checkpoint-2", "checkpoint-3"] and q.done == ran and q.pending() == []


def test_a_spent_budget_stops_the_queue_and_names_the_last_checkpoint_on_s3():
    q = UploadQueue("http://x:1", budget_s=0.5, max_pending=3, backoff_cap_s=0.1, done=["checkpoint-2"])
    q.submit("checkpoint-3", lambda: None)

    def down():
        raise S3Error("connection refused")

    q.submit("checkpoint-4", down)
    q.submit("checkpoint-5", lambda: None)
    with pytest.raises(StorageOutage) as err:
        q.drain()
    msg = str(err.value)
    assert "S3 endpoint http://x:1 unreachable for " in msg and "the upload of checkpoint-4" in msg
    assert "last checkpoint safely on S3: checkpoint-3; not uploaded: checkpoint-4, checkpoint-5" in msg
    with pytest.raises(StorageOutage):  # and the next checkpoint's submit says it again
        q.submit("checkpoint-6", lambda: None)


def test_an_outage_during_the_clean_up_after_an_upload_names_that_checkpoint_as_safe():
    """The endpoint dies after checkpoint-4's marker is up and before the prune after it: checkpoint-4 is on S3
    (a resume loads it), so the message names it, and only what never went up as not uploaded."""
    q = UploadQueue("http://x:1", budget_s=0.5, max_pending=3, backoff_cap_s=0.1, done=["checkpoint-3"])

    def down():
        raise S3Error("connection refused")

    q.submit("checkpoint-4", lambda: None, then=down)
    q.submit("checkpoint-5", lambda: None)
    with pytest.raises(StorageOutage) as err:
        q.drain()
    msg = str(err.value)
    assert "the clean-up after checkpoint-4 (on S3)" in msg
    assert "last checkpoint safely on S3: checkpoint-4; not uploaded: checkpoint-5" in msg
    assert q.done == ["checkpoint-3", "checkpoint-4"]


# ------------------------------------------------------------------------------ a real endpoint, killed
@pytest.fixture
def weed(tmp_path, monkeypatch):
    """A `weed mini` this test may kill and restart (same ports and data folder)."""
    mini = SeaweedMini(tmp_path / "weed")
    server = mini.start()
    for k, v in server.env().items():
        monkeypatch.setenv(k, v)
    try:
        yield mini
    finally:
        mini.stop()


def _checkpoint(folder, step: int) -> None:
    ckpt = folder / f"checkpoint-{step}"
    ckpt.mkdir(parents=True)
    (ckpt / "adapter_model.safetensors").write_bytes(bytes([step]) * 3000)
    (ckpt / "trainer_state.json").write_text(f'{{"step": {step}}}')  # the marker


@pytest.mark.faults
def test_checkpoints_queued_during_a_real_outage_reach_s3_in_order(weed, tmp_path, caplog):
    """weed mini killed (SIGKILL) after checkpoint-1 is on S3, three more checkpoints queued while it is down and
    it restarted 6 s later: every upload completes within the budget, in order, each checkpoint's marker after
    its files, and S3 keeps the newest two as the trainer does locally."""
    settings = StorageConfig(cache_dir=str(tmp_path / "cache"), max_attempts=1)
    ws = Workspace(f"s3://{weed.server.bucket}/runs/q", settings)
    folder = ws.stage_dir("grpo") / "checkpoints"
    q = UploadQueue(ws.store.where, budget_s=60, max_pending=3, backoff_cap_s=2)
    pushed = q.done  # the checkpoints published, in the order they reached S3

    def submit(step):
        _checkpoint(folder, step)
        name = f"checkpoint-{step}"
        q.submit(name, *ws.checkpoint_jobs("grpo", "checkpoints", name))  # as the GRPO stage queues them

    submit(1)
    q.drain()
    weed.kill()
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, "grpoflow.tasks.storage.uploads"):
        for step in (2, 3, 4):
            submit(step)  # returns at once: the trainer goes on
        assert time.monotonic() - t0 < 2 and q.pending() == ["checkpoint-2", "checkpoint-3", "checkpoint-4"]
        time.sleep(6)
        weed.start()
        q.drain()
    outage = time.monotonic() - t0
    assert pushed == ["checkpoint-1", "checkpoint-2", "checkpoint-3", "checkpoint-4"]
    assert f"S3 endpoint {ws.store.where} unreachable (" in caplog.text
    assert f"S3 endpoint {ws.store.where} answers again after" in caplog.text
    store = S3Client(settings)
    keys = {o["uri"].rsplit("/checkpoints/", 1)[1]: o for o in store.list_objects(f"{ws.location}/grpo/checkpoints/")}
    assert sorted(keys) == [
        f"checkpoint-{n}/{f}" for n in (3, 4) for f in ("adapter_model.safetensors", "trainer_state.json")
    ]
    for n in (3, 4):  # S3 times are whole seconds: the marker is never older than the files
        files = keys[f"checkpoint-{n}/adapter_model.safetensors"]["last_modified"]
        assert keys[f"checkpoint-{n}/trainer_state.json"]["last_modified"] >= files
    print(f"outage waited out: {outage:.1f} s")


def test_attempt_limits_shrink_with_the_budget_left():
    assert s3.attempt_limits(300) == (10, 120)
    assert s3.attempt_limits(30) == (10, 15)
    assert s3.attempt_limits(7) == (5, 5)
    assert s3.attempt_limits(0.5) == s3.attempt_limits(-3) == (1, 5)


@pytest.fixture
def silent_endpoint():
    """A real TCP listener that accepts connections and never answers (a hung S3 server, a half-dead proxy)."""
    import socket

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)
    held, stop = [], threading.Event()

    def accept():
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(srv.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{srv.getsockname()[1]}"
    stop.set()
    thread.join()
    for conn in held:
        conn.close()
    srv.close()


def test_a_silent_endpoint_fails_the_upload_within_the_budget_and_a_few_seconds(silent_endpoint, tmp_path, monkeypatch):
    """Without the attempt bound, one attempt alone waited botocore's read timeout (120 s) times max_attempts (5)."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    store = S3Client(StorageConfig(endpoint_url=silent_endpoint, cache_dir=str(tmp_path / "cache"), max_attempts=5))
    budget = 4.0
    t0 = time.monotonic()
    with pytest.raises(StorageOutage) as err:
        retry_outage(lambda: store.put_bytes(b"x", "s3://bucket/k"), store.where, "an upload", budget, backoff_cap_s=1)
    took = time.monotonic() - t0
    assert budget <= took <= budget + 7, took  # 1 s connect + 5 s read, at most, past the budget
    assert "Read timeout" in str(err.value) or "timed out" in str(err.value), err.value


@pytest.mark.faults
def test_sigterm_during_uploads_drains_the_queue_before_exiting(env, tmp_path):
    """A real process with checkpoint uploads queued to the real S3 server gets SIGTERM: it waits for them, exits
    with 143 within seconds, and every checkpoint is complete on S3 (each file at its size, the marker too)."""
    location = f"s3://{env.bucket}/sigterm/{uuid.uuid4().hex[:8]}/r1"
    script = Path(__file__).with_name("sigterm_uploads.py")
    count, mib = 3, 48
    proc = subprocess.Popen(
        [sys.executable, str(script), location, str(tmp_path / "cache"), str(count), str(mib)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    try:
        line = proc.stdout.readline()
        while line and not line.startswith("queued"):
            line = proc.stdout.readline()
        assert line.startswith("queued"), proc.stdout.read()
        proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        out = line + proc.stdout.read()
        code = proc.wait(timeout=60)
        took = time.monotonic() - signalled
    finally:
        proc.kill()
    assert code == 143, out
    assert took < 30, (took, out)  # the uploads' time, not the 600 s "training" nor the 60 s budget
    pending = re.search(r"SIGTERM: waiting for (\d+) checkpoint upload\(s\)", out)
    assert pending and int(pending[1]) >= 1, out  # the signal came while uploads were pending
    client = s3.S3Client(StorageConfig(cache_dir=str(tmp_path / "cache")))
    objects = {o["uri"].rsplit("/", 2)[-2] + "/" + o["uri"].rsplit("/", 1)[-1]: o["size"] for o in
               client.list_objects(f"{location}/grpo/checkpoints/")}  # fmt: skip
    for step in range(1, count + 1):
        assert objects.get(f"checkpoint-{step}/model.safetensors") == mib * 2**20, (objects, out)
        assert f"checkpoint-{step}/trainer_state.json" in objects, (objects, out)


def test_drain_on_sigterm_restores_the_handler_before_it_and_is_inert_off_the_main_thread():
    queue = UploadQueue("nowhere", budget_s=1, max_pending=1)
    before = signal.getsignal(signal.SIGTERM)
    with drain_on_sigterm(queue):
        assert signal.getsignal(signal.SIGTERM) is not before
    assert signal.getsignal(signal.SIGTERM) is before
    seen = []
    thread = threading.Thread(target=lambda: seen.append(drain_on_sigterm(queue).__enter__() is None))
    thread.start()
    thread.join()
    assert seen == [True] and signal.getsignal(signal.SIGTERM) is before
