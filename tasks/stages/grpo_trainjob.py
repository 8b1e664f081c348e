"""The GRPO stage on the nodes of a Kubeflow Trainer TrainJob (``distributed.launcher: trainjob``).

The stage (the Prefect task ``grpo``, in its flow-run pod) writes the launch spec to the S3 workspace, creates a
TrainJob (tasks/launch/trainjob.py) whose every node runs the torchrun command of a local launch
(tasks/launch/torchrun.py ``torchrun_command``, with the spec's S3 URI and the image's python), waits for its
Complete or Failed condition, then pulls the GRPO folder that node 0's rank 0 pushed and reads its summary. A
failure raises what a local launch raises for the rank that failed first (its error record, on S3 beside the
spec), followed by the TrainJob's reason and message and the failed pods' last log lines; past
``trainjob.timeout_s``, or when the stage is cancelled, the TrainJob is deleted (its pods with it).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from grpoflow.tasks.config import PipelineConfig
from grpoflow.tasks.launch.torchrun import failure, rank_errors, torchrun_command
from grpoflow.tasks.launch.trainjob import (
    KEY,
    JobState,
    KubeTrainJobs,
    failure_message,
    load_template,
    render,
    tracking_env_problem,
    trainjob_name,
    wait,
)
from grpoflow.tasks.stages.grpo_launch import WORKER, launch_spec
from grpoflow.tasks.storage.s3 import is_s3_uri
from grpoflow.tasks.storage.workspace import Workspace, join_location
from grpoflow.tasks.tracking.tracker import RunLogger

log = logging.getLogger(__name__)


def trainjob_command(cfg: PipelineConfig, spec_uri: str) -> list[str]:
    """What each node of the TrainJob runs: the local launch's torchrun command, with the image's python."""
    return torchrun_command(cfg.distributed, WORKER, [spec_uri], python=cfg.distributed.trainjob.python)


def trainjob_error(namespace: str, name: str, state: JobState, errors: list[dict], logs: dict, world: int):
    """The exception of a failed TrainJob: the first failing rank's error as a local launch raises it (ValueError
    for the user's input, RuntimeError for a bug), else ChildProcessError; with the TrainJob's reason, message
    and pod logs after it."""
    text = failure_message(namespace, name, state, logs)
    if errors and not errors[0]["lost_peer"]:
        first = failure(1, errors, [], world)
        exc = type(first)(f"{first}\n{text}")
        exc.__cause__ = first.__cause__
        return exc
    reported = "; ".join(f"rank {e['rank']}: {e['type']}: {e['message']}" for e in errors)
    return ChildProcessError(text + (f"\nranks reported: {reported}" if reported else ""))


def prepare_trainjob(cfg: PipelineConfig, ws: Workspace, tracker: RunLogger, init_model: str | None) -> dict:
    """Everything before the Kubernetes API: the spec on S3 (with the launcher's mirror root, for the nodes to
    re-root its paths), the last attempt's launch files removed there, and the TrainJob to create."""
    d, t = cfg.distributed, cfg.distributed.trainjob
    if not is_s3_uri(ws.location):  # the config check covers run.output_dir; this covers a workspace given another way
        raise ValueError("distributed.launcher=trainjob needs an s3:// workspace (run.output_dir)")
    template = load_template(t.template)
    folder = ws.stage_dir("grpo") / "launch"
    spec = launch_spec(cfg, ws, tracker, init_model, folder)
    if spec["run_id"] and not str(spec["tracking_uri"]).startswith(("http://", "https://")):
        raise ValueError(
            f"distributed.launcher=trainjob: the TrainJob's pods log to MLflow through a server; the tracking URI "
            f"is {spec['tracking_uri']!r} (set tracking.uri or MLFLOW_TRACKING_URI to http://...)"
        )
    if spec["run_id"] and (problem := tracking_env_problem(template, str(spec["tracking_uri"]))):
        raise ValueError(f"{KEY}: {t.template!r}: {problem}")
    start = Path(spec["init_model"])
    if start.exists() and not start.resolve().is_relative_to(ws.root):
        raise ValueError(
            f"distributed.launcher=trainjob: the starting model {str(start)!r} is outside the workspace, where the "
            f"TrainJob's nodes cannot read it (a registry champion is not supported with this launcher yet)"
        )
    if (ws.root / "base_model").is_dir():
        ws.push("base_model")  # the tiny model the launcher may just have built, for the nodes to fetch
    ws.push("grpo", "launch")  # empties the last attempt's spec, errors and summary on S3
    ws.store.write("grpo/launch/spec.json", json.dumps({**spec, "root": str(ws.root)}).encode())
    spec_uri = join_location(ws.location, "grpo/launch/spec.json")
    name = trainjob_name(cfg.run.name or "run", time.time())
    tracker.set_tags({"distributed.launcher": "trainjob", "trainjob.name": f"{t.namespace}/{name}"})
    return render(template, d, name, trainjob_command(cfg, spec_uri))


