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

from tests.paths import MICRO

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


def _ours(prefect_home: Path) -> list[int]:
    """Processes started for this test's runs (the CLI, the Prefect server it starts: their environment has this
    PREFECT_HOME), alive or not yet reaped by nobody."""
    tag = f"PREFECT_HOME={prefect_home}".encode()
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if tag in (proc / "environ").read_bytes().split(b"\0"):
                    pids.append(int(proc.name))
            except OSError:
                continue
    return pids


def _interrupt_after(cmd: list[str], env: dict, ckpt: Path, sig: int) -> tuple[subprocess.CompletedProcess, float]:
    """Run ``cmd`` in a session of its own (a terminal's foreground group), send ``sig`` to the whole group once
    ``ckpt`` exists (as Ctrl-C does); (the result, seconds from the signal to the exit).

    SIGINT is set back to its default in the child, as a terminal's foreground job has it: a test run started in
    the background by a non-interactive shell (`.ci/run &`) inherits SIGINT ignored, Python then keeps ignoring
    it, and the CLI (rightly, as any background job) would not see the Ctrl-C at all."""
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.time() + 300
    while not ckpt.is_dir() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before the signal"
    os.killpg(proc.pid, sig)
    t0 = time.time()
    out, err = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err), time.time() - t0


@pytest.mark.slow
def test_ctrl_c_and_sigterm_stop_cleanly_and_resume_continues(tmp_path, env):
    """Ctrl-C (SIGINT to the process group) mid-GRPO: exit 130 within seconds, one line, no traceback, no process
    of ours left (the Prefect server the CLI started is stopped by it, not killed by the signal first); then
    `grpoflow resume` under SIGTERM: exit 143 the same way; a last resume finishes from the newest checkpoint."""
    out = tmp_path / "out"
    ckpts = out / "r" / "grpo" / "checkpoints"
    cmd = [*_cmd(out), "grpo.max_steps=8", "grpo.save_steps=1"]
    res, seconds = _interrupt_after(cmd, env, ckpts / "checkpoint-1", signal.SIGINT)
    assert res.returncode == 130, res.stderr[-3000:]
    assert res.stderr.strip().splitlines()[-1].startswith("grpoflow: interrupted; `grpoflow resume RUN_DIR`")
    assert "Traceback" not in res.stderr and "Error logging to API" not in res.stderr, res.stderr[-3000:]
    assert seconds < 30, seconds  # 10 s on an idle machine; this one is shared
    time.sleep(1)
    assert _ours(Path(env["PREFECT_HOME"])) == []

    resume = [sys.executable, "-m", "grpoflow.flows.cli", "resume", str(out / "r")]
    newest = max(int(p.name.split("-")[1]) for p in ckpts.glob("checkpoint-*") if ".tmp" not in p.name)
    res, seconds = _interrupt_after(resume, env, ckpts / f"checkpoint-{newest + 1}", signal.SIGTERM)
    assert res.returncode == 143, res.stderr[-3000:]
    assert "resumed GRPO from" in res.stderr
    assert res.stderr.strip().splitlines()[-1].startswith("grpoflow: terminated; `grpoflow resume RUN_DIR`")
    assert "Traceback" not in res.stderr and seconds < 30, (seconds, res.stderr[-3000:])
    time.sleep(1)
    assert _ours(Path(env["PREFECT_HOME"])) == []

    newest = max(int(p.name.split("-")[1]) for p in ckpts.glob("checkpoint-*") if ".tmp" not in p.name)
    assert newest < 8, "the resumed run finished before SIGTERM"
    done = subprocess.run(resume, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"resumed GRPO from {ckpts / f'checkpoint-{newest}'}" in done.stderr
    assert (out / "r" / "grpo" / "manifest.json").is_file()
