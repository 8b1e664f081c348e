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
import json
import logging
import math
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

from mlflow.entities import Metric, Param, RunTag
from mlflow.tracking import MlflowClient

from grpoflow.tasks.config import PipelineConfig
from grpoflow.tasks.config.secrets import redact, without_userinfo
from grpoflow.tasks.storage.store import LocalStore
from grpoflow.tasks.storage.workspace import join_location, local_dir
from grpoflow.tasks.tracking import run_meta
from grpoflow.tasks.tracking.run_meta import omitted

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
    """Logs to one MLflow run by id; ``RunLogger.disabled()`` logs nothing (plain function use, tests).

    With a ``journal`` folder (every pipeline and stage run) nothing here waits on the network: each call appends
    to the run's journal and a background thread sends it (tasks/tracking/journal.py, sender.py); :meth:`end`
    sends the run's status and waits at most ``flush_timeout_s`` for the rest. Without one, calls go straight to
    the client. ``skip``: {metric key: last step the run holds} of a reopened run: points at those steps or
    before are not logged again (a resumed stage redoes the steps after its checkpoint)."""

    def __init__(
        self,
        client: MlflowClient | None,
        run_id: str | None,
        journal: Path | None = None,
        name: str | None = None,
        flush_timeout_s: float = 60.0,
        request_timeout_s: float = 10.0,
        experiment: str | None = None,
    ):
        self.client = client
        self.run_id = run_id
        self.constant: dict[str, str] = {}  # metric name (or 'prefix/') -> why it cannot move: not logged
        self._params: dict[str, str] = {}
        self.skip: dict[str, int] = {}
        self._non_finite: set[str] = set()  # metrics already warned about a NaN or infinite value
        self._tables: dict[str, Any] = {}  # artifact file -> the DataFrame logged to it so far (log_table)
        self.flush_timeout_s = flush_timeout_s
        self.journal = self.sender = None
        if client is not None and journal is not None:
            from grpoflow.tasks.tracking.journal import Journal
            from grpoflow.tasks.tracking.journal_store import store_record
            from grpoflow.tasks.tracking.sender import Sender

            self.journal = Journal(journal, run_id, name, store_record(client.tracking_uri, experiment))
            self.sender = Sender(self.journal, client.tracking_uri, request_timeout_s)

    def omit_constant(self, constant: dict[str, str]) -> None:
        """Log none of ``constant``'s metrics from now on; a ``metric_omitted.<name>`` tag says why, once."""
        self.constant.update(constant)
        self.set_tags({f"metric_omitted.{k.rstrip('/')}": why for k, why in constant.items()})

    @classmethod
    def disabled(cls) -> RunLogger:
        return cls(None, None)

    def __bool__(self) -> bool:
        return self.client is not None

    @property
    def params(self) -> dict[str, str]:
        """The params this run holds (logged here, or found on a reopened run)."""
        return dict(self._params)

    @property
    def reachable(self) -> bool:
        """False while the background sender cannot reach the store."""
        return self.sender is None or self.sender.reachable

    def reopened_params(self, params: dict[str, str]) -> None:
        self._params.update(params)

    def reopened(self, run) -> None:
        """Take over a run an earlier attempt logged to: its params, and the last step of each metric (skipped),
        counting the steps its journals still hold unsent (a replay that ran out of time): they reach the run
        later, and a step logged again would be a second point."""
        from grpoflow.tasks.tracking.journal import Journal

        self._params.update(run.data.params)
        for key in run.data.metrics:
            steps = [m.step for m in self.client.get_metric_history(self.run_id, key)]
            if steps:
                self.skip[key] = max(steps)
        folder = self.journal.folder if self.journal is not None else None
        for path in sorted(folder.glob(f"{self.run_id}*.jsonl")) if folder is not None else ():
            if Journal.run_of(path) == self.run_id:
                for key, step in Journal(folder, self.run_id, path.stem).pending_steps().items():
                    self.skip[key] = max(self.skip.get(key, -1), step)

    def _batch(self, metrics=(), params=(), tags=()) -> None:
        if self.journal is not None:
            self.journal.append({"op": "batch", "m": metrics, "p": params, "t": tags})
            self.sender.wake()
            return
        self.client.log_batch(
            self.run_id,
            metrics=[Metric(k, v, ts, st) for k, v, ts, st in metrics],
            params=[Param(k, v) for k, v in params],
            tags=[RunTag(k, v) for k, v in tags],
        )

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        if self.client is None:
            return
        ts, step = int(time.time() * 1000), int(step or 0)
        keep = {k: v for k, v in metrics.items() if not (self.constant and omitted(k, self.constant))}
        # None is a value that was not measured (a reward that skipped every row): no point. NaN and +-inf are
        # measured values (a diverging loss): logged as they are, so the chart shows where the run went wrong
        items = [[k, float(v), ts, step] for k, v in keep.items() if v is not None and step > self.skip.get(k, -1)]
        for k, v, _, _ in items:
            if not math.isfinite(v) and k not in self._non_finite:
                self._non_finite.add(k)
                log.warning(
                    "run %s: metric %s is %s at step %d (logged as it is; warned once per metric)",
                    self.run_id,
                    k,
                    v,
                    step,
                )
        for i in range(0, len(items), 1000):
            self._batch(metrics=items[i : i + 1000])
        if self.journal is not None:
            self.journal.sync()  # the end of a logged step: what it logged survives a power loss

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
        items = [[k, v] for k, v in new.items()]
        for i in range(0, len(items), 100):
            self._batch(params=items[i : i + 100])

    def set_tags(self, tags: dict[str, Any]) -> None:
        if self.client is None:
            return
        items = [[k, str(v)] for k, v in tags.items() if v is not None]
        for i in range(0, len(items), 100):
            self._batch(tags=items[i : i + 100])

    def set_status(self, status: str, end_time: int | None = None) -> None:
        """RUNNING (a reopened run), or FINISHED / FAILED / KILLED with the end time (now when None)."""
        if self.client is None:
            return
        if status != "RUNNING":
            end_time = end_time or int(time.time() * 1000)
        if self.journal is None:
            self.client.update_run(self.run_id, status=status) if end_time is None else self.client.set_terminated(
                self.run_id, status, end_time
            )
            return
        self.journal.append({"op": "status", "status": status, "end_time": end_time})
        self.journal.sync()
        self.sender.wake()

    def _artifact(self, path: Path, artifact_path: str | None) -> None:
        from grpoflow.tasks.tracking.journal import file_state

        path = Path(path).absolute()  # sent later, and only while its files are as logged ("state")
        self.journal.append({"op": "artifact", "path": str(path), "dir": artifact_path, "state": file_state(path)})
        self.sender.wake()

    def _blob(self, data: bytes, artifact_file: str) -> None:
        folder = str(PurePosixPath(artifact_file).parent)
        self._artifact(self.journal.blob(artifact_file, data), None if folder == "." else folder)

    def log_dict(self, obj: Any, artifact_file: str) -> None:
        if self.client is None:
            return
        if self.journal is None:
            return self.client.log_dict(self.run_id, obj, artifact_file)
        if artifact_file.endswith((".yaml", ".yml")):
            import yaml

            text = yaml.safe_dump(obj, default_flow_style=False)
        else:
            text = json.dumps(obj, indent=2, default=str)
        self._blob(text.encode(), artifact_file)

    def log_text(self, text: str, artifact_file: str) -> None:
        if self.client is None:
            return
        if self.journal is None:
            return self.client.log_text(self.run_id, text, artifact_file)
        self._blob(text.encode(), artifact_file)

    def log_table(self, data: dict[str, list], artifact_file: str) -> None:
        """The rows of ``data`` added to the run's table ``artifact_file`` (MLflow's table format, listed in the
        run's Evaluation view). Through the journal, each line holds the whole table this logger logged to that
        file so far and the sender writes it over the artifact: a line sent again (a failure after the upload)
        writes the same rows again rather than appending them twice, as MLflow's own log_table would. So a reopened
        run that logs a file again (a resumed stage redoing its middle step) replaces that file's earlier rows."""
        if self.client is None:
            return
        if self.journal is None:
            return self.client.log_table(self.run_id, data=data, artifact_file=artifact_file)
        from grpoflow.tasks.tracking.entities import joined_table

        whole = self._tables[artifact_file] = joined_table(self._tables.get(artifact_file), data)
        text = whole.to_json(orient="split", index=False, date_format="iso", default_handler=str)
        path = self.journal.blob(artifact_file, text.encode())
        self.journal.append({"op": "table", "path": str(path), "file": artifact_file, "whole": True})
        self.sender.wake()

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        if self.client is None:
            return
        path = Path(path)
        if self.journal is not None:
            return self._artifact(path, artifact_path)
        if path.is_dir():
            self.client.log_artifacts(self.run_id, str(path), artifact_path)
        else:
            self.client.log_artifact(self.run_id, str(path), artifact_path)

    def log_model(self, name: str, path: str, params: dict[str, Any], step: int) -> None:
        """The trained model at ``path`` as a LoggedModel output of this run (mlflow_entities.log_model_output)."""
        if self.client is None:
            return
        if self.journal is None:
            from grpoflow.tasks.tracking.entities import log_model_output

            log_model_output(self.client, self.run_id, name, path, params, step)
            return
        params = {k: str(v) for k, v in params.items()}
        self.journal.append({"op": "model", "name": name, "path": path, "params": params, "step": step})
        self.sender.wake()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait (at most ``timeout`` s, default tracking.flush_timeout_s) until what was logged is sent."""
        if self.sender is None:
            return True
        return self.sender.flush(self.flush_timeout_s if timeout is None else timeout)

    def end(self, ok: bool) -> bool:
        """Set the run FINISHED (or FAILED) and send the rest within tracking.flush_timeout_s; what a server that
        still does not answer misses stays in the journal (one line says so). True when all was sent."""
        if self.client is None:
            return True
        self.set_status("FINISHED" if ok else "FAILED")
        return self.close()

    def close(self) -> bool:
        if self.sender is None:
            return True
        sent = self.sender.close(self.flush_timeout_s)
        self.journal.close()
        if sent and self.journal.files.is_dir():
            shutil.rmtree(self.journal.files, ignore_errors=True)  # the artifacts' copies: on the server now
        return sent


EXPERIMENT_KIND = {"mlflow.experimentKind": "custom_model_development"}  # model training, for UIs that read it
NOTE = "mlflow.note.content"  # the run's description in the UI


def workspace_dir(cfg: PipelineConfig) -> Path:
    """The run's local folder (the mirror of an s3:// workspace): <output_dir>/<run.name>."""
    location = join_location(cfg.run.output_dir, cfg.run.name) if cfg.run.name else cfg.run.output_dir
    return local_dir(location, cfg.storage.cache_dir)


