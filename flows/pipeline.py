"""The pipeline DAG as a Prefect flow:

    prepare data -> (optional) SFT -> GRPO -> evaluate -> export

Each stage is a Prefect task (tasks/*) that takes the validated config (a :class:`PipelineConfig`, as the
CLI parsed it: Prefect passes pydantic models as they are) and the run workspace (a folder or an s3:// URI),
and returns a small summary with the URIs of what it wrote; the flow passes those URIs on. MLflow: the flow
opens the parent run (tagged with the Prefect flow-run id), each stage task a nested run under it.

Resume: running the flow again on the same workspace skips every stage whose manifest holds its
current key (tasks/pipeline/shell.py) and continues the parent run named in <workspace>/run.json
(tasks/pipeline/resume.py) instead of opening another one.
"""

from __future__ import annotations

import logging
import time

import yaml
from prefect import flow, runtime

from grpoflow.flows.stages import PIPELINE
from grpoflow.tasks.config import ConfigError, PipelineConfig
from grpoflow.tasks.model.sources import model_folder_problem
from grpoflow.tasks.pipeline.resume import open_pipeline_run, warm_start_version
from grpoflow.tasks.pipeline.revision import pin_revision
from grpoflow.tasks.pipeline.run_folder import WOULD_EMPTY, foreign_config
from grpoflow.tasks.stages.data import data_task
from grpoflow.tasks.stages.evaluate import eval_task
from grpoflow.tasks.stages.export import export_task
from grpoflow.tasks.stages.grpo import grpo_task
from grpoflow.tasks.stages.sft import sft_task
from grpoflow.tasks.storage.lock import workspace_lock
from grpoflow.tasks.storage.workspace import Workspace
from grpoflow.tasks.tracking import timeline
from grpoflow.tasks.tracking.deleted import registration_skipped
from grpoflow.tasks.tracking.registry import register_pipeline_model
from grpoflow.tasks.tracking.run_meta import describe_pipeline
from grpoflow.tasks.tracking.tracker import NOTE, end_run, run_url, unsent

log = logging.getLogger(__name__)


def _timed(name: str, task, *args, **kwargs):
    """Run a stage task between its timeline marks (tasks/tracking/timeline.py: stage/<name>_s)."""
    timeline.mark(f"stage_start/{name}")
    out = task(*args, **kwargs)
    timeline.mark(f"stage_end/{name}")
    return out


def log_timeline(parent, result: dict) -> dict[str, float]:
    """The run's time outside the training loops so far, as metrics on the parent run (startup/*, stage/*,
    stage_overhead/*, run/*); a loop counts only when it ran in this process (a skipped stage's did not)."""
    m = timeline.marks()
    trains = [s.name for s in PIPELINE.specs if s.trains]
    loops = {s: result[s]["seconds"] for s in trains if result.get(s) and f"{s}/loop_start" in m}
    metrics = timeline.timeline_metrics(m, timeline.run_start(), time.time(), loops)
    parent.log_metrics(metrics)
    return metrics


@flow(name="grpo-pipeline")
def grpo_pipeline(
    config: PipelineConfig, workspace: str, init_model: str | None = None, init_version: str | None = None
) -> dict:
    """Run the DAG on ``config`` (the validated run config, passed on to every stage task as it is) in
    ``workspace``. ``model.warm_start`` (a local model folder, e.g. the registry champion the continuous flow
    warm-starts from) replaces the SFT stage: GRPO starts from it and evaluation measures it as the "before" model.
    ``init_model``: the same folder given as a flow parameter (the config then says it, so config.yaml and every
    stage key hold it and `grpoflow resume` starts from it again). ``init_version``: the registry version the
    warm start is; registration then promotes on the paired comparison of the two on the held-out rows
    (tasks/tracking/promotion.py)."""
    timeline.start_flow()
    cfg = with_warm_start(config, init_model)
    if cfg.model.warm_start is not None and (problem := model_folder_problem(cfg.model.warm_start)):
        raise ConfigError(f"model.warm_start: {problem}")  # a deployed run: before the workspace is touched
    ws = Workspace(workspace, cfg.storage)
    if foreign := foreign_config(ws.store):  # another tool's folder (the CLI refused it already; a deployed run)
        raise ConfigError(f"workspace {ws.location}: {foreign}; {WOULD_EMPTY} and overwrite it")
    with workspace_lock(ws.store, "grpo-pipeline flow"):  # the CLI holds it already; a deployed run takes it here
        return _pipeline(cfg, ws, init_version)