def collect_summary(ws: Workspace) -> dict:
    """After a complete TrainJob: the GRPO folder node 0 pushed (final model, history, checkpoints), pulled into
    this mirror, and the summary rank 0 wrote."""
    ws.pull("grpo")
    return json.loads((ws.stage_dir("grpo") / "launch" / "summary.json").read_text())


JOB_RECORD = "grpo/trainjob.json"  # the TrainJob of the stage's latest attempt (outside launch/, which it empties)


def stop_earlier_trainjob(kube, ws: Workspace) -> str | None:
    """Delete the TrainJob the stage's last attempt created when it still exists: its launcher was killed or
    evicted before it could (the lease then expires and a resume launches again), and its pods would go on
    writing checkpoints into the workspace beside the new job's. Returns its name, None when there was none."""
    raw = ws.store.read(JOB_RECORD)
    if raw is None:
        return None
    name = json.loads(raw)["name"]
    try:
        kube.read(name)
    except Exception as e:  # gone (404), or the API cannot say: nothing to delete
        log.info("TrainJob %s of an earlier attempt: not found (%s)", name, str(e).splitlines()[0][:200])
        return None
    log.warning("TrainJob %s of an earlier attempt still exists: deleting it (and its pods) first", name)
    kube.delete(name)
    return name


def launch_trainjob(cfg: PipelineConfig, ws: Workspace, tracker: RunLogger, init_model: str | None) -> dict:
    """Run :func:`train_grpo` on the nodes of a TrainJob; rank 0 logs into ``tracker``'s run. Returns its summary."""
    d, t = cfg.distributed, cfg.distributed.trainjob
    kube = KubeTrainJobs(t.namespace)
    stop_earlier_trainjob(kube, ws)
    job = prepare_trainjob(cfg, ws, tracker, init_model)
    name = job["metadata"]["name"]
    ws.store.write(JOB_RECORD, json.dumps({"namespace": t.namespace, "name": name}).encode())
    kube.create(job)
    log.info("TrainJob %s/%s: %d node(s) x %d process(es)", t.namespace, name, d.nnodes, d.nproc_per_node)
    try:
        state = wait(lambda: kube.read(name), t.timeout_s, t.poll_s)
    except BaseException:  # a timeout, a cancelled stage, Ctrl-C: no pods left behind
        try:
            kube.delete(name)
        except Exception as e:  # the API unreachable: say so, and raise what stopped the wait
            log.error("TrainJob %s/%s could not be deleted (delete it by hand): %s", t.namespace, name, e)
        raise
    if state.phase == "failed":
        ws.pull("grpo", "launch")
        logs = kube.failed_pod_logs(name, t.log_lines)
        errors = rank_errors(ws.stage_dir("grpo") / "launch")
        raise trainjob_error(t.namespace, name, state, errors, logs, d.world_size)
    summary = collect_summary(ws)
    if t.delete_on_success:
        kube.delete(name)
    return summary
