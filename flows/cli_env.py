"""The process environment of a CLI command, set before the libraries load: the settings they read once as they
are imported (:func:`_library_env`), the OpenMP wait policy measured from the machine's load (:func:`busy_cores`),
and a run's PREFECT_HOME, logging and progress bars (:func:`_setup_env`)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from grpoflow.flows.run_logs import FLOW_RUN_LOG_ENV
from grpoflow.tasks.config import PipelineConfig
from grpoflow.tasks.storage import s3
from grpoflow.tasks.storage.workspace import local_dir


def busy_cores(seconds: float = 0.5) -> float:
    """Cores kept busy by other processes right now: non-idle share of /proc/stat's CPU time over ``seconds``,
    times the core count (this process is idle meanwhile). Falls back to the 1-minute load average."""

    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            values = [int(v) for v in f.readline().split()[1:]]
        return values[3] + values[4], sum(values[:8])  # idle + iowait, total (without guest time)

    try:
        idle0, total0 = sample()
        time.sleep(seconds)
        idle1, total1 = sample()
    except (OSError, ValueError, IndexError):
        return os.getloadavg()[0]
    total = max(total1 - total0, 1)
    return (1 - (idle1 - idle0) / total) * (os.cpu_count() or 1)


def _openmp_wait_policy() -> None:
    """OMP_WAIT_POLICY=PASSIVE when other processes keep at least 0.7 of a core busy as the run starts.

    Waiting OpenMP threads spin by default. On a quiet machine that is fastest (passive waiting made the default
    run 9.2 min instead of 6.1 here), but when another process holds a core, spinning threads crawl: two GRPO
    micro-batches on 2 threads took 1.7 s beside one busy loop and 11.6-14.3 s on a loaded machine, against 0.9
    and 1.9-2.9 s with passive waiting. OpenMP reads this when torch loads it, so it is set before anything
    imports torch; an OMP_WAIT_POLICY already in the environment wins. Measured now, not by the load average,
    which still counts a pip install that just ended."""
    if "OMP_WAIT_POLICY" not in os.environ and busy_cores() >= 0.7:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"


def _library_env() -> None:
    """Settings the libraries read once, as they are imported: set before anything loads a config (its checks
    import datasets, which reads HF_DATASETS_DISABLE_PROGRESS_BARS then); a value already set wins."""
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    for key, value in FLOW_RUN_LOG_ENV.items():  # grpoflow's lines in the flow run's Prefect logs
        os.environ.setdefault(key, value)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def _setup_env(cfg: PipelineConfig) -> None:
    out = local_dir(cfg.run.output_dir, cfg.storage.cache_dir)  # an s3:// output_dir: its local mirror
    out.mkdir(parents=True, exist_ok=True)
    _openmp_wait_policy()
    home = Path(os.environ.setdefault("PREFECT_HOME", str(out / ".prefect")))
    home.mkdir(parents=True, exist_ok=True)
    # Prefect 3.7 puts its server's memo store under ~/.prefect whatever PREFECT_HOME says (the server settings'
    # default does not see `home`), and warns on a first run where ~/.prefect does not exist
    os.environ.setdefault("PREFECT_SERVER_MEMO_STORE_PATH", str(home / "memo_store.toml"))
    # the embedded server migrates its SQLite store on first start: slow on a busy 2-core machine
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    import logging

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    for noisy in ("mlflow", "alembic", "httpx", "prefect", "datasets", "transformers", "matplotlib"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # bitsandbytes (imported by peft) warns on every CPU import that Hugging Face's optional `kernels` package is
    # missing; nothing here uses its CPU gemm kernel (4-bit layers stay on the generic path: model/loading.py)
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    if s3.is_s3_uri(cfg.run.output_dir) and not (cfg.tracking.uri or os.environ.get("MLFLOW_TRACKING_URI")):
        logging.getLogger("grpoflow").warning(
            "run.output_dir is on S3 but MLflow's default SQLite store stays on this machine (%s); set tracking.uri "
            "to an MLflow server (with --artifacts-destination s3://...) to keep tracking beside the workspace",
            out / "mlflow.db",
        )
