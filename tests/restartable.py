"""An `mlflow server` that a test stops and starts again on the same port and SQLite store (fault injection)."""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.request
from pathlib import Path

from tests.servers import _stop, _wait_until, free_port


class RestartableMlflow:
    def __init__(self, root: Path):
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def start(self, timeout: float = 180) -> None:
        env = dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")
        env.pop("MLFLOW_TRACKING_URI", None)
        cmd = [
            sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(self.port),
            "--workers", "1", "--backend-store-uri", f"sqlite:///{self.root / 'mlflow.db'}",
            "--artifacts-destination", str(self.root / "artifacts"),
        ]  # fmt: skip
        self.starts += 1
        log = self.root / f"server-{self.starts}.log"
        with log.open("w") as out:
            self.proc = subprocess.Popen(
                cmd, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
            )
        _wait_until(self._ready, self.proc, log, "mlflow server", timeout)

    def kill(self) -> None:
        """SIGTERM then SIGKILL the server's process group; the port stops answering at once."""
        if self.proc is not None:
            _stop(self.proc, timeout=10)
            self.proc = None

    def __enter__(self) -> RestartableMlflow:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.kill()
