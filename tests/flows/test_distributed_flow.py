"""The flow launches distributed GRPO: `grpoflow run micro.yaml distributed.nproc_per_node=2` runs every stage, the
GRPO stage through torchrun (2 gloo processes), rank 0 alone logging into the stage's MLflow run; and a rank that
fails fails the stage with its error, as on one process."""

import json
import os
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from grpoflow.flows.cli import main
from grpoflow.flows.stages import PIPELINE
from grpoflow.tasks.config import load_config
from grpoflow.tasks.pipeline.errors import StageError
from grpoflow.tasks.pipeline.shell import run_stage
from grpoflow.tasks.stages.data import prepare_data
from grpoflow.tasks.stages.grpo import run_grpo
from grpoflow.tasks.storage.workspace import Workspace
from tests.paths import MICRO

INF_REWARD = """
def inf_reward(prompts, completions, **columns):
    return [float("inf")] * len(completions)
"""

LENGTH_REWARD = """
def length(prompts, completions, **columns):
    return [float(len(c[0]["content"])) for c in completions]
"""

KILLING_REWARD = """
import os, signal, time
from pathlib import Path

calls = 0


def die_on_rank_1(prompts, completions, **columns):
    global calls
    calls += 1
    if calls == 2 and os.environ["RANK"] == "1":  # mid-GRPO: the second round, after step 1 was logged
        Path(os.environ["KILLED_AT"]).write_text(str(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    return [float(len(c[0]["content"])) for c in completions]
"""

KILL_AFTER_CHECKPOINT = """
import os, signal, time
from pathlib import Path

calls = 0


def die_on_rank_1_in_round_3(prompts, completions, **columns):
    global calls
    calls += 1
    killed = Path(os.environ["KILLED_AT"])
    if calls == 3 and os.environ["RANK"] == "1" and not killed.exists():  # after checkpoint-2 (grpo.save_steps=2)
        killed.write_text(str(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    return [float(len(c[0]["content"])) for c in completions]
"""


def _grpo_stage_error(tmp_path: Path, monkeypatch, reward: str, *overrides: str) -> StageError:
    """The StageError of the GRPO stage of micro.yaml on 2 processes (the data stage prepared first; no Prefect,
    no MLflow: the launch and its failure are what is under test), with tmp_path's reward modules importable by
    every rank."""
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("KILLED_AT", str(tmp_path / "killed_at"))
    base = [f"run.output_dir={tmp_path}", "run.name=bad", "distributed.nproc_per_node=2", "sft.enabled=false"]
    cfg = load_config(MICRO, [*base, f"grpo.reward_funcs=[{reward}]", *overrides])
    prepare_data(cfg, Workspace(tmp_path / "bad"))
    with pytest.raises(StageError) as err:
        run_stage(PIPELINE, PIPELINE["grpo"], run_grpo, cfg, str(tmp_path / "bad"), None, init_model=None)
    return err.value


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
def test_a_failing_rank_fails_the_stage_with_its_error(tmp_path, monkeypatch):
    (tmp_path / "bad_reward.py").write_text(INF_REWARD)
    err = _grpo_stage_error(tmp_path, monkeypatch, "bad_reward:inf_reward")
    assert err.stage == "grpo" and err.message.startswith("rank "), err.message
    assert " of 2: reward 'inf_reward' returned inf for completion 0" in err.message, err.message
    assert not (tmp_path / "bad" / "grpo" / "manifest.json").exists()
    log = Path(err.log_path).read_text()
    assert "RankTraceback" in log and "RewardError" in log  # the rank's own traceback, kept


@pytest.mark.slow
def test_a_rank_killed_mid_grpo_fails_the_stage_and_its_group(tmp_path, monkeypatch):
    """kill -9 of rank 1 in the second round: torchrun stops rank 0 and the stage fails within seconds (not after
    distributed.timeout_s, and never hangs), naming the killed rank; no process of the launch is left."""
    (tmp_path / "killing_reward.py").write_text(KILLING_REWARD)
    err = _grpo_stage_error(tmp_path, monkeypatch, "killing_reward:die_on_rank_1", "distributed.timeout_s=60")
    ended = time.time()
    killed_at = float((tmp_path / "killed_at").read_text())
    assert err.message.startswith("ChildProcessError: torchrun exited with code 1"), err.message
    assert "rank 1 (local_rank: 1), exitcode -9" in err.message and "SIGKILL" in err.message, err.message
    assert ended - killed_at < 20, ended - killed_at
    spec = str(tmp_path / "bad" / "grpo" / "launch" / "spec.json")
    assert not [p for p in Path("/proc").glob("[0-9]*") if spec in _cmdline(p)]
    assert "Root Cause" in Path(err.log_path).read_text()


