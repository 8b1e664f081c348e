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
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
