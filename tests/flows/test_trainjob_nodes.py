"""A TrainJob's nodes without Kubernetes: the command of the rendered TrainJob, run as-is by two "nodes" on this
machine, each with the environment the torch-distributed runtime gives a pod (PET_NNODES, PET_NPROC_PER_NODE,
PET_NODE_RANK, PET_MASTER_ADDR, PET_MASTER_PORT) and its own HOME, so its own mirror of the S3 workspace (a real
SeaweedFS server): what the launcher writes (spec, data, base model) reaches the nodes only through S3, and what
rank 0 writes (final model, summary) or a failing rank reports reaches the launcher only through S3, and what every
node checkpoints reaches a rerun only through S3.

Not exercised: the Kubernetes API (create, status, pod logs), the runtime's env injection, in-cluster DNS and the
template's env (the nodes get this test's S3 endpoint instead); README "Distributed" says how to run it for real."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from grpoflow.flows.stages import PIPELINE
from grpoflow.tasks.config import load_config
from grpoflow.tasks.launch.torchrun import rank_errors
from grpoflow.tasks.launch.trainjob import JobState
from grpoflow.tasks.pipeline.fingerprint import stage_keys
from grpoflow.tasks.stages.data import prepare_data
from grpoflow.tasks.stages.grpo_trainjob import collect_summary, prepare_trainjob, trainjob_error
from grpoflow.tasks.storage.workspace import Workspace
from grpoflow.tasks.tracking.tracker import RunLogger
from tests.paths import MICRO, REPO
from tests.servers import free_port

FAILING_REWARD = """
import os


def fail_on_rank_1(prompts, completions, **columns):
    if os.environ["RANK"] == "1":
        raise ValueError("no reward on rank 1")
    return [float(len(c[0]["content"])) for c in completions]


ROUNDS = [0]


def fail_once_on_rank_1(prompts, completions, **columns):
    ROUNDS[0] += 1
    if os.environ["RANK"] == "1" and os.environ.get("NODE_REWARD_FAIL_AT") == str(ROUNDS[0]):
        raise ValueError(f"no reward on rank 1 in round {ROUNDS[0]}")
    return [float(len(c[0]["content"])) for c in completions]
"""


def launcher(
    tmp_path: Path, monkeypatch, seaweedfs, name: str, *overrides: str, init_model: str | None = None
) -> tuple[Workspace, dict]:
    """The launcher's side up to the Kubernetes API: data stage, spec on S3, the TrainJob to create."""
    for k, v in {**seaweedfs.env(), "OMP_NUM_THREADS": "1", "HOME": str(tmp_path / "launcher")}.items():
        monkeypatch.setenv(k, v)
    output = f"s3://{seaweedfs.bucket}/trainjob-{tmp_path.name}"
    cfg = load_config(
        MICRO,
        [
            f"run.output_dir={output}",
            f"run.name={name}",
            "sft.enabled=false",
            "distributed.launcher=trainjob",
            "distributed.nnodes=2",
            "distributed.nproc_per_node=1",
            f"distributed.trainjob.python={sys.executable}",
            f"distributed.trainjob.template={REPO / 'infra' / 'kubeflow' / 'trainjob.yaml'}",
            "distributed.trainjob.gpus_per_node=0",
            *overrides,
        ],
    )
    ws = Workspace(f"{output}/{name}", cfg.storage)
    ws.publish("data", stage_keys(PIPELINE, cfg)["data"], prepare_data(cfg, ws))  # what the stage shell does
    return ws, prepare_trainjob(cfg, ws, RunLogger.disabled(), init_model)


