"""The Prefect server a `grpoflow run` / `resume` starts for itself, and its signals.

Without PREFECT_API_URL, Prefect would start a temporary server (uvicorn) as a child in the CLI's process group.
A terminal's Ctrl-C goes to the whole foreground group, so the server died at once and the CLI, still reporting to
it, spent a minute on connection errors before failing with a traceback. Here the CLI starts that server itself:

- in a session of its own, so Ctrl-C and a SIGTERM to the CLI's group reach the CLI only; the flow stops (the
  GRPO step in progress is abandoned, the newest checkpoint is complete: checkpoints are written under .tmp and
  renamed), the run is reported to a server still alive, and the CLI then stops the server (SIGTERM, then
  SIGKILL after 5 s) and exits 130 (SIGINT) or 143 (SIGTERM);
- with the parent-death signal set (Linux prctl PR_SET_PDEATHSIG), so even a kill -9 of the CLI takes the server
  down with it: no process of ours outlives the CLI.

With PREFECT_API_URL set, the user's server is used and nothing is started.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from grpoflow.tasks.launch.torchrun import die_with_parent


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised like Ctrl-C's KeyboardInterrupt so that the same clean-up runs; exit code 143."""


def _raise_terminated(signum, frame) -> None:
    raise Terminated()


def handle_sigterm() -> None:
    """SIGTERM unwinds the CLI as Ctrl-C does (Python's default would end it without any clean-up)."""
    signal.signal(signal.SIGTERM, _raise_terminated)


def _own_session_dying_with_parent() -> None:  # runs in the child between fork and exec
    os.setsid()
    die_with_parent()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _drain() -> None:
    """Send what Prefect still has queued (logs, events) while the server is up: after, they would fail."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        with contextlib.suppress(Exception):
            worker.drain_all(timeout=5)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class Server:
    """A started Prefect API server process and its URL (not yet known to answer)."""

    def __init__(self, proc: subprocess.Popen, url: str) -> None:
        self.proc, self.url = proc, url

    def stop(self) -> None:
        _stop(self.proc)


def start_server() -> Server | None:
    """Start Prefect's API server (uvicorn, the app Prefect's temporary server runs, no UI) and return at once,
    without waiting for it to answer: its start (imports, the SQLite store's migrations: seconds) runs beside the
    caller's own heavy imports on another core. None when PREFECT_API_URL is set (the user's server is used).

    It imports nothing heavy itself: Prefect's settings come from the environment (PREFECT_HOME and the rest,
    set before this call), which the child reads as Prefect's own temporary server would."""
    if os.environ.get("PREFECT_API_URL"):
        return None
    spec = importlib.util.find_spec("prefect")
    if spec is None or spec.origin is None:
        raise RuntimeError("prefect is not installed")
    app_dir = Path(spec.origin).parent.parent
    port = _free_port()
    env = {**os.environ, "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"}
    cmd = [sys.executable, "-m", "uvicorn", "--app-dir", str(app_dir), "--factory"]
    cmd += ["prefect.server.api.server:create_app", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--log-level", "error", "--lifespan", "on"]
    proc = subprocess.Popen(cmd, env=env, preexec_fn=_own_session_dying_with_parent)  # noqa: PLW1509 - setsid + pdeathsig
    return Server(proc, f"http://127.0.0.1:{port}/api")


@contextlib.contextmanager
def serving(server: Server | None, timeout: float | None = None) -> Iterator[str | None]:
    """Wait until ``server`` answers, point Prefect at it and yield its API URL (None for no server: the user's
    PREFECT_API_URL stays in force); the server is stopped on the way out, whatever ends the block (a failed
    start included)."""
    if server is None:
        yield None
        return
    import httpx
    from prefect.settings import PREFECT_API_URL, temporary_settings

    timeout = timeout or float(os.environ.get("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180"))
    proc, url = server.proc, server.url
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the Prefect server exited with code {proc.returncode} while starting")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"the Prefect server did not answer at {url} within {timeout:.0f} s")
            time.sleep(0.1)
        with temporary_settings(updates={PREFECT_API_URL: url}):
            yield url
    finally:
        _drain()
        server.stop()


@contextlib.contextmanager
def embedded_server(timeout: float | None = None) -> Iterator[str | None]:
    """Start Prefect's API server for this process and point Prefect at it (:func:`start_server`, then
    :func:`serving`); yields its API URL (None when PREFECT_API_URL is set and nothing was started)."""
    with serving(start_server(), timeout) as url:
        yield url
