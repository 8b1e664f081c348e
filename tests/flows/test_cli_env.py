"""The CLI's environment: the OpenMP wait policy (passive when other processes keep a core busy, never over the
user's choice), and the libraries' settings in force on a first run."""

import os
import subprocess
import sys

import pytest

from grpoflow.flows import cli_env
from tests.paths import MICRO


def test_busy_cores_sees_a_busy_process():
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        assert cli_env.busy_cores(0.5) >= 0.7
    finally:
        hog.kill()
        hog.wait()


def test_wait_policy_follows_the_load_and_keeps_a_set_value(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setattr(cli_env, "busy_cores", lambda seconds=0.5: 0.1)
    cli_env._openmp_wait_policy()
    assert "OMP_WAIT_POLICY" not in cli_env.os.environ
    monkeypatch.setattr(cli_env, "busy_cores", lambda seconds=0.5: 1.2)
    cli_env._openmp_wait_policy()
    assert cli_env.os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    cli_env._openmp_wait_policy()
    assert cli_env.os.environ["OMP_WAIT_POLICY"] == "ACTIVE"


@pytest.mark.slow
def test_a_first_run_on_a_new_machine_prints_no_library_noise(tmp_path):
    """A first `grpoflow run` where ~/.prefect does not exist and PREFECT_HOME is not set: Prefect's server keeps
    its memo store in the run's PREFECT_HOME (Prefect 3.7 would look in ~/.prefect and warn that it cannot write
    there), and the data stage saves its splits without datasets' progress bars (preflight imports datasets, which
    reads HF_DATASETS_DISABLE_PROGRESS_BARS as it is imported)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", HOME=str(tmp_path / "home"))
    drop = ("PREFECT_HOME", "PREFECT_SERVER_MEMO_STORE_PATH", "PREFECT_API_URL", "MLFLOW_TRACKING_URI")
    for key in (*drop, "HF_DATASETS_DISABLE_PROGRESS_BARS"):  # the CLI's own settings, not the test suite's
        env.pop(key, None)
    (tmp_path / "home").mkdir()
    out = tmp_path / "runs"
    cmd = [sys.executable, "-m", "grpoflow.flows.cli", "run", str(MICRO), f"run.output_dir={out}"]
    cmd += ["sft.enabled=false", "eval.enabled=false", "export.enabled=false", "grpo.max_steps=1"]
    res = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "memo_store" not in res.stderr, res.stderr[-3000:]
    assert "Saving the dataset" not in res.stderr, res.stderr[-3000:]
    assert (out / ".prefect" / "memo_store.toml").is_file()
    assert not (tmp_path / "home" / ".prefect").exists()


def test_the_cli_forwards_grpoflow_logs_to_prefect_before_prefect_reads_its_settings(monkeypatch):
    """PREFECT_LOGGING_EXTRA_LOGGERS is read once, when Prefect sets up logging on import: the CLI sets it (a user's
    value wins) in :func:`cli_env._library_env`, and importing the CLI must not import Prefect before that runs."""
    from grpoflow.flows.run_logs import FLOW_RUN_LOG_ENV

    for key in FLOW_RUN_LOG_ENV:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW", "warn")
    cli_env._library_env()
    assert cli_env.os.environ["PREFECT_LOGGING_EXTRA_LOGGERS"] == "grpoflow"
    assert cli_env.os.environ["PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW"] == "warn"  # the user's choice stays
    code = "import sys, grpoflow.flows.cli; print(sorted(m for m in sys.modules if m.split('.')[0] == 'prefect'))"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=os.environ)
    assert res.returncode == 0 and res.stdout.strip() == "[]", res.stdout + res.stderr