def run_nodes(job: dict, tmp_path: Path, timeout_s: float = 300) -> list[int]:
    """Each node's container command, verbatim, with the PET_* values the torch plugin sets; their exit codes."""
    trainer = job["spec"]["trainer"]
    pet = {
        "PET_NNODES": str(trainer["numNodes"]),
        "PET_NPROC_PER_NODE": str(trainer["numProcPerNode"]),
        "PET_MASTER_ADDR": "127.0.0.1",  # <name>-node-0-0.<name> in a cluster
        "PET_MASTER_PORT": str(free_port()),  # 29400 in a cluster
    }
    procs = []
    for rank in range(trainer["numNodes"]):
        env = {**os.environ, **pet, "PET_NODE_RANK": str(rank), "HOME": str(tmp_path / f"node{rank}")}
        out = (tmp_path / f"node{rank}.log").open("w")
        procs.append(
            subprocess.Popen(trainer["command"], env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        )
    try:
        return [p.wait(timeout=timeout_s) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def mirror(tmp_path: Path, who: str, ws: Workspace) -> Path:
    """``ws``'s mirror under another HOME (the default storage.cache_dir is under ~)."""
    launcher_home = tmp_path / "launcher"
    return tmp_path / who / ws.root.relative_to(launcher_home)


@pytest.mark.slow
def test_two_nodes_train_and_hand_back_the_model_through_s3(tmp_path, monkeypatch, seaweedfs):
    ws, job = launcher(tmp_path, monkeypatch, seaweedfs, "ok")
    assert ws.root.is_relative_to(tmp_path / "launcher")
    codes = run_nodes(job, tmp_path)
    assert codes == [0, 0], (tmp_path / "node0.log").read_text()[-3000:] + (tmp_path / "node1.log").read_text()[-3000:]
    node0, node1 = mirror(tmp_path, "node0", ws), mirror(tmp_path, "node1", ws)
    assert (node1 / "data").is_dir() and (node1 / "base_model").is_dir()  # node 1 pulled its inputs from S3
    assert (node0 / "grpo" / "final").is_dir() and not (node1 / "grpo" / "final").exists()  # rank 0 alone saves
    assert not (ws.root / "grpo" / "final").exists()
    summary = collect_summary(ws)
    assert summary["world_size"] == 2 and summary["steps"] == 3
    assert summary["model_path"] == str(ws.root / "grpo" / "final")  # re-rooted to the launcher's mirror
    assert (ws.root / "grpo" / "final" / "adapter_model.safetensors").is_file()


@pytest.mark.slow
def test_a_failing_rank_on_node_1_is_the_stage_error(tmp_path, monkeypatch, seaweedfs):
    (tmp_path / "node_reward.py").write_text(FAILING_REWARD)
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.syspath_prepend(str(tmp_path))
    ws, job = launcher(
        tmp_path,
        monkeypatch,
        seaweedfs,
        "bad",
        "grpo.reward_funcs=[node_reward:fail_on_rank_1]",
        "distributed.timeout_s=60",
    )
    codes = run_nodes(job, tmp_path)
    assert codes[1] != 0
    ws.pull("grpo", "launch")  # what the launcher does once the TrainJob is Failed
    errors = rank_errors(ws.stage_dir("grpo") / "launch")
    assert errors and errors[0]["rank"] == 1 and not errors[0]["lost_peer"]
    state = JobState("failed", "FailedJobs", "jobset failed due to one or more job failures")
    exc = trainjob_error("grpoflow", job["metadata"]["name"], state, errors, {}, 2)
    assert isinstance(exc, ValueError) and str(exc).startswith("rank 1 of 2: ")
    assert "no reward on rank 1" in str(exc) and "FailedJobs" in str(exc)


def s3_checkpoints(ws: Workspace) -> dict[str, set[str]]:
    """The files of each checkpoint folder of the GRPO stage on S3, by folder name."""
    prefix = "grpo/checkpoints/"
    found: dict[str, set[str]] = {}
    for entry in ws.store.list(prefix):
        folder, name = entry.name[len(prefix) :].split("/", 1)
        found.setdefault(folder, set()).add(name)
    return found


@pytest.mark.slow
def test_a_failed_two_node_run_resumes_from_every_nodes_shards_on_s3(tmp_path, monkeypatch, seaweedfs):
    """Node 1 fails in step 3 after checkpoints 1 and 2; a rerun on fresh nodes (empty disks) resumes from S3 and
    ends with the weights of an uninterrupted run."""
    (tmp_path / "node_reward.py").write_text(FAILING_REWARD)
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.syspath_prepend(str(tmp_path))
    overrides = (
        "grpo.reward_funcs=[node_reward:fail_once_on_rank_1]",
        "grpo.save_steps=1",
        "grpo.max_steps=4",
        "distributed.timeout_s=60",
    )
    straight, job = launcher(tmp_path, monkeypatch, seaweedfs, "straight", *overrides)
    assert run_nodes(job, tmp_path) == [0, 0], (tmp_path / "node1.log").read_text()[-3000:]
    collect_summary(straight)

    monkeypatch.setenv("NODE_REWARD_FAIL_AT", "3")
    ws, job = launcher(tmp_path, monkeypatch, seaweedfs, "resume", *overrides)
    codes = run_nodes(job, tmp_path)
    assert codes[1] != 0, (tmp_path / "node1.log").read_text()[-3000:]
    assert "no reward on rank 1 in round 3" in (tmp_path / "node1.log").read_text()
    every_rank = {"trainer_state.json", "rank0.pt", "rank1.pt", "dcp/.metadata", "dcp/__0_0.distcp", "dcp/__1_0.distcp"}
    saved = s3_checkpoints(ws)
    assert set(saved) == {"checkpoint-1", "checkpoint-2"}
    assert all(files == every_rank for files in saved.values()), saved  # node 1's shards beside node 0's

    monkeypatch.delenv("NODE_REWARD_FAIL_AT")
    for node in ("node0", "node1"):  # fresh pods: nothing on their disks, S3 alone
        shutil.rmtree(tmp_path / node)
    ws, job = launcher(tmp_path, monkeypatch, seaweedfs, "resume", *overrides)
    codes = run_nodes(job, tmp_path)
    logs = [(tmp_path / f"node{n}.log").read_text() for n in (0, 1)]
    assert codes == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    assert "resumed GRPO from" in logs[0] and "(step 2, written by 2 processes)" in logs[0]
    summary = collect_summary(ws)
    assert summary["steps"] == 4 and summary["world_size"] == 2
    history = (ws.root / "grpo" / "history.jsonl").read_text().splitlines()
    assert len(history) == 4  # steps 1 and 2 from the checkpoint, 3 and 4 trained now
    saved = s3_checkpoints(ws)
    assert set(saved) == {
        "checkpoint-3",
        "checkpoint-4",
    }  # the last step saved too; older ones pruned with node 1's files
    assert all(files == every_rank for files in saved.values()), saved
    resumed = load_file(ws.root / "grpo" / "final" / "adapter_model.safetensors")
    expected = load_file(straight.root / "grpo" / "final" / "adapter_model.safetensors")
    assert resumed.keys() == expected.keys()
    assert all(torch.equal(resumed[k], expected[k]) for k in expected)  # as if never interrupted
    same = [json.loads(h) for h in (straight.root / "grpo" / "history.jsonl").read_text().splitlines()]
    assert [(h["loss"], h["reward"]) for h in map(json.loads, history)] == [(h["loss"], h["reward"]) for h in same]


def test_a_starting_model_outside_the_workspace_is_refused(tmp_path, monkeypatch, seaweedfs):
    """The continuous flow's registry champion lives outside the workspace: the nodes could not read it."""
    champion = tmp_path / "registry" / "champion"
    champion.mkdir(parents=True)
    with pytest.raises(ValueError, match="the starting model .*champion' is outside the workspace"):
        launcher(tmp_path, monkeypatch, seaweedfs, "champ", init_model=str(champion))
