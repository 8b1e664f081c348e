"""MLflow tracking: one parent run per pipeline run, one nested run per stage.

Everything goes through ``MlflowClient`` with explicit run ids (no global active-run stack), so
logging is correct whichever thread Prefect runs a task on. Default store: a SQLite file in the
output folder (``sqlite:///<output_dir>/mlflow.db``) with artifacts beside it in
``<output_dir>/mlartifacts``; ``tracking.uri`` or $MLFLOW_TRACKING_URI point elsewhere. An s3:// output_dir
keeps this default store in its local mirror (<storage.cache_dir>/<bucket>/<prefix>/mlflow.db): SQLite cannot
live on S3; for tracking that outlives the machine, use a server (``mlflow server --artifacts-destination
s3://...``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mlflow.entities import Metric, Param, RunTag
from mlflow.tracking import MlflowClient

from grpoflow.tasks.config import PipelineConfig
from grpoflow.tasks.runtime import run_meta
from grpoflow.tasks.runtime.run_meta import omitted
from grpoflow.tasks.runtime.workspace import local_dir

log = logging.getLogger(__name__)
PARENT_TAG = "mlflow.parentRunId"


def tracking_uri(cfg: PipelineConfig) -> str:
    if cfg.tracking.uri:
        return cfg.tracking.uri
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    return f"sqlite:///{local_dir(cfg.run.output_dir, cfg.storage.cache_dir) / 'mlflow.db'}"


def experiment_id(client: MlflowClient, cfg: PipelineConfig) -> str:
    exp = client.get_experiment_by_name(cfg.tracking.experiment)
    if exp is not None:
        return exp.experiment_id
    artifact_location = None
    if client.tracking_uri.startswith("sqlite:"):
        artifact_location = (local_dir(cfg.run.output_dir, cfg.storage.cache_dir) / "mlartifacts").as_uri()
    return client.create_experiment(cfg.tracking.experiment, artifact_location=artifact_location)


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def git_commit() -> str | None:
    try:
        here = Path(__file__).resolve().parent
        res = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5)
        return res.stdout.strip() or None if res.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


class RunLogger:
    """Logs to one MLflow run by id; ``RunLogger.disabled()`` logs nothing (plain function use, tests)."""

    def __init__(self, client: MlflowClient | None, run_id: str | None):
        self.client = client
        self.run_id = run_id
        self.constant: dict[str, str] = {}  # metric name (or 'prefix/') -> why it cannot move: not logged
        self._params: dict[str, str] = {}

    def omit_constant(self, constant: dict[str, str]) -> None:
        """Log none of ``constant``'s metrics from now on; a ``metric_omitted.<name>`` tag says why, once."""
        self.constant.update(constant)
        self.set_tags({f"metric_omitted.{k.rstrip('/')}": why for k, why in constant.items()})

    @classmethod
    def disabled(cls) -> RunLogger:
        return cls(None, None)

    def __bool__(self) -> bool:
        return self.client is not None

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        if self.client is None:
            return
        ts = int(time.time() * 1000)
        keep = {k: v for k, v in metrics.items() if not (self.constant and omitted(k, self.constant))}
        items = [Metric(k, float(v), ts, step or 0) for k, v in keep.items() if v is not None and v == v]
        for i in range(0, len(items), 500):
            self.client.log_batch(self.run_id, metrics=items[i : i + 500])

    def log_params(self, params: dict[str, Any]) -> None:
        if self.client is None:
            return
        new = {}
        for k, v in flatten(params).items():  # a param is written once: the same value again is skipped
            value = str(v)[:6000]
            if k in self._params and self._params[k] != value:
                log.warning("run %s: param %s already %r, %r not logged", self.run_id, k, self._params[k], value)
            elif k not in self._params:
                new[k] = self._params[k] = value
        items = [Param(k, v) for k, v in new.items()]
        for i in range(0, len(items), 100):
            self.client.log_batch(self.run_id, params=items[i : i + 100])

    def set_tags(self, tags: dict[str, Any]) -> None:
        if self.client is None:
            return
        items = [RunTag(k, str(v)) for k, v in tags.items() if v is not None]
        if items:
            self.client.log_batch(self.run_id, tags=items)

    def log_dict(self, obj: Any, artifact_file: str) -> None:
        if self.client is None:
            return
        self.client.log_dict(self.run_id, obj, artifact_file)

    def log_text(self, text: str, artifact_file: str) -> None:
        if self.client is None:
            return
        self.client.log_text(self.run_id, text, artifact_file)

    def log_table(self, data: dict[str, list], artifact_file: str) -> None:
        if self.client is None:
            return
        self.client.log_table(self.run_id, data=data, artifact_file=artifact_file)

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        if self.client is None:
            return
        path = Path(path)
        if path.is_dir():
            self.client.log_artifacts(self.run_id, str(path), artifact_path)
        else:
            self.client.log_artifact(self.run_id, str(path), artifact_path)


