"""The micro pipeline with its run workspace on S3 (SeaweedFS) and MLflow artifacts on S3 (an `mlflow server`
with --artifacts-destination s3://...), run as a user runs it: `python -m grpoflow.flows.cli`, credentials only in the
environment. The run is killed (SIGKILL) in GRPO as soon as its first checkpoint is on S3, its machine's cache is
deleted, and `grpoflow resume s3://...` with another cache finishes it: S3 alone must be enough."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow.artifacts import download_artifacts
from mlflow.tracking import MlflowClient

from grpoflow.flows.stages import PIPELINE
from grpoflow.tasks.storage import s3
from grpoflow.tasks.storage.workspace import MANIFEST
from tests.paths import MICRO

STAGES = PIPELINE.names

STORE = s3.S3Client()  # the default storage settings: endpoint and credentials from the AWS environment variables
SLOW_REWARD = """
import time

def slow_length(prompts, completions, **columns):
    time.sleep(0.5)  # keeps each GRPO step long enough to be killed after the first checkpoint
    return [float(len(c[0]["content"]) % 7) for c in completions]
"""


def _cli(ctx, *args: str) -> subprocess.CompletedProcess:
    res = subprocess.run(
        [sys.executable, "-m", "grpoflow.flows.cli", *args], env=ctx["env"], capture_output=True, text=True
    )
    assert res.returncode == 0, res.stderr[-4000:]
    return res


def _objects(uri: str) -> dict[str, dict]:
    """{key below uri: object} of everything under the prefix."""
    return {o["uri"][len(uri) + 1 :]: o for o in STORE.list_objects(uri + "/")}


def _manifests(ws: str) -> dict[str, dict | None]:
    return {stage: STORE.get_json(f"{ws}/{stage}/{MANIFEST}", None) for stage in STAGES}


@pytest.fixture(scope="module")
def ctx(seaweedfs, mlflow_s3_server, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("s3_pipeline")
    (tmp / "slow_reward.py").write_text(SLOW_REWARD)
    env = dict(
        os.environ,
        **seaweedfs.env(),
        OMP_NUM_THREADS="1",
        PREFECT_HOME=str(tmp / "prefect"),
        PYTHONPATH=f"{tmp}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    )
    env.pop("MLFLOW_TRACKING_URI", None)
    saved = {k: os.environ.get(k) for k in seaweedfs.env()}
    os.environ.update(seaweedfs.env())  # this process reads the bucket with tasks/storage/s3.py, as the pipeline does
    ws = f"s3://{seaweedfs.bucket}/runs/s3run"
    c = {"env": env, "server": seaweedfs, "mlflow": mlflow_s3_server, "ws": ws, "first_cache": tmp / "cache"}
    c["cache"] = tmp / "another-cache"
    c["local"] = c["cache"] / seaweedfs.bucket / "runs" / "s3run"
    args = [
        "run",
        str(MICRO),
        f"run.output_dir=s3://{seaweedfs.bucket}/runs",
        "run.name=s3run",
        f"tracking.uri={mlflow_s3_server}",
        "tracking.experiment=s3-e2e",
        f"storage.cache_dir={c['first_cache']}",
        "grpo.save_steps=1",
        "grpo.reward_funcs=[correctness,proximity,strict_format,slow_reward:slow_length]",
    ]
    log = tmp / "killed-run.log"
    with log.open("w") as out:  # its own process group: SIGKILL reaches the flow and Prefect's server
        proc = subprocess.Popen(
            [sys.executable, "-m", "grpoflow.flows.cli", *args],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    marker = f"{ws}/grpo/checkpoints/checkpoint-1/trainer_state.json"  # uploaded last: the checkpoint is complete
    deadline = time.time() + 600
    try:
        while proc.poll() is None and not STORE.exists(marker):
            assert time.time() < deadline, "no GRPO checkpoint on S3 in 10 minutes"
            time.sleep(0.1)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL, f"the run ended before it could be killed: {log.read_text()[-3000:]}"
    c["killed"] = _manifests(ws)
    c["killed_grpo_run"] = json.loads(STORE.get_bytes(f"{ws}/stage_runs.json"))["grpo"]["run_id"]
    shutil.rmtree(c["first_cache"])  # the machine is gone
    c["resume"] = _cli(c, "resume", ws, f"storage.cache_dir={c['cache']}")
    c["log"] = log.read_text() + c["resume"].stdout + c["resume"].stderr
    yield c
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.mark.slow
def test_killed_grpo_resumes_from_s3_on_an_empty_cache(ctx):
    killed = ctx["killed"]
    assert killed["data"] and killed["sft"] and killed["grpo"] is killed["eval"] is killed["export"] is None
    err = ctx["resume"].stderr
    assert "stage data: complete (key" in err and "stage sft: complete (key" in err  # S3 said so
    assert "resumed GRPO from" in err and "/grpo/checkpoints/checkpoint-" in err  # pulled from S3
    after = _manifests(ctx["ws"])
    assert after["data"] == killed["data"] and after["sft"] == killed["sft"]  # not recomputed
    assert after["grpo"]["summary"]["steps"] == 3 and after["eval"] and after["export"]
    # the summaries' paths point into the new cache, where GRPO found the SFT model it pulled from S3
    assert after["grpo"]["summary"]["base_model"] == str(ctx["local"] / "sft" / "model")
    assert (ctx["local"] / "sft" / "model" / "model.safetensors").is_file()
    assert not ctx["first_cache"].exists()
    # one MLflow parent run throughout: run.json on S3 led the resume back to it
    client = MlflowClient(ctx["mlflow"])
    parent = client.get_run(json.loads(STORE.get_bytes(f"{ctx['ws']}/run.json"))["mlflow_run_id"])
    assert parent.data.tags["grpoflow.resumes"] == "1" and parent.info.status == "FINISHED"
    children = client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    stages = sorted((r.data.tags["grpoflow.stage"], r.info.status) for r in children)
    assert stages == sorted((s, "FINISHED") for s in STAGES)  # one grpo run: the killed attempt's, reopened
    # stage_runs.json on S3 named it, though the cache that held the first copy was deleted
    grpo = next(r for r in children if r.data.tags["grpoflow.stage"] == "grpo")
    assert json.loads(STORE.get_bytes(f"{ctx['ws']}/stage_runs.json"))["grpo"]["run_id"] == ctx["killed_grpo_run"]
    assert grpo.info.run_id == ctx["killed_grpo_run"] and grpo.data.tags["grpoflow.stage_resumes"] == "1"
    steps = [m.step for m in client.get_metric_history(grpo.info.run_id, "loss")]
    assert steps == sorted(set(steps)) == list(range(1, 4))  # every step once
    assert parent.info.run_id[:8] in _cli(ctx, "compare", ctx["ws"], ctx["ws"]).stdout  # compare reads S3 too


@pytest.mark.slow
def test_every_stage_is_published_on_s3(ctx):
    objects = _objects(ctx["ws"])
    for name in (
        "config.yaml",
        "run.json",
        "base_model/config.json",
        "data/train/dataset_info.json",
        "data/eval/state.json",
        "sft/model/model.safetensors",
        "grpo/final/adapter_model.safetensors",
        "grpo/checkpoints/checkpoint-2/trainer_state.json",
        "grpo/checkpoints/checkpoint-2/trainer_state.pt",
        "grpo/history.jsonl",
        "eval/report.json",
        "export/adapter/adapter_model.safetensors",
        "export/merged/model.safetensors",
        "export/gguf/model-f16.gguf",
    ):
        assert name in objects, name
    local = ctx["local"]
    assert "local copy" in ctx["resume"].stdout and (local / "config.yaml").is_file()  # the mirror, in the summary
    for stage in STAGES:
        manifest = STORE.get_json(f"{ctx['ws']}/{stage}/{MANIFEST}")
        assert manifest["stage"] == stage and len(manifest["key"]) == 64 and manifest["summary"], stage
        files = {k: o for k, o in objects.items() if k.startswith(f"{stage}/") and k != f"{stage}/attempt.json"}
        # the manifest is the newest object of its stage (S3 times are whole seconds)
        newest = max(o["last_modified"] for k, o in files.items() if not k.endswith(MANIFEST))
        assert files[f"{stage}/{MANIFEST}"]["last_modified"] >= newest, stage
        # S3 holds exactly the local mirror's files (size and ETag)
        mirrored = {p.relative_to(local).as_posix() for p in (local / stage).rglob("*") if p.is_file()}
        assert set(files) | {f"{stage}/attempt.json"} == mirrored, stage
        assert all(STORE.same_content(local / k, o) for k, o in files.items()), stage
    grpo = STORE.get_json(f"{ctx['ws']}/grpo/{MANIFEST}")["summary"]
    assert grpo["steps"] == 3 and grpo["model_path"] == str(local / "grpo" / "final")


@pytest.mark.slow
def test_mlflow_artifacts_are_objects_in_the_bucket(ctx):
    client = MlflowClient(ctx["mlflow"])
    exp = client.get_experiment_by_name("s3-e2e")
    runs = client.search_runs([exp.experiment_id])
    parent = next(r for r in runs if "mlflow.parentRunId" not in r.data.tags)
    assert json.loads(STORE.get_bytes(f"{ctx['ws']}/run.json"))["mlflow_run_id"] == parent.info.run_id
    export = next(r for r in runs if r.data.tags.get("grpoflow.stage") == "export")
    stored = _objects(f"s3://{ctx['server'].bucket}/mlflow")
    in_bucket = {k.split("/artifacts/", 1)[1]: o for k, o in stored.items() if f"/{export.info.run_id}/" in k}
    assert {"merged/model.safetensors", "merged/config.json", "adapter/adapter_model.safetensors"} <= set(in_bucket)
    assert any(f"/{parent.info.run_id}/artifacts/config.yaml" in k for k in stored)
    # and back through MLflow (the server proxies the bucket): the bytes the export stage wrote
    back = Path(download_artifacts(run_id=export.info.run_id, artifact_path="merged", tracking_uri=ctx["mlflow"]))
    merged = ctx["local"] / "export" / "merged"
    assert (back / "model.safetensors").read_bytes() == (merged / "model.safetensors").read_bytes()
    assert STORE.same_content(back / "model.safetensors", in_bucket["merged/model.safetensors"])


@pytest.mark.slow
def test_credentials_appear_nowhere(ctx):
    server = ctx["server"]
    secret = server.secret_key
    client = MlflowClient(ctx["mlflow"])
    runs = client.search_runs([client.get_experiment_by_name("s3-e2e").experiment_id])
    assert len(runs) == 1 + len(STAGES)  # the killed GRPO attempt reopened, not a second grpo run
    for r in runs:
        values = [*r.data.params.values(), *r.data.tags.values(), *r.data.params.keys(), *r.data.tags.keys()]
        assert not any(secret in v for v in values)
        assert not any("secret_access_key" in v.lower() for v in values)
    # every object of the workspace (config.yaml, run.json, manifests, models) and of the MLflow artifact store
    # (logged config.yaml, summaries, tables, models)
    for prefix in (ctx["ws"], f"s3://{server.bucket}/mlflow"):
        objects = STORE.list_objects(prefix + "/")
        assert len(objects) > 20
        for o in objects:
            assert secret.encode() not in STORE.get_bytes(o["uri"]), o["uri"]
    assert "storage" in STORE.get_bytes(f"{ctx['ws']}/config.yaml").decode()  # the config is there, without it
    assert "stage grpo: running" in ctx["log"] and "stage eval: running" in ctx["log"]  # both runs' output
    assert secret not in ctx["log"]
    # a credential in the config never gets that far
    res = subprocess.run(
        [sys.executable, "-m", "grpoflow.flows.cli", "validate", str(MICRO), f"storage.aws_secret_access_key={secret}"],
        env=ctx["env"],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 2 and "storage.aws_secret_access_key: credentials do not belong" in res.stderr
    assert secret not in res.stderr
