"""kill -9 in the middle of GRPO (after a checkpoint taken mid-round), run again: training continues
from the newest complete checkpoint and ends with exactly the weights of an uninterrupted run (CPU, one
thread, same seed)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

MICRO = Path(__file__).parents[1] / "fixtures" / "micro.yaml"
SLOW_REWARD = """
import time

def slow_length(prompts, completions, **columns):
    time.sleep(1.0)  # keeps each round long enough to be killed in the middle of the run
    return [float(len(c[0]["content"]) % 7) for c in completions]
"""


def _cmd(out: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "grpoflow.flows.cli",
        "run",
        str(MICRO),
        f"run.output_dir={out}",
        "run.name=r",
        "sft.enabled=false",
        "eval.enabled=false",
        "export.enabled=false",
        "grpo.max_steps=6",
        "grpo.save_steps=3",
        "grpo.num_iterations=2",
        "grpo.gradient_accumulation_steps=2",
        "grpo.learning_rate=0.01",
        "grpo.reward_funcs=[slow_reward:slow_length,proximity]",
    ]


@pytest.fixture()
def env(tmp_path):
    (tmp_path / "slow_reward.py").write_text(SLOW_REWARD)
    e = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONPATH=f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        PREFECT_HOME=str(tmp_path / "prefect"),
    )
    return e


@pytest.mark.slow
def test_sigkill_then_resume_matches_uninterrupted_run(tmp_path, env):
    full, killed = tmp_path / "full", tmp_path / "killed"
    subprocess.run(_cmd(full), env=env, check=True, capture_output=True, timeout=600)

    # its own process group: the kill takes the run and the Prefect server it started, as a dying node would
    proc = subprocess.Popen(
        _cmd(killed), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    # 4 micro-batches per round (spg 2 x mu 2), 2 per optimizer step: checkpoint-3 is in the middle of round 2
    ckpt = killed / "r" / "grpo" / "checkpoints" / "checkpoint-3"
    deadline = time.time() + 300
    while not ckpt.is_dir() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    assert not (killed / "r" / "grpo" / "manifest.json").exists()
    blob = torch.load(ckpt / "trainer_state.pt", weights_only=True)  # tensors only: loading runs no code
    saved_round = json.loads((ckpt / "trainer_state.json").read_text())["round"]
    assert saved_round is not None and saved_round["position"] == 2  # resumes inside a generation round
    assert blob["round"]["batch.completion_ids"].shape[0] == blob["round"]["advantages"].shape[0]

    res = subprocess.run(_cmd(killed), env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resumed GRPO from" in res.stderr
    a = load_file(full / "r" / "grpo" / "final" / "adapter_model.safetensors")
    b = load_file(killed / "r" / "grpo" / "final" / "adapter_model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