@pytest.mark.faults
@pytest.mark.slow
def test_after_a_killed_rank_resume_continues_from_the_last_sharded_checkpoint(tmp_path, monkeypatch, caplog):
    """kill -9 of rank 1 (as the OOM killer does) after checkpoint-2 was written by both ranks: the stage fails within
    seconds naming the rank; run again, it continues from checkpoint-2 (the sharded one) and finishes step 3."""
    (tmp_path / "kill_after.py").write_text(KILL_AFTER_CHECKPOINT)
    err = _grpo_stage_error(tmp_path, monkeypatch, "kill_after:die_on_rank_1_in_round_3", "distributed.timeout_s=60")
    assert time.time() - float((tmp_path / "killed_at").read_text()) < 20
    assert "rank 1 (local_rank: 1), exitcode -9" in err.message, err.message
    checkpoints = tmp_path / "bad" / "grpo" / "checkpoints"
    assert (checkpoints / "checkpoint-2" / "dcp").is_dir() and (checkpoints / "checkpoint-2" / "rank1.pt").is_file()
    cfg = load_config(
        MICRO,
        [
            f"run.output_dir={tmp_path}",
            "run.name=bad",
            "distributed.nproc_per_node=2",
            "sft.enabled=false",
            "grpo.reward_funcs=[kill_after:die_on_rank_1_in_round_3]",
            "distributed.timeout_s=60",
        ],
    )
    with caplog.at_level("INFO", "grpoflow.tasks.launch.torchrun"):
        summary = run_stage(PIPELINE, PIPELINE["grpo"], run_grpo, cfg, str(tmp_path / "bad"), None, init_model=None)
    assert summary["steps"] == 3 and summary["world_size"] == 2
    assert f"resumed GRPO from {checkpoints / 'checkpoint-2'} (step 2, written by 2 processes)" in caplog.text


def _cmdline(proc: Path) -> str:
    try:
        return (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


@pytest.mark.slow
def test_vllm_per_rank_under_fsdp2_follows_the_trained_weights(tmp_path, monkeypatch):
    """generation.backend=vllm on 2 processes: one engine per rank, synced from the FSDP2 shards after every step
    (the sampler's log-probs match the trainer's on both ranks' tokens), closed only after the final adapter was
    gathered (vLLM's shutdown destroys the process group)."""
    from safetensors.torch import load_file

    (tmp_path / "spread_reward.py").write_text(LENGTH_REWARD)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    overrides = ["distributed.nproc_per_node=2", "distributed.strategy=fsdp2", "generation.backend=vllm"]
    overrides += ["model.tiny.hidden_size=64", "sft.enabled=false", "eval.enabled=false", "export.enabled=false"]
    overrides += ["grpo.reward_funcs=[spread_reward:length]", "grpo.learning_rate=0.05"]
    assert main(["run", str(MICRO), f"run.output_dir={tmp_path}", "run.name=v2", *overrides]) == 0
    summary = json.loads((tmp_path / "v2" / "grpo" / "manifest.json").read_text())["summary"]
    assert (summary["generation_backend"], summary["world_size"], summary["steps"]) == ("vllm", 2, 3)
    adapter = load_file(tmp_path / "v2" / "grpo" / "final" / "adapter_model.safetensors")
    q_b = next(v for k, v in adapter.items() if "layers.0.self_attn.q_proj.lora_B" in k)
    assert tuple(q_b.shape) == (64, 4) and q_b.abs().max() > 0  # whole and trained
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("grpoflow").experiment_id])
    grpo = next(r for r in runs if r.data.tags.get("grpoflow.stage") == "grpo")
    gaps = client.get_metric_history(grpo.info.run_id, "sampling/sampling_logp_difference/max")
    assert [m.step for m in gaps] == [1, 2, 3] and max(m.value for m in gaps) < 1e-4, [m.value for m in gaps]


@pytest.mark.slow
def test_continuous_cycles_on_two_processes_with_an_s3_workspace(tmp_path, seaweedfs, monkeypatch):
    """The continuous flow on top of the torchrun launch: two cycles whose workspaces (and ledger) live on S3, GRPO
    on 2 processes each; the first starts from the base model and becomes the champion, the second warm-starts
    from it (a folder the ranks read from the worker's cache). Both cycles' GRPO runs carry world size 2."""
    from grpoflow.flows.continuous import grpo_continuous
    from tests.flows.test_deployments import arithmetic_rows

    for k, v in seaweedfs.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    incoming = tmp_path / "incoming"
    incoming.mkdir()
    (tmp_path / "heldout.jsonl").write_text(arithmetic_rows(8, seed=1))
    state_dir = f"s3://{seaweedfs.bucket}/state-{tmp_path.name}"
    overrides = [
        f"run.output_dir={tmp_path / 'runs'}",
        f"storage.cache_dir={tmp_path / 'cache'}",
        f"data.eval_source={tmp_path / 'heldout.jsonl'}",
        "distributed.nproc_per_node=2",
    ]
    decisions = []
    for batch, seed in (("batch1.jsonl", 2), ("batch2.jsonl", 3)):
        (incoming / batch).write_text(arithmetic_rows(40, seed=seed))
        out = grpo_continuous(config=str(MICRO), overrides=overrides, source=str(incoming), state_dir=state_dir)
        assert out["consumed"] == [batch]
        decisions.append(out)

    from grpoflow.tasks.storage import s3

    written = [o["uri"] for o in s3.S3Client().list_objects(f"{state_dir}/cycles/")]
    assert len([u for u in written if u.endswith("/grpo/manifest.json")]) == 2, written  # both cycles' GRPO, on S3
    client = MlflowClient(f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    exp = client.get_experiment_by_name("grpoflow")
    parents = {d["mlflow_run_id"]: client.get_run(d["mlflow_run_id"]) for d in decisions}
    starts = [parents[d["mlflow_run_id"]].data.tags["continuous.warm_start"] for d in decisions]
    assert not starts[0].startswith("models:/") and starts[1] == "models:/grpoflow-tiny/1", starts
    for d in decisions:
        grpo = client.search_runs(
            [exp.experiment_id], f"tags.mlflow.parentRunId = '{d['mlflow_run_id']}' and tags.`grpoflow.stage` = 'grpo'"
        )
        assert [r.data.tags["distributed.world_size"] for r in grpo] == ["2"], d
        assert grpo[0].info.status == "FINISHED"