EXPERIMENT_KIND = {"mlflow.experimentKind": "custom_model_development"}  # model training, for UIs that read it
NOTE = "mlflow.note.content"  # the run's description in the UI


def start_pipeline_run(cfg: PipelineConfig, tags: dict[str, Any] | None = None) -> RunLogger:
    """Create the parent run (named by run_meta.parent_name), log the resolved config (params + config.yaml
    artifact) and the filter tags."""
    import yaml

    client = MlflowClient(tracking_uri(cfg))
    exp = experiment_id(client, cfg)
    if client.get_experiment(exp).tags.get("mlflow.experimentKind") is None:
        client.set_experiment_tag(exp, *next(iter(EXPERIMENT_KIND.items())))
    name = run_meta.parent_name(cfg, time.strftime("%Y-%m-%d %H:%M"))
    run = client.create_run(exp, run_name=name)
    parent = RunLogger(client, run.info.run_id)
    parent.set_tags(
        {
            **run_meta.filter_tags(cfg, "pipeline", name, git_commit()),
            NOTE: run_meta.describe(cfg, "pipeline", None),
            **(tags or {}),
        }
    )
    parent.log_params(cfg.to_dict())
    parent.log_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False), "config.yaml")
    return parent


def run_url(client: MlflowClient, run_id: str, base: str | None = None) -> str:
    """The run's page in the MLflow UI's model-training view (``?workflowType=machine_learning``: 3.x opens its GenAI
    view otherwise). ``base``: the UI's address; default the tracking server's, or 127.0.0.1:5000 (``mlflow ui``)
    for a local store."""
    uri = client.tracking_uri
    base = base or (uri.rstrip("/") if uri.startswith(("http://", "https://")) else "http://127.0.0.1:5000")
    exp = client.get_run(run_id).info.experiment_id
    return f"{base}/#/experiments/{exp}/runs/{run_id}?workflowType=machine_learning"


def end_run(logger: RunLogger, ok: bool) -> None:
    logger.client.set_terminated(logger.run_id, "FINISHED" if ok else "FAILED")


@contextlib.contextmanager
def stage_run(cfg: PipelineConfig, parent_run_id: str | None, stage: str) -> Iterator[RunLogger]:
    """A nested MLflow run for one stage, named and tagged by run_meta; a disabled logger when there is no parent
    run. The description (what the stage did) is set here, its result by the caller at the end."""
    if parent_run_id is None:
        yield RunLogger.disabled()
        return
    client = MlflowClient(tracking_uri(cfg))
    parent = client.get_run(parent_run_id)
    pipeline = parent.info.run_name
    tags = {
        PARENT_TAG: parent_run_id,
        **run_meta.filter_tags(cfg, stage, pipeline, parent.data.tags.get("git_commit")),
        NOTE: run_meta.describe(cfg, stage, None),
    }
    run = client.create_run(parent.info.experiment_id, run_name=run_meta.stage_name(cfg, stage), tags=tags)
    logger = RunLogger(client, run.info.run_id)
    ok = False
    try:
        yield logger
        ok = True
    finally:
        end_run(logger, ok)
