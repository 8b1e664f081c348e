"""The flow launches distributed GRPO: `grpoflow run micro.yaml distributed.nproc_per_node=2` runs every stage, the
GRPO stage through torchrun (2 gloo processes), rank 0 alone logging into the stage's MLflow run; and a rank that
fails fails the stage with its error, as on one process."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from grpoflow.flows.cli import main

MICRO = Path(__file__).parents[1] / "fixtures" / "micro.yaml"
INF_REWARD = """
def inf_reward(prompts, completions, **columns):
    return [float("inf")] * len(completions)
"""

LENGTH_REWARD = """
def length(prompts, completions, **columns):
    return [float(len(c[0]["content"])) for c in completions]
"""


@pytest.mark.slow
def test_two_processes_run_the_pipeline_and_rank_0_logs_once(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert main(["run", str(MICRO), f"run.output_dir={tmp_path}", "run.name=d2", "distributed.nproc_per_node=2"]) == 0
    ws = tmp_path / "d2"
    for stage in ("data", "sft", "grpo", "eval", "export"):
        assert (ws / stage / "manifest.json").is_file(), stage
    summary = json.loads((ws / "grpo" / "manifest.json").read_text())["summary"]
    assert summary["world_size"] == 2 and summary["steps"] == 3
    assert (ws / "grpo" / "final" / "adapter_model.safetensors").is_file()
    assert not list((ws / "grpo" / "launch").glob("rank*.error.json"))

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("grpoflow").experiment_id])
    grpo = next(r for r in runs if r.data.tags.get("grpoflow.stage") == "grpo")
    assert grpo.info.status == "FINISHED"
    assert grpo.data.tags["distributed.world_size"] == "2" and grpo.data.tags["distributed.strategy"] == "ddp"
    assert grpo.data.params["num_processes"] == "2" and grpo.data.params["generation_batch_size"] == "16"
    for key in ("loss", "reward", "entropy", "completions/mean_length", "grad_norm"):
        assert [m.step for m in client.get_metric_history(grpo.info.run_id, key)] == [1, 2, 3], key  # once per step
    table = json.loads(Path(client.download_artifacts(grpo.info.run_id, "completions/end.json")).read_text())
    assert len(table["data"]) == 16  # the whole round of both ranks: 4 prompts x 4 generations


@pytest.mark.slow
def test_fsdp2_gathers_the_sharded_adapter_for_the_final_save(tmp_path, monkeypatch):
    """Under FSDP2 each rank holds half of every weight: the stage's final adapter is the whole one, trained."""
    from safetensors.torch import load_file

    (tmp_path / "spread_reward.py").write_text(LENGTH_REWARD)  # an untrained model earns no built-in reward
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")  # the ranks'
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    overrides = ["distributed.nproc_per_node=2", "distributed.strategy=fsdp2", "sft.enabled=false"]
    overrides += ["eval.enabled=false", "export.enabled=false", "grpo.max_steps=2"]
    overrides += ["grpo.reward_funcs=[spread_reward:length]"]
    assert main(["run", str(MICRO), f"run.output_dir={tmp_path}", "run.name=f2", *overrides]) == 0
    adapter = load_file(tmp_path / "f2" / "grpo" / "final" / "adapter_model.safetensors")
    q_b = next(v for k, v in adapter.items() if "layers.0.self_attn.q_proj.lora_B" in k)
    assert tuple(q_b.shape) == (32, 4)  # hidden_size x r: whole, not a rank's shard of 16 rows
    assert any(v.abs().max() > 0 for k, v in adapter.items() if "lora_B" in k)  # trained from B = 0


@pytest.mark.slow
def test_a_failing_rank_fails_the_stage_with_its_error(tmp_path):
    (tmp_path / "bad_reward.py").write_text(INF_REWARD)
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONPATH=f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        PREFECT_HOME=str(tmp_path / "prefect"),
    )
    overrides = [
        f"run.output_dir={tmp_path / 'runs'}",
        "run.name=bad",
        "distributed.nproc_per_node=2",
        "sft.enabled=false",
        "grpo.reward_funcs=[bad_reward:inf_reward]",
    ]
    cmd = [sys.executable, "-m", "grpoflow.flows.cli", "run", str(MICRO), *overrides]
    res = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert res.returncode == 1, res.stderr[-3000:]
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("grpoflow: grpo: rank "), last
    assert " of 2: reward 'inf_reward' returned inf for completion 0" in last, last
    ws = tmp_path / "runs" / "bad"
    assert not (ws / "grpo" / "manifest.json").exists()
    log = (ws / "logs" / "grpo.error.log").read_text()
    assert "RankTraceback" in log and "RewardError" in log  # the rank's own traceback, kept
