"""Resuming a pipeline run: stage keys, and the one MLflow parent run of a workspace.

A stage's key is a sha256 over everything its result depends on (config sections and upstream keys):

    key(stage) = sha256(json({"stage": stage, "config": {path: value for path in DEPENDS[stage]},
                              "upstream": key(upstream(stage))}, sort_keys=True))

    data        run.seed, data, model.name              (not the tokenizer: the data stage does not tokenize)
    sft         data key;  run.seed, model, sft
    grpo        sft key (the data key when sft is disabled);  run.seed, model, grpo, generation, and
                the distributed keys that change the result (nproc_per_node, nnodes: the world size sets TRL's
                generation batch; strategy; seed_by_row), each only where it differs from its default
    eval        grpo key;  eval
    export      grpo key;  export, eval.max_new_tokens  (the length of the verification decode)
    base_model  data key;  run.seed, model.name, model.revision, model.tiny  (the tiny model built from the data)

Left out, since they do not change a result: run.name, run.output_dir, run.torch_threads, tracking.*,
storage.*, sft.logging_steps, grpo.{save_steps, logging_steps, log_completions, resume, reward_timeout_s},
generation.{torch_threads, batch_size}, distributed.{backend, timeout_s, node_rank, rdzv_endpoint, master_addr,
master_port, launcher, trainjob} (where the processes run, not what they compute). A section in SPARSE
contributes only its keys that differ from their defaults, so a run on one process keeps the key it had before
the section existed. A key hashes the config only: not the content of a local or S3 data.source file, nor the
code version. A changed key changes every downstream key.
"""

from __future__ import annotations

import hashlib
import json
import logging
from typing import Any

import yaml

from grpoflow.tasks.config import PipelineConfig
from grpoflow.tasks.config.distributed import DistributedConfig
from grpoflow.tasks.storage.workspace import STAGES, Workspace
from grpoflow.tasks.tracking.tracker import RunLogger, flatten, logger_for, start_pipeline_run, tracking_uri

log = logging.getLogger(__name__)

DEPENDS: dict[str, tuple[str, ...]] = {
    "data": ("run.seed", "data", "model.name"),
    "sft": ("run.seed", "model", "sft"),
    "grpo": ("run.seed", "model", "grpo", "generation", "distributed"),
    "eval": ("eval",),
    "export": ("export", "eval.max_new_tokens"),
    "base_model": ("run.seed", "model.name", "model.revision", "model.tiny"),
}
IGNORED = frozenset(
    {
        "sft.logging_steps",
        "grpo.save_steps",
        "grpo.logging_steps",
        "grpo.log_completions",
        "grpo.resume",
        "grpo.reward_timeout_s",
        "generation.torch_threads",
        "generation.batch_size",
        "model.cache_dir",
        "distributed.backend",
        "distributed.timeout_s",
        "distributed.node_rank",
        "distributed.rdzv_endpoint",
        "distributed.master_addr",
        "distributed.master_port",
        "distributed.launcher",
        "distributed.trainjob",
    }
)
SPARSE = {"distributed": DistributedConfig}
RUN_FILE = "run.json"


def upstream(stage: str, cfg: dict[str, Any]) -> str | None:
    if stage == "data":
        return None
    if stage in ("sft", "base_model"):
        return "data"
    if stage == "grpo":
        return "sft" if cfg["sft"]["enabled"] else "data"
    return "grpo"


def config_part(stage: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """The config values ``stage`` depends on, by dotted path (IGNORED keys removed; a SPARSE section's keys only
    where they differ from the default, and the section left out when none does)."""
    part = {}
    for path in DEPENDS[stage]:
        value: Any = cfg
        for name in path.split("."):
            value = value.get(name) if isinstance(value, dict) else None
        if isinstance(value, dict):
            value = {k: v for k, v in value.items() if f"{path}.{k}" not in IGNORED}
        if path in SPARSE:
            default = SPARSE[path]().model_dump(mode="json")
            value = {k: v for k, v in (value or {}).items() if v != default.get(k)}
            if not value:
                continue
        part[path] = value
    return part


def stage_key(stage: str, cfg: dict[str, Any], upstream_key: str | None) -> str:
    body = {"stage": stage, "config": config_part(stage, cfg), "upstream": upstream_key}
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()


def stage_keys(cfg: dict[str, Any]) -> dict[str, str]:
    """The key of every stage (and of the tiny base model) of a resolved config dict (cfg.to_dict())."""
    keys: dict[str, str] = {}
    for stage in (*STAGES, "base_model"):
        up = upstream(stage, cfg)
        keys[stage] = stage_key(stage, cfg, keys[up] if up else None)
    return keys


def open_pipeline_run(cfg: PipelineConfig, ws: Workspace, tags: dict[str, Any]) -> RunLogger:
    """The parent MLflow run of the workspace: the one <ws>/run.json names, reopened, or a new one.

    First, what an earlier process left in the workspace's tracking journal is sent (tasks/tracking/sender.py
    ``replay``, within tracking.flush_timeout_s). On reopening, stage runs left RUNNING by a killed attempt are
    ended as KILLED (the stage shell sets its own run RUNNING again when it reruns); config values that
    differ from the logged params (MLflow params cannot change) are tagged ``config_changed.<key>``."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    uri = tracking_uri(cfg)
    replay_journal(cfg, ws.root, uri)
    prev = json.loads(ws.read_text(RUN_FILE) or "{}")
    if prev.get("tracking_uri") == uri and prev.get("mlflow_run_id"):
        client = MlflowClient(uri)
        try:
            run = client.get_run(prev["mlflow_run_id"])
        except MlflowException:
            run = None
        if run is not None and run.info.lifecycle_stage == "active":
            rid = run.info.run_id
            client.update_run(rid, status="RUNNING")
            running = f"tags.mlflow.parentRunId = '{rid}' and attributes.status = 'RUNNING'"
            for child in client.search_runs([run.info.experiment_id], running):
                client.set_terminated(child.info.run_id, "KILLED")
            parent = logger_for(cfg, client, rid, ws.root)
            parent.reopened_params(run.data.params)
            flat = {k: str(v)[:6000] for k, v in flatten(cfg.to_dict()).items()}
            params = run.data.params
            parent.log_params({k: v for k, v in flat.items() if k not in params})
            resumes = int(run.data.tags.get("grpoflow.resumes", "0")) + 1
            changed = {f"config_changed.{k}": v for k, v in flat.items() if k in params and params[k] != v}
            parent.set_tags({**tags, **changed, "grpoflow.resumes": resumes})
            parent.log_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False), "config.yaml")
            log.info("continuing MLflow run %s (resume %d)", rid, resumes)
            return parent
    parent = start_pipeline_run(cfg, tags, ws.root)
    ws.write_text(RUN_FILE, json.dumps({"mlflow_run_id": parent.run_id, "tracking_uri": uri}, indent=2))
    return parent


def replay_journal(cfg: PipelineConfig, root, uri: str) -> dict[str, int]:
    """Send what the journals in <root>/tracking-journal hold unsent; {journal: records still unsent}."""
    from grpoflow.tasks.tracking.journal import JOURNAL_DIR
    from grpoflow.tasks.tracking.sender import replay

    left = replay(root / JOURNAL_DIR, uri, cfg.tracking.flush_timeout_s, cfg.tracking.request_timeout_s)
    if any(left.values()):
        log.warning("tracking journal: %d records still unsent to %s (it does not answer)", sum(left.values()), uri)
    return left
