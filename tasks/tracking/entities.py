"""MLflow entities of a stage run beyond params and metrics: logged model outputs, tables, system metrics (the
dataset inputs: tasks/tracking/dataset_inputs.py).

logged model    the model a training stage wrote, as a LoggedModel of the run's experiment, linked to the run as
                an output (``log_outputs``): the UI lists the run as a training run, also in its GenAI view. The
                weights stay in the workspace (and, for the export stage, in the run's artifacts); the model's
                ``workspace_path`` tag says where
table           a file in MLflow's table format (pandas' "split" JSON), listed in the run's
                ``mlflow.loggedArtifacts`` tag (the UI's Evaluation view). Written whole each time, not appended
                to as MLflow's log_table does: that download, join and upload is not idempotent, so a journal line
                sent again after a failure past the upload appended its rows twice
system metrics  MLflow's SystemMetricsMonitor (CPU, memory, disk, network; GPU with nvidia-ml-py on a GPU worker)
                on the run, sampled every max(1, min(15, elapsed / 30)) seconds: about 30 samples over the
                first minutes of any stage, and a last sample when the stage ends, so even a short stage has one.
                Sampled by our own loop and logged through the run's journal: MLflow's loop asks the server for
                the run before every sample and stops for good when that fails, so a tracking outage longer than
                the client's patience ended a stage's system metrics; here an outage pauses nothing (the samples
                wait in the journal with the rest)
"""

from __future__ import annotations

import contextlib
import json
import logging
import posixpath
import time
from collections.abc import Iterator
from typing import Any

from mlflow.tracking import MlflowClient

log = logging.getLogger(__name__)


def log_model_output(
    client: MlflowClient, run_id: str, name: str, path: str, params: dict[str, Any], step: int = 0
) -> str:
    """A READY LoggedModel ``name`` of the run's experiment, produced by ``run_id`` (its output at ``step``).

    Several requests, none idempotent on its own: a call that failed midway (its journal line is sent again) finds
    the model it created (same run, name, params and path) and does only what is left, rather than a second model."""
    from mlflow.entities import LoggedModelOutput, LoggedModelStatus

    run = client.get_run(run_id)
    exp = run.info.experiment_id
    params = {k: str(v)[:6000] for k, v in params.items() if v is not None}
    created = client.search_logged_models([exp], filter_string=f"source_run_id = '{run_id}'")
    model = next(
        (m for m in created if m.name == name and m.params == params and m.tags.get("workspace_path") == path), None
    )
    if model is None:
        model = client.create_logged_model(
            exp,
            name=name,
            source_run_id=run_id,
            params=params,
            tags={"workspace_path": path},
            model_type="transformers",
        )
    if model.status != LoggedModelStatus.READY:
        client.finalize_logged_model(model.model_id, "READY")
    linked = run.outputs.model_outputs if run.outputs is not None else []
    if not any(o.model_id == model.model_id and o.step == step for o in linked):
        client.log_outputs(run_id, [LoggedModelOutput(model.model_id, step)])
    return model.model_id


def joined_table(prev, data: dict[str, list]):
    """The DataFrame of ``data`` (columns) after the rows of ``prev`` (a DataFrame, or None), as MLflow's log_table
    joins a table to the one a run holds."""
    import pandas as pd

    try:
        frame = pd.DataFrame(data)
    except ValueError:  # every value a scalar: one row, as MLflow reads it
        frame = pd.DataFrame([data])
    return frame if prev is None else pd.concat([prev, frame], ignore_index=True)


def log_table_file(client: MlflowClient, run_id: str, path: str, artifact_file: str) -> None:
    """The whole table in file ``path`` (named as ``artifact_file``'s last part) written over the run's artifact
    ``artifact_file``, which the run lists among its tables. Each request is idempotent (an upload over the same
    name, a tag set only when the entry is missing), so a call sent again after a failure midway leaves each row
    once."""
    from mlflow.utils.mlflow_tags import MLFLOW_LOGGED_ARTIFACTS

    folder = posixpath.dirname(posixpath.normpath(artifact_file))
    client.log_artifact(run_id, path, folder or None)
    listed = json.loads(client.get_run(run_id).data.tags.get(MLFLOW_LOGGED_ARTIFACTS, "[]"))
    entry = {"path": artifact_file, "type": "table"}
    if entry not in listed:
        client.set_tag(run_id, MLFLOW_LOGGED_ARTIFACTS, json.dumps([*listed, entry]))


