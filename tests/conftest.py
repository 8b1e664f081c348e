"""Shared test setup: quiet, offline, deterministic, small thread pools."""

import os
import tempfile

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the CLI: spinning OpenMP threads crawl on busy cores
os.environ.setdefault("GRPOFLOW_PROGRESS", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
# Prefect reads its settings when first imported (test collection imports it): set them now.
os.environ.setdefault("PREFECT_HOME", tempfile.mkdtemp(prefix="grpoflow-prefect-"))
# Tests never touch the user's home: the default storage.cache_dir (~/.cache/grpoflow/s3) records which S3 endpoint
# each bucket's mirror belongs to (tasks/storage/mirror.py), and each session's SeaweedFS listens on a fresh port.
os.environ["HOME"] = tempfile.mkdtemp(prefix="grpoflow-home-")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
# bf16 training tests run on any CPU: their shapes are tiny, a CPU without bf16 matmul instructions only slows them
# (the refusal itself: tests/tasks/model/test_precision.py)
os.environ.setdefault("GRPOFLOW_ALLOW_SLOW_BF16", "1")


# Real servers on 127.0.0.1 (tests/servers.py), started once and killed (process group) at the end.
import pytest  # noqa: E402

from tests.servers import mlflow_server as _mlflow_server  # noqa: E402
from tests.servers import seaweedfs as _seaweedfs  # noqa: E402


@pytest.fixture(scope="session")
def seaweedfs(tmp_path_factory):
    """A SeaweedFS S3 server (`weed mini`) with a bucket: S3Server(endpoint, access_key, secret_key, bucket)."""
    with _seaweedfs(tmp_path_factory.mktemp("seaweedfs")) as server:
        yield server


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """`mlflow server` with a SQLite store and local artifacts; its URL."""
    with _mlflow_server(tmp_path_factory.mktemp("mlflow-server")) as url:
        yield url


@pytest.fixture(scope="module")
def mlflow_s3_server(tmp_path_factory, seaweedfs):
    """`mlflow server` whose artifacts go to s3://<bucket>/mlflow on the SeaweedFS server; its URL."""
    root = tmp_path_factory.mktemp("mlflow-s3-server")
    with _mlflow_server(root, f"s3://{seaweedfs.bucket}/mlflow", env=seaweedfs.env()) as url:
        yield url
