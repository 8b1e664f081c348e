"""The one shell every Prefect stage task uses: the typed run config + workspace URI in, summary dict out.

Stages are plain functions ``fn(cfg, ws, tracker, **inputs) -> dict`` that know nothing of
Prefect; this wraps one in its nested MLflow run (named, tagged, with its settings as params and its datasets as
inputs: tasks/tracking/run_info.py), samples system metrics around the training stages, and logs the summary it
returns (results, description, the trained model as a logged model output).

Resume: a stage whose manifest holds the stage's current key (tasks/pipeline/fingerprint.py) is complete: its
stored summary is returned and nothing runs or is logged. Otherwise its manifest and every later
stage's are removed, its folder is emptied when its last attempt had another key (a same-key attempt
that was killed keeps its files: GRPO continues from its newest checkpoint), the stage runs and returns its
summary, and this shell publishes the stage: its manifest, written once, holds the key, the fingerprint it was
made from (what `grpoflow resume` compares to say what changed) and the summary (stage bodies write no
manifest). On an S3 workspace the upstream stages' files are pulled into the local mirror first
(tasks/storage/workspace.py), so a resume on an empty cache works. What a stage is (its name, key sections,
upstream, MLflow naming) comes from its StageSpec (tasks/pipeline/spec.py); this shell names no stage.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from grpoflow.tasks.config import PipelineConfig
from grpoflow.tasks.dataio.sources import split_origins
from grpoflow.tasks.dataio.splits import split_path
from grpoflow.tasks.pipeline.errors import StageError
from grpoflow.tasks.pipeline.fingerprint import continue_key, extents, fingerprints, key_of
from grpoflow.tasks.pipeline.legacy import adopt_legacy_keys
from grpoflow.tasks.pipeline.spec import Pipeline, StageSpec
from grpoflow.tasks.storage.workspace import Workspace
from grpoflow.tasks.tracking.entities import system_metrics
from grpoflow.tasks.tracking.run_info import finish_run, prepare_run
from grpoflow.tasks.tracking.tracker import stage_run

StageFn = Callable[..., dict[str, Any]]
log = logging.getLogger(__name__)

# What a user's input or environment causes (bad data, a misbehaving reward, a missing file, S3, GPU memory):
# reported as one line naming the stage. Anything else is a bug of ours and keeps its traceback.
USER_ERRORS = (ValueError, OSError, torch.OutOfMemoryError)


def write_error_log(ws: Workspace, stage: str, exc: BaseException) -> Path:
    """The full traceback of a failed stage, in <workspace>/logs/<stage>.error.log (the local mirror for S3)."""
    path = ws.root / "logs" / f"{stage}.error.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(traceback.format_exception(exc)))
    return path


def publish(ws: Workspace, spec: StageSpec, key: str, summary: dict[str, Any], record: dict[str, Any]) -> None:
    """Write the stage's manifest (its key, its summary and ``record``: its fingerprint), once; its files go up
    first, with the folders it writes that are keyed by their own spec (the tiny base model), on S3 retried through
    an outage within storage.outage_budget_s (a GRPO stage's final model is large); the manifest last."""
    also = tuple(w.name for w in spec.writes)
    ws.store.guarded(lambda: ws.publish(spec.name, key, summary, also=also, record=record), f"publishing {spec.name}")


def run_stage(
    pipeline: Pipeline,
    spec: StageSpec,
    fn: StageFn,
    cfg: PipelineConfig,
    workspace_root: str,
    parent_run_id: str | None,
    **inputs: Any,
) -> dict[str, Any]:
    """Run stage ``spec`` of ``pipeline`` (its ordered stages) through ``fn``, or return its stored summary when
    it is complete with its current key."""
    name = spec.name
    ws = Workspace(workspace_root, cfg.storage)
    fps = fingerprints(pipeline, cfg)
    adopt_legacy_keys(pipeline, cfg, ws, (name, *(w.name for w in spec.writes)), fps)  # keys of older grpoflow
    keys = {k: key_of(fp) for k, fp in fps.items()}
    key = keys[name]
    stored = ws.completed(name, key)
    if stored is not None:
        log.info("stage %s: complete (key %s), skipped", name, key[:12])
        return stored
    finished = ws.read_manifest(name)
    ws.forget(pipeline.stages_from(name))
    if upstream := pipeline.before(name):
        # S3: the upstream files this stage reads, when not local yet (the loose folders have no manifest)
        ws.fetch(upstream, loose=tuple(s.name for s in pipeline.loose))
    outcome = ws.begin(name, key, continue_key(fps[name], spec.extends) if spec.extends else None, extents(spec, cfg))
    if finished is not None or outcome is not None:  # reruns say what they replace
        what = "its finished results" if finished is not None else "the files of its unfinished attempt"
        how = {"continued": "continuing from its checkpoints", "removed": "its folder emptied"}.get(outcome, "")
        log.warning("stage %s: replacing %s (key %s -> %s)%s", name, what, str((finished or {}).get("key", "?"))[:12],
                    key[:12], f"; {how}" if how else "")  # fmt: skip
    for folder in spec.writes:  # a folder this stage may write, keyed by its own spec (the tiny base model)
        ws.begin(folder.name, keys[folder.name])
    log.info("stage %s: running (key %s)", name, key[:12])
    if cfg.run.torch_threads:
        torch.set_num_threads(cfg.run.torch_threads)
    try:
        with stage_run(cfg, parent_run_id, spec, ws.root, key, ws) as tracker:
            split_dirs = {}
            if folder := pipeline.splits_folder(name):  # a stage after the one preparing the splits reads them
                split_dirs = {s: split_path(ws.root / folder, s) for s in ("train", *spec.splits)}
            prepare_run(tracker, cfg, spec, split_dirs, split_origins(cfg.data) if split_dirs else None)
            with system_metrics(tracker if spec.trains else None):
                summary = fn(cfg, ws, tracker, **inputs)
            finish_run(tracker, cfg, ws, spec, summary)
            summary["mlflow_run_id"] = tracker.run_id
            publish(ws, spec, key, summary, record={"fingerprint": fps[name]})
            return summary
    except USER_ERRORS as e:
        path = write_error_log(ws, name, e)
        cause = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
        raise StageError(name, cause, str(path), ws.location) from e
    except Exception as e:  # a bug of ours: its traceback is shown, and kept beside the stage's files too
        write_error_log(ws, name, e)
        raise
