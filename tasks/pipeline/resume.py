"""Resuming a pipeline run: what reruns and why, and the one MLflow parent run of a workspace.

A stage is complete when its manifest holds its current key (tasks/pipeline/fingerprint.py: config sections,
upstream keys, and the content of the data files, local model folder and reward modules it reads). The manifest
records the fingerprint the key was made from, so :func:`explain` can say, for each stage that reruns, what
changed: config values (old -> new), a file (size or hash), a reward module's code, an upstream stage that
reruns, or that there is no complete earlier attempt.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from typing import Any

import yaml

from grpoflow.tasks.config import PipelineConfig
from grpoflow.tasks.config.secrets import redact
from grpoflow.tasks.pipeline.fingerprint import continue_key, extents, fingerprints, key_of
from grpoflow.tasks.pipeline.legacy import legacy_continue_keys, legacy_fingerprints, legacy_keys
from grpoflow.tasks.pipeline.run_folder import RUN_FILE, WARM_START_FILE
from grpoflow.tasks.pipeline.spec import Pipeline
from grpoflow.tasks.storage.workspace import Workspace
from grpoflow.tasks.tracking.tracker import RunLogger, flatten, logger_for, start_pipeline_run, tracking_uri

log = logging.getLogger(__name__)
LEGACY_CHANGE = (
    "recorded by size + mtime_ns (grpoflow before files over 64 MiB were hashed); its mtime changed since, so its "
    "content may have"
)


def _short(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


def _digest(value: Any) -> str:
    """A size or time as it is, a hash (sha256, ETag) by its first 12 characters: enough to tell two apart."""
    return value[:12] if isinstance(value, str) and len(value) > 12 else str(value)


def _file_changes(label: str, old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """What differs between two {file: digest} maps of one content label."""
    code = label.startswith("reward ")
    out = []
    for name in sorted(set(old) | set(new)):
        a, b = old.get(name), new.get(name)
        if a == b:
            continue
        if code:
            what = "changed" if a is not None and b is not None else "added" if a is None else "removed"
            out.append(f"code: {label.removeprefix('reward ')} (reward module, {name}) {what}")
        elif a is None or b is None:
            out.append(f"file: {label} {name} {'added' if a is None else 'removed'}")
        elif "mtime_ns" in a and "sha256" in b and a.get("size") == b.get("size"):
            out.append(f"file: {label} {name}: {LEGACY_CHANGE}")
        else:
            what = [k for k in ("size", "sha256", "mtime_ns", "etag") if a.get(k) != b.get(k)]
            detail = ", ".join(f"{k} {_digest(a.get(k))} -> {_digest(b.get(k))}" for k in what)
            out.append(f"file: {label} {name} changed ({detail})")
    return out


def changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """What differs between a stage's recorded fingerprint and its current one, one line per change; the
    upstream stages last, and only when nothing of the stage's own changed."""
    out = []
    old_cfg, new_cfg = flatten(old.get("config", {})), flatten(new.get("config", {}))
    for k in sorted(set(old_cfg) | set(new_cfg)):
        if old_cfg.get(k) != new_cfg.get(k):
            out.append(f"config: {k} {_short(old_cfg.get(k))} -> {_short(new_cfg.get(k))}")
    old_c, new_c = old.get("content", {}), new.get("content", {})
    for label in sorted(set(old_c) | set(new_c)):
        out += _file_changes(label, old_c.get(label) or {}, new_c.get(label) or {})
    if not out:
        up_old, up_new = old.get("upstream", {}), new.get("upstream", {})
        out = [f"upstream {s} reruns" for s in up_new if s in up_old and up_old[s] != up_new[s]]
        out += [f"upstream is now {s}" for s in up_new if s not in up_old]
        out += [f"upstream {s} no longer feeds it" for s in up_old if s not in up_new]
    return out or ["its key changed (the fingerprint format differs)"]


