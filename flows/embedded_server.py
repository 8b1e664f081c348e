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
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

from grpoflow.tasks.runtime.launch import die_with_parent


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


@contextlib.contextmanager
def embedded_server(timeout: float | None = None) -> Iterator[str | None]:
    """Start Prefect's API server (uvicorn, the app Prefect's temporary server runs, no UI) for this process and
    point Prefect at it; yields its API URL (None when PREFECT_API_URL is set and nothing was started). Stopped on
    the way out, whatever ends the block."""
    if os.environ.get("PREFECT_API_URL"):
        yield None
        return
    import httpx
    import prefect
    from prefect.settings import PREFECT_API_URL, get_current_settings, temporary_settings

    timeout = timeout or float(os.environ.get("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180"))
    port = _free_port()
    env = {
        **os.environ,
        **get_current_settings().to_environment_variables(exclude_unset=True),
        "PREFECT_UI_ENABLED": "0",
        "PREFECT__SERVER_EPHEMERAL": "1",
        "PREFECT__SERVER_FINAL": "1",
    }
    cmd = [sys.executable, "-m", "uvicorn", "--app-dir", str(prefect.__module_path__.parent), "--factory"]
    cmd += ["prefect.server.api.server:create_app", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--log-level", "error", "--lifespan", "on"]
    proc = subprocess.Popen(cmd, env=env, preexec_fn=_own_session_dying_with_parent)  # noqa: PLW1509 - setsid + pdeathsig
    url = f"http://127.0.0.1:{port}/api"
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
        _stop(proc)