def adaptive_interval(elapsed: float) -> float:
    """Seconds to the next system-metrics sample: max(1, min(15, elapsed / 30))."""
    return max(1.0, min(15.0, elapsed / 30.0))


def _monitor_class():
    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

    class AdaptiveMonitor(SystemMetricsMonitor):
        """SystemMetricsMonitor whose sampling interval grows with the run's age (:func:`adaptive_interval`)."""

        _t0 = time.monotonic()

        @property
        def sampling_interval(self) -> float:
            return adaptive_interval(time.monotonic() - self._t0)

        @sampling_interval.setter
        def sampling_interval(self, value) -> None:  # the base class sets its fixed interval: ignored
            self._t0 = time.monotonic()

        def monitor(self) -> None:
            """Sample, aggregate and log until :meth:`finish`, with no call to the tracking server. (The base
            class's loop calls ``MlflowClient.get_run`` after every sample to see whether the run is still RUNNING
            and returns for good on the first exception: a server down longer than the client's HTTP retries
            ended the stage's system metrics, and a shorter outage paused them. The stage ends the monitor itself.)
            """
            warned = False
            while not self._shutdown_event.is_set():
                for _ in range(self.samples_before_logging):
                    self.collect_metrics()
                    if self._shutdown_event.wait(self.sampling_interval):
                        return  # system_metrics() takes the last sample after finish()
                try:
                    self.publish_metrics(self.aggregate_metrics())
                except Exception as e:  # a journal write that failed (a full disk): keep sampling, say it once
                    if not warned:
                        log.warning("system metrics of run %s not logged: %s", self._run_id, e)
                        warned = True

    return AdaptiveMonitor


class _ToLogger:
    """What SystemMetricsMonitor calls on its ``mlflow_logger``, handed to a RunLogger (its journal and sender):
    a tracking outage neither blocks the monitor nor loses its samples."""

    total_training_time = total_log_batch_time = 0.0
    data: list = []

    def __init__(self, tracker):
        self.tracker = tracker

    def record_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.tracker.log_metrics(metrics, step=step)

    def flush(self) -> None:
        pass


def next_system_step(skip: dict[str, int]) -> int:
    """The first system-metrics step of a (reopened) run: 1 + the last step of its ``system/`` metrics, 0 when it
    holds none. ``skip`` is what the run held when the stage reopened it (RunLogger.skip): no request here, where
    MLflow's ``resume_logging`` would ask the server (with minutes of retries on the training thread)."""
    steps = [step for key, step in skip.items() if key.startswith("system/")]
    return max(steps) + 1 if steps else 0


@contextlib.contextmanager
def system_metrics(tracker) -> Iterator[None]:
    """System metrics on ``tracker``'s run (a RunLogger) while the block runs, logged through the logger; stopped
    (with a last sample) before it returns, so before the run ends. Nothing for None or a disabled logger. A
    reopened run continues the steps it holds (:func:`next_system_step`)."""
    if tracker is None or not tracker:
        yield
        return
    monitor = None
    try:
        monitor = _monitor_class()(tracker.run_id, samples_before_logging=1, tracking_uri=tracker.client.tracking_uri)
        monitor.mlflow_logger = _ToLogger(tracker)
        monitor._logging_step = next_system_step(tracker.skip)
        monitor.start()
    except Exception as e:  # system metrics are a nicety: never fail a stage over them
        log.warning("system metrics off for run %s: %s", tracker.run_id, e)
        monitor = None
    try:
        yield
    finally:
        if monitor is not None:
            try:
                monitor.finish()
                monitor.collect_metrics()
                monitor.publish_metrics(monitor.aggregate_metrics())  # the stage's last state
            except Exception as e:
                log.warning("system metrics of run %s: %s", tracker.run_id, e)
