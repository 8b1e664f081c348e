"""Fault injection with a real `mlflow server`: killed mid-GRPO and started again on the same port and store, and a
pipeline killed mid-GRPO then resumed. Training never waits for the server, every metric step lands once in one
grpo run, and the run ends with exit 0.

The issue measured a 45 s outage (training blocked for it) and a 6 min one (the stage failed after about 5 min of
MLflow's HTTP retries). The "long" case here reproduces the second in seconds: MLFLOW_HTTP_REQUEST_MAX_RETRIES=0
and MLFLOW_HTTP_REQUEST_TIMEOUT=2 give the MLflow client a patience of about 2 s, so a 20 s outage outlasts it as
6 min outlasted 5 min; before the journal, the GRPO stage failed on the first metric it logged in the outage."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from tests.paths import MICRO
from tests.restartable import RestartableMlflow

STEPS = 12
SLOW_REWARD = """
import time

def slow_length(prompts, completions, **columns):
    time.sleep(0.6)  # a round of about a second: the outage spans several steps
    return [float(len(c[0]["content"]) % 7) for c in completions]
"""
pytestmark = [pytest.mark.faults, pytest.mark.slow]


def _cmd(out: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "grpoflow.flows.cli", "run", str(MICRO), f"run.output_dir={out}", "run.name=r",
        "sft.enabled=false", "eval.enabled=false", "export.enabled=false", f"grpo.max_steps={STEPS}",
        "grpo.save_steps=3", "grpo.reward_funcs=[slow_reward:slow_length,proximity]", "run.torch_threads=1", *extra,
    ]  # fmt: skip


@pytest.fixture()
def env(tmp_path):
    (tmp_path / "slow_reward.py").write_text(SLOW_REWARD)
    return dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONPATH=f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        PREFECT_HOME=str(tmp_path / "prefect"),
    )


def _grpo_runs(client: MlflowClient) -> list:
    exp = client.get_experiment_by_name("grpoflow")
    return [] if exp is None else client.search_runs([exp.experiment_id], "tags.stage = 'grpo'")


def _wait(what, timeout: float, proc: subprocess.Popen, log: Path):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if (value := what()) is not None:
            return value
        if proc.poll() is not None:
            pytest.fail(f"the run ended ({proc.returncode}) early; its log ends:\n{log.read_text()[-3000:]}")
        time.sleep(0.3)
    pytest.fail(f"timed out; the run's log ends:\n{log.read_text()[-3000:]}")


def _loss_steps(client: MlflowClient, run_id: str) -> list:
    return sorted((m.step, m.timestamp) for m in client.get_metric_history(run_id, "loss"))


@pytest.mark.parametrize(("outage_s", "client_env"), [(10, {}), (20, {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",
                                                                       "MLFLOW_HTTP_REQUEST_TIMEOUT": "2"})],
                         ids=["short", "past-client-patience"])  # fmt: skip
def test_server_killed_mid_grpo_costs_no_steps_and_loses_none(tmp_path, env, outage_s, client_env):
    log = tmp_path / "run.log"
    with RestartableMlflow(tmp_path / "server") as server:
        client = MlflowClient(server.url)
        cmd = _cmd(tmp_path / "out", f"tracking.uri={server.url}", "tracking.request_timeout_s=2")
        with log.open("w") as out:
            proc = subprocess.Popen(cmd, env={**env, **client_env}, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)  # fmt: skip
        try:

            def at_step_3():
                runs = _grpo_runs(client)
                return runs[0].info.run_id if runs and len(_loss_steps(client, runs[0].info.run_id)) >= 3 else None

            rid = _wait(at_step_3, 600, proc, log)
            server.kill()
            t_down = time.time() * 1000
            time.sleep(outage_s)
            t_up = time.time() * 1000
            server.start()
            assert proc.wait(timeout=600) == 0, log.read_text()[-3000:]
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        runs = _grpo_runs(client)
        assert [r.info.run_id for r in runs] == [rid] and runs[0].info.status == "FINISHED"
        points = _loss_steps(client, rid)
        assert [s for s, _ in points] == list(range(1, STEPS + 1))  # every step once
        during = [s for s, ts in points if t_down <= ts <= t_up]
        assert len(during) >= 2, f"no training steps while the server was down: {points}, {t_down}-{t_up}"
        assert "unreachable" in log.read_text() and "answers again" in log.read_text()


def test_resume_after_a_killed_stage_continues_its_grpo_run(tmp_path, env):
    out = tmp_path / "out"
    log = tmp_path / "run.log"
    with log.open("w") as f:  # the default store: SQLite in <output_dir>/mlflow.db
        proc = subprocess.Popen(_cmd(out), env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        ckpt = out / "r" / "grpo" / "checkpoints" / "checkpoint-6"
        _wait(lambda: True if ckpt.is_dir() else None, 600, proc, log)
        time.sleep(1.5)  # a step or so past the checkpoint: logged, then redone by the resume
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    first = json.loads((out / "r" / "stage_runs.json").read_text())["grpo"]["run_id"]
    res = subprocess.run(
        [sys.executable, "-m", "grpoflow.flows.cli", "resume", str(out / "r")], env=env, capture_output=True, text=True
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    client = MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    runs = _grpo_runs(client)
    assert [r.info.run_id for r in runs] == [first] and runs[0].info.status == "FINISHED"
    assert [s for s, _ in _loss_steps(client, first)] == list(range(1, STEPS + 1))
    assert runs[0].data.tags["grpoflow.stage_resumes"] == "1"
