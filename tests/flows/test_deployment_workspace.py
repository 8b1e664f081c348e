"""The workspace a deployed pipeline run works in (flows/deployment.py): where `grpoflow run` would put it, an
s3:// output_dir kept as a URI rather than turned into a local folder named `s3:`."""

from pathlib import Path

from grpoflow.flows.deployment import workspace_of
from grpoflow.tasks.config import load_run_config
from grpoflow.tasks.storage.workspace import Workspace
from tests.paths import MICRO


def test_an_s3_output_dir_gives_an_s3_workspace(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_run_config(str(MICRO), ["run.output_dir=s3://bucket/prefix", "run.name=deployed"])
    assert workspace_of(cfg) == "s3://bucket/prefix/deployed"
    cfg = load_run_config(str(MICRO), ["run.output_dir=s3://bucket/prefix/", "run.name=deployed"])
    assert workspace_of(cfg) == "s3://bucket/prefix/deployed"
    # what the flow hands the pipeline opens as the S3 store, its files mirrored under storage.cache_dir
    cache = tmp_path / "cache"
    cfg = load_run_config(str(MICRO), ["run.output_dir=s3://bucket/prefix", "run.name=d", f"storage.cache_dir={cache}"])
    ws = Workspace(workspace_of(cfg), cfg.storage)
    assert ws.location == "s3://bucket/prefix/d" and ws.root == cache / "bucket" / "prefix" / "d"
    assert not (tmp_path / "s3:").exists()


def test_a_relative_local_output_dir_resolves_against_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_run_config(str(MICRO), ["run.output_dir=runs", "run.name=deployed"])
    assert workspace_of(cfg) == str(tmp_path.resolve() / "runs" / "deployed")
    assert Path(workspace_of(cfg)).is_absolute()
