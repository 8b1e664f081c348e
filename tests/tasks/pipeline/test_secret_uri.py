"""A tracking URI with credentials in $MLFLOW_TRACKING_URI (the config refuses them; the environment may hold
them): the runs go to the server, and nothing the run writes (run.json, stage_runs.json, the GRPO launch spec)
holds the secret; resume and compare find the real URI again from the environment."""

from __future__ import annotations

import json

from grpoflow.flows.stages import PIPELINE
from grpoflow.tasks.config import config_from_dict
from grpoflow.tasks.ops.compare import resolve_run
from grpoflow.tasks.pipeline.resume import open_pipeline_run
from grpoflow.tasks.stages.grpo_launch import launch_spec
from grpoflow.tasks.storage.workspace import Workspace
from grpoflow.tasks.tracking.reach import tracking_problem
from grpoflow.tasks.tracking.tracker import STAGE_RUNS, run_url, stage_run

SECRET = "s3cr3t-Pa55"


def test_credentials_in_the_env_uri_are_used_but_never_written(mlflow_server, tmp_path, monkeypatch):
    real = mlflow_server.replace("://", f"://alice:{SECRET}@", 1)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", real)
    assert tracking_problem(real) is None  # the probe drops the userinfo (urllib took it for the host name)
    cfg = config_from_dict({"run": {"output_dir": str(tmp_path / "out"), "name": "r"}})
    ws = Workspace(tmp_path / "out" / "r")
    parent = open_pipeline_run(cfg, ws, {})
    with stage_run(cfg, parent.run_id, PIPELINE["grpo"], ws.root, key="k1", ws=ws) as stage:
        spec = launch_spec(cfg, ws, stage, "unused-model", tmp_path / "launch")
        stage.log_metrics({"loss": 0.5}, step=1)
    url = run_url(parent.client, parent.run_id)  # printed at the end of a run
    assert url.startswith(f"{mlflow_server.rstrip('/')}/#/experiments/") and SECRET not in url
    parent.end(True)

    written = {p.name: p.read_text() for p in (ws.root / "run.json", ws.root / STAGE_RUNS)}
    written["spec"] = json.dumps(spec)
    for name, text in written.items():
        assert SECRET not in text, name
        assert "://***@" in text, name
    # resume: the same server is recognised through the redaction; the parent run is reopened, not duplicated
    again = open_pipeline_run(cfg, ws, {})
    assert again.run_id == parent.run_id
    again.end(True)
    with stage_run(cfg, parent.run_id, PIPELINE["grpo"], ws.root, key="k1", ws=ws) as reopened:
        assert reopened.run_id == stage.run_id
    # compare reads run.json and connects with the real URI from the environment
    assert resolve_run(str(ws.root), None) == (real, parent.run_id)
