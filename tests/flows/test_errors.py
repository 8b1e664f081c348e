"""The error contract, through the CLI as a user runs it: an error found inside a stage (bad data, a reward
returning inf) ends with one `grpoflow: <stage>: <cause>` line naming the file line or the function, exit 1,
no traceback on the terminal, the traceback in <workspace>/logs/<stage>.error.log, and the earlier stages
complete."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

MICRO = Path(__file__).parents[1] / "fixtures" / "micro.yaml"
INF_REWARD = """
def inf_reward(prompts, completions, **columns):
    return [float("inf")] * len(completions)
"""


def _run(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONPATH=f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        PREFECT_HOME=str(tmp_path / "prefect"),
    )
    cmd = [sys.executable, "-m", "grpoflow.flows.cli", "run", str(MICRO), f"run.output_dir={tmp_path / 'runs'}"]
    return subprocess.run([*cmd, *overrides], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_bad_data_row_fails_the_data_stage_in_one_line(tmp_path):
    rows = [{"question": "What is 1 + 2?", "answer": "3"}] * 5 + [{"question": "", "answer": "4"}]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = _run(tmp_path, f"data.source={data}", "data.format=qa", "run.name=bad")
    assert res.returncode == 1, res.stderr[-3000:]
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith(f"grpoflow: data: {data} line 6: question is empty"), last
    assert "Traceback" not in res.stderr and "Traceback" not in res.stdout
    log = tmp_path / "runs" / "bad" / "logs" / "data.error.log"
    assert f"`grpoflow resume {tmp_path / 'runs' / 'bad'}`" in last and str(log) in last
    assert "Traceback" in log.read_text() and "ValueError" in log.read_text()


@pytest.mark.slow
def test_a_reward_returning_inf_fails_grpo_naming_it_and_keeps_sft(tmp_path):
    (tmp_path / "bad_reward.py").write_text(INF_REWARD)
    res = _run(tmp_path, "grpo.reward_funcs=[bad_reward:inf_reward]", "run.name=inf", "sft.max_steps=2")
    assert res.returncode == 1, res.stderr[-3000:]
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("grpoflow: grpo: reward 'inf_reward' returned inf for completion 0"), last
    assert "Traceback" not in res.stderr
    ws = tmp_path / "runs" / "inf"
    assert (ws / "sft" / "manifest.json").is_file() and not (ws / "grpo" / "manifest.json").exists()
    assert "RewardError" in (ws / "logs" / "grpo.error.log").read_text()


def test_validate_refuses_a_bad_data_file_or_model_folder_before_any_stage(tmp_path):
    """A data file whose head does not parse, or names no answer column, and a model path that is no model
    folder: exit 2 from `grpoflow validate` with one line naming the key, file and line; no workspace made."""
    data = tmp_path / "rows.jsonl"
    data.write_text('{"question": "What is 1 + 2?", "answer": "3"}\n{"question": "What is 2 + 2?" "answer": "4"}\n')
    env = dict(os.environ, OMP_NUM_THREADS="1", PREFECT_HOME=str(tmp_path / "prefect"))
    base = [sys.executable, "-m", "grpoflow.flows.cli", "validate", str(MICRO), f"run.output_dir={tmp_path / 'runs'}"]
    cases = {
        f"data.source={data}": f"grpoflow: data.source: data file '{data}' line 2: not a JSON object",
        f"data.eval_source={data.with_name('held_out.csv')}": "grpoflow: data.eval_source: data file not found",
        f"model.name={tmp_path}": f"grpoflow: model.name: {tmp_path}: a folder without config.json",
    }
    for override, want in cases.items():
        res = subprocess.run([*base, override], env=env, capture_output=True, text=True, timeout=300)
        assert res.returncode == 2, (override, res.stderr[-2000:])
        lines = res.stderr.strip().splitlines()
        assert lines[-1].startswith(want), (override, lines[-1])
        assert "Traceback" not in res.stderr
    assert not (tmp_path / "runs").exists()