def with_warm_start(cfg: PipelineConfig, init_model: str | None) -> PipelineConfig:
    """``cfg`` starting GRPO from ``init_model`` (model.warm_start, SFT off); ``cfg`` itself when it is None or
    says so already. A config with another model.warm_start is refused, naming both."""
    if init_model is None or cfg.model.warm_start == init_model:
        return cfg
    if cfg.model.warm_start is not None:
        raise ConfigError(
            f"init_model={init_model}: the config's model.warm_start is {cfg.model.warm_start}; give one of them"
        )
    return cfg.warm_started(init_model)


def _pipeline(cfg: PipelineConfig, ws: Workspace, init_version: str | None) -> dict:
    init_model = cfg.model.warm_start
    cfg, pinned = pin_revision(cfg, ws.store.read("config.yaml"))  # a deployed run (the CLI pinned its own)
    if pinned:
        log.info(pinned)
    ws.write_text("config.yaml", yaml.safe_dump(cfg.to_dict(), sort_keys=False))  # what `grpoflow resume` reads
    init_version = warm_start_version(ws, cfg, init_version)  # a hand resume of a cycle: the version it recorded
    names = PIPELINE.names
    tags = {"prefect_flow_run_id": runtime.flow_run.id, "workspace": ws.location}
    parent = open_pipeline_run(cfg, ws, tags={**tags, NOTE: describe_pipeline(cfg, names, None)})
    timeline.mark("parent_run_open")
    args = (PIPELINE, cfg, ws.location, parent.run_id)
    url = run_url(parent.client, parent.run_id)  # now: the server answered the run's creation a moment ago
    ok = False
    try:
        data = _timed("data", data_task, *args)
        sft = _timed("sft", sft_task, *args) if cfg.sft.enabled else None  # never with model.warm_start
        grpo = _timed("grpo", grpo_task, *args, init_model=sft["model_path"] if sft else init_model)
        result = {"workspace": ws.location, "mlflow_run_id": parent.run_id, "data": data, "sft": sft, "grpo": grpo}
        result["mlflow_url"] = url
        if str(ws.root) != ws.location:  # S3: the mirror the stages worked in
            result["local_copy"] = str(ws.root)
        if cfg.eval.enabled:
            result["eval"] = _timed(
                "eval",
                eval_task,
                *args,
                before_model=grpo["base_model"],
                after_model=grpo["model_path"],
                after_is_adapter=grpo["adapter"],
            )
        if cfg.export.enabled:
            result["export"] = _timed(
                "export",
                export_task,
                *args,
                base_model=grpo["base_model"],
                trained_model=grpo["model_path"],
                is_adapter=grpo["adapter"],
            )
        # the calls below need the server's answers and the stages' artifacts on it (nothing left in a journal)
        flushed = parent.flush()
        answering = flushed and not unsent(ws.root)
        if "eval" in result:
            accuracy = {k: result["eval"][k] for k in ("accuracy_before", "accuracy_after")}
            logged = parent.client.get_run(parent.run_id).data.metrics if answering else {}
            if {k: logged.get(k) for k in accuracy} != accuracy:  # a skipped eval logs nothing new
                parent.log_metrics(accuracy)
        if answering:
            registered = register_pipeline_model(
                parent.client,
                cfg,
                parent.run_id,
                result.get("export"),
                result.get("eval"),
                result["data"].get("eval_path"),
                init_version if init_model is not None else None,
            )
            if registered is not None:
                result["registry"] = registered.__dict__
        elif cfg.tracking.register_model and cfg.export.enabled:  # the server does not answer, or a run is deleted
            log.warning(registration_skipped(ws.root, parent.client, flushed, cfg.tracking.request_timeout_s))
        parent.set_tags({NOTE: describe_pipeline(cfg, names, result.get("eval"))})
        result["timeline"] = log_timeline(parent, result)
        ok = True
        return result
    finally:
        end_run(parent, ok)
