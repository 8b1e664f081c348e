"""The hub check before any stage (tasks/pipeline/preflight.py hub_problem) against a real HTTP server set as
HF_ENDPOINT that answers as the hub does: 200 for a public repo, 401 for a gated/private one without a token,
403 for one the token cannot read, 404 for none by that name. Only the first may start a run; the others name the
key, the id and HF_TOKEN or the id's spelling. And through the CLI: exit 2, one line."""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading

import pytest

from grpoflow.tasks.pipeline.preflight import hub_problem
from tests.paths import MICRO

ANSWERS = {"owner/public": 200, "owner/gated": 401, "owner/missing": 404}


class FakeHub(http.server.BaseHTTPRequestHandler):
    """GET /api/{models,datasets}/<id>: the status of ANSWERS; 403 when a token is sent for the gated one."""

    def do_GET(self):
        repo = self.path.split("/", 3)[-1]
        status = ANSWERS.get(repo, 404)
        if status == 401 and self.headers.get("Authorization"):
            status = 403
        body = json.dumps({"id": repo} if status == 200 else {"error": "Repository not found"}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def hub():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeHub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()


@pytest.fixture
def hub_env(hub, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", hub)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))  # empty: nothing is cached
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # no token saved by `hf auth login`
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    return hub


def test_a_public_repo_passes_and_gated_or_missing_ones_are_named(hub_env, monkeypatch):
    assert hub_problem("model.name", "owner/public", "model") is None
    gated = hub_problem("model.name", "owner/gated", "model")
    assert gated.startswith(f"model.name: the hub {hub_env} refuses 'owner/gated' without a login (HTTP 401)")
    assert "set HF_TOKEN" in gated and f"{hub_env}/owner/gated" in gated
    missing = hub_problem("data.source", "owner/missing", "dataset")
    assert (
        missing == f"data.source: no dataset 'owner/missing' on the hub {hub_env} (HTTP 404); check the id (owner/name)"
    )
    monkeypatch.setenv("HF_TOKEN", "hf_notallowed")
    refused = hub_problem("model.name", "owner/gated", "model")
    assert "with the token it was sent (HTTP 403)" in refused and "fix HF_TOKEN" in refused
    assert "hf_notallowed" not in refused


def test_the_cli_refuses_a_gated_model_before_any_stage(hub_env, tmp_path):
    env = dict(os.environ, PREFECT_HOME=str(tmp_path / "prefect"))
    env.pop("MLFLOW_TRACKING_URI", None)
    cmd = [sys.executable, "-m", "grpoflow.flows.cli", "run", str(MICRO), f"run.output_dir={tmp_path / 'runs'}"]
    res = subprocess.run(
        [*cmd, "model.name=owner/gated"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-2000:]
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("grpoflow: model.name: the hub") and "HTTP 401" in last and "HF_TOKEN" in last, last
    assert not (tmp_path / "runs").exists()