def explain(pipeline: Pipeline, cfg: PipelineConfig, ws: Workspace, forget: tuple[str, ...] = ()) -> dict[str, list]:
    """{stage: why it reruns} for each stage of ``pipeline`` that a run of ``cfg`` in ``ws`` does not skip, in run
    order; stages in ``forget`` (``--from-stage``) rerun whatever they hold."""
    fps = fingerprints(pipeline, cfg)
    # keys older grpoflow recorded, still good (tasks/pipeline/legacy.py): computed only if a recorded key differs
    old = functools.cache(lambda: legacy_fingerprints(pipeline, cfg, fps))
    out: dict[str, list[str]] = {}
    rerun: dict[str, None] = {}
    for spec in pipeline.specs:
        name, fp = spec.name, fps[spec.name]
        if not spec.enabled(cfg):
            continue
        manifest = None if name in forget else ws.read_manifest(name)
        if name in forget:
            out[name] = ["--from-stage"]
        elif manifest is None or "summary" not in manifest:
            out[name] = ["no complete earlier attempt"]
        elif (held := manifest.get("key")) is not None and (
            held == key_of(fp) or held in legacy_keys(old(), name)  # the old ones computed only if needed
        ):
            if not rerun:
                continue
            out[name] = [f"earlier stage {next(iter(rerun))} reruns (the stages after it rerun too)"]
        else:
            recorded = (manifest.get("fingerprint") or {}) if isinstance(manifest, dict) else {}
            out[name] = changes(recorded, fp) if recorded else ["key changed (its manifest records no fingerprint)"]
        rerun[name] = None
    return out


def replaced(pipeline: Pipeline, cfg: PipelineConfig, ws: Workspace, stages) -> dict[str, str]:
    """{stage: what its rerun does to its finished results} for each of ``stages`` (the ones that rerun) that has
    finished results in ``ws``: replaces them, or trains on from them (a raised ``extends`` value: grpo.max_steps)."""
    fps = fingerprints(pipeline, cfg)
    old = functools.cache(lambda: legacy_fingerprints(pipeline, cfg, fps))
    out = {}
    for name in stages:
        manifest = ws.read_manifest(name)
        if manifest is None:
            continue
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(manifest.get("finished_at", 0)))
        spec = pipeline[name]
        key = continue_key(fps[name], spec.extends) if spec.extends else None
        continues = key is not None and ws.continues(name, key, extents(spec, cfg))
        if key is not None and not continues:  # the continue key an older grpoflow recorded, only then computed
            olds = legacy_continue_keys(pipeline, old(), name)
            continues = any(ws.continues(name, k, extents(spec, cfg)) for k in olds)
        if continues:
            out[name] = f"continues from its finished attempt of {when} (its checkpoints are kept)"
        else:
            out[name] = f"replaces its finished results of {when}"
    return out


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
    if redact(prev.get("tracking_uri") or "") == redact(uri) and prev.get("mlflow_run_id"):
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
    ws.write_text(RUN_FILE, json.dumps({"mlflow_run_id": parent.run_id, "tracking_uri": redact(uri)}, indent=2))
    return parent


def replay_journal(cfg: PipelineConfig, root, uri: str) -> dict[str, int]:
    """Send what the journals in <root>/tracking-journal hold unsent; {journal: records still unsent}. A journal
    written for another store than ``uri`` is left as it is (`grpoflow sync --force-store` sends it anyway)."""
    from grpoflow.tasks.tracking.journal import JOURNAL_DIR
    from grpoflow.tasks.tracking.sender import replay

    done = replay(root / JOURNAL_DIR, uri, cfg.tracking.flush_timeout_s, cfg.tracking.request_timeout_s)
    left = {name: r.left for name, r in done.items()}
    for r in done.values():
        if r.deleted:  # a deleted run or experiment, not an outage: say which, and how to restore or drop
            log.warning("tracking journal: %s", r.deleted)
    if n := sum(r.left for r in done.values() if not r.other_store and not r.deleted):
        errors = sorted({r.error for r in done.values() if r.error and not r.deleted})
        log.warning(
            "tracking journal: %d records still unsent to %s (%s)", n, redact(uri), "; ".join(errors) or "no answer"
        )
    return left


def warm_start_version(ws: Workspace, cfg: PipelineConfig, init_version: str | None) -> str | None:
    """The registry version of the model GRPO warm-starts from (model.warm_start), which registration compares
    the new model with, paired on the held-out rows: ``init_version`` when given (the continuous flow's champion;
    recorded in the workspace's warm_start.json), else the version recorded there for this same folder, so a
    hand `grpoflow resume` of a cycle's workspace registers as the cycle would have; None without a warm start."""
    if cfg.model.warm_start is None:
        return None
    if init_version is not None:
        ws.write_text(WARM_START_FILE, json.dumps({"warm_start": cfg.model.warm_start, "version": str(init_version)}))
        return str(init_version)
    try:
        recorded = json.loads(ws.read_text(WARM_START_FILE) or "{}")
    except ValueError:
        return None
    return recorded.get("version") if recorded.get("warm_start") == cfg.model.warm_start else None