def logger_for(
    cfg: PipelineConfig, client: MlflowClient, run_id: str, root: Path | None = None, name: str | None = None
) -> RunLogger:
    """The journaled logger of ``run_id``: journal <workspace>/tracking-journal/<name or run_id>.jsonl (another
    process logging to the same run, rank 0 of a launch, uses its own name), timeouts from tracking.*."""
    from grpoflow.tasks.tracking.journal import JOURNAL_DIR

    t = cfg.tracking
    folder = (root or workspace_dir(cfg)) / JOURNAL_DIR
    return RunLogger(
        client,
        run_id,
        folder,
        name,
        flush_timeout_s=t.flush_timeout_s,
        request_timeout_s=t.request_timeout_s,
        experiment=cfg.tracking.experiment,
    )


def start_pipeline_run(cfg: PipelineConfig, tags: dict[str, Any] | None = None, root: Path | None = None) -> RunLogger:
    """Create the parent run (named by run_meta.parent_name), log the resolved config (params + config.yaml
    artifact) and the filter tags. ``root``: the workspace's local folder (its tracking journal)."""
    import yaml

    client = MlflowClient(tracking_uri(cfg))
    exp = experiment_id(client, cfg)
    if client.get_experiment(exp).tags.get("mlflow.experimentKind") is None:
        client.set_experiment_tag(exp, *next(iter(EXPERIMENT_KIND.items())))
    name = run_meta.parent_name(cfg, time.strftime("%Y-%m-%d %H:%M"))
    run = client.create_run(exp, run_name=name)
    parent = logger_for(cfg, client, run.info.run_id, root)
    parent.set_tags(
        {
            **run_meta.filter_tags(cfg, None, name, git_commit()),
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
    uri = redact(without_userinfo(client.tracking_uri))  # printed and logged: no credentials, which a browser asks
    base = base or (uri.rstrip("/") if uri.startswith(("http://", "https://")) else "http://127.0.0.1:5000")
    exp = client.get_run(run_id).info.experiment_id
    return f"{base}/#/experiments/{exp}/runs/{run_id}?workflowType=machine_learning"


def unsent(root: Path) -> int:
    """Records the journals of the workspace at ``root`` still hold unsent."""
    from grpoflow.tasks.tracking.journal import JOURNAL_DIR, Journal

    paths = sorted((root / JOURNAL_DIR).glob("*.jsonl"))
    return sum(Journal(p.parent, Journal.run_of(p), p.stem).pending_count() for p in paths)


def end_run(logger: RunLogger, ok: bool) -> bool:
    """FINISHED (FAILED unless ``ok``), sent within tracking.flush_timeout_s; True when nothing stays unsent."""
    return logger.end(ok)


STAGE_RUNS = "stage_runs.json"  # in the workspace: {stage: {"run_id", "key", "tracking_uri"}} (resume reopens)


def _stage_runs(root: Path, ws=None) -> dict[str, dict[str, str]]:
    """<workspace>/stage_runs.json; read through ``ws`` (a Workspace: from S3 for an s3:// one) when given."""
    try:
        text = ws.read_text(STAGE_RUNS) if ws is not None else (root / STAGE_RUNS).read_text()
        return json.loads(text or "{}")
    except (OSError, ValueError):
        return {}


def recorded_stage_run(root: Path, stage: str, ws=None) -> dict[str, str]:
    return _stage_runs(root, ws).get(stage, {})


def record_stage_run(root: Path, stage: str, entry: dict[str, str], ws=None) -> None:
    """Record ``stage``'s MLflow run in <workspace>/stage_runs.json; through ``ws`` also on S3 (an s3:// workspace:
    a resume on another machine, or on an emptied cache, reopens the same run)."""
    runs = _stage_runs(root, ws)
    runs[stage] = entry
    text = json.dumps(runs, indent=2, sort_keys=True)
    if ws is not None:
        ws.write_text(STAGE_RUNS, text)
        return
    LocalStore(root).write(STAGE_RUNS, text.encode())


def reopen_stage_run(client: MlflowClient, root: Path, stage: str, key: str | None, ws=None):
    """The MLflow run of ``stage``'s earlier attempt with the same key (its files kept: GRPO goes on from its last
    checkpoint) when it still exists in this store; None otherwise."""
    from mlflow.exceptions import MlflowException

    prev = recorded_stage_run(root, stage, ws)
    if key is None or prev.get("key") != key or redact(prev.get("tracking_uri") or "") != redact(client.tracking_uri):
        return None
    try:
        run = client.get_run(prev["run_id"])
    except MlflowException:
        return None
    return run if run.info.lifecycle_stage == "active" else None


@contextlib.contextmanager
def stage_run(
    cfg: PipelineConfig,
    parent_run_id: str | None,
    spec: run_meta.StageInfo,
    root: Path | None = None,
    key: str | None = None,
    ws=None,
) -> Iterator[RunLogger]:
    """A nested MLflow run for one stage (``spec``: its StageSpec), named and tagged by run_meta; a disabled logger
    when there is no parent run. The description (what the stage did) is set here, its result by the caller at the end.

    One run per stage: an attempt with the stage's ``key`` recorded in <workspace>/stage_runs.json reopens that
    run (RUNNING again; the metric steps it holds are not logged again); another key starts a new run. ``ws``: the
    stage's Workspace; for an s3:// one, stage_runs.json is read from and written to S3 too."""
    if parent_run_id is None:
        yield RunLogger.disabled()
        return
    from grpoflow.tasks.tracking.reach import tracking_problem

    stage = spec.name
    uri = tracking_uri(cfg)
    if problem := tracking_problem(uri):  # the run must be created or reopened: seconds, not minutes of retries
        raise ConnectionError(f"stage {stage} cannot start: {problem}")
    root = root or workspace_dir(cfg)
    client = MlflowClient(uri)
    run = reopen_stage_run(client, root, stage, key, ws)
    if run is not None:
        client.update_run(run.info.run_id, status="RUNNING")  # now: system metrics sample only a RUNNING run
        logger = logger_for(cfg, client, run.info.run_id, root)
        logger.reopened(run)
        resumes = int(run.data.tags.get("grpoflow.stage_resumes", "0")) + 1
        last = max((logger.skip[k] for k in logger.skip if not k.startswith("system/")), default=0)
        logger.set_tags({"grpoflow.stage_resumes": resumes, "grpoflow.steps_logged_before_resume": last})
        log.info("stage %s: continuing MLflow run %s (steps up to %d already logged)", stage, run.info.run_id, last)
    else:
        parent = client.get_run(parent_run_id)
        pipeline = parent.info.run_name
        tags = {
            PARENT_TAG: parent_run_id,
            **run_meta.filter_tags(cfg, spec, pipeline, parent.data.tags.get("git_commit")),
            NOTE: run_meta.describe(cfg, spec, None),
        }
        run = client.create_run(parent.info.experiment_id, run_name=run_meta.stage_name(cfg, spec), tags=tags)
        logger = logger_for(cfg, client, run.info.run_id, root)
        record_stage_run(root, stage, {"run_id": run.info.run_id, "key": key or "", "tracking_uri": redact(uri)}, ws)
    ok = False
    try:
        yield logger
        ok = True
    finally:
        end_run(logger, ok)
