"""What the stage shell (tasks/pipeline/shell.py) logs on a stage run before and after the stage itself.

Before: the settings that shaped the stage as params (run_meta.stage_params: its config section under TRL's names,
model, dataset and the train split's digest, seed, device), the prepared splits it reads as dataset inputs, and
its spec's ``before`` hook (grpo: the metrics that cannot move at these settings, not logged; a tag says why).
After: summary.json, the summary's floats as run metrics and its counts as ``result.*`` params, the description
(what the stage did and its key result), its spec's ``after`` hook (data: the train split's digest), and for the
training stages the trained model as a logged model output. What differs by stage comes from the stage's spec.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch

from grpoflow.tasks.config import PipelineConfig
from grpoflow.tasks.storage.workspace import Workspace
from grpoflow.tasks.tracking import run_meta
from grpoflow.tasks.tracking.dataset_inputs import log_datasets, split_dataset
from grpoflow.tasks.tracking.tracker import NOTE, RunLogger

log = logging.getLogger(__name__)
MODEL_PARAMS = ("learning_rate", "loss_type", "max_steps", "beta", "model", "dataset", "dataset_digest", "seed")


class StageRun(run_meta.StageInfo, Protocol):
    """What the shell's hooks read of a stage beyond run_meta's (tasks/pipeline/spec.py StageSpec)."""

    splits: tuple[str, ...]
    trains: bool
    before: Callable[..., None] | None
    after: Callable[..., None] | None


def device_name(spec: str) -> str:
    """run.device as the stage sees it: 'auto' resolved to cuda or cpu."""
    if spec != "auto":
        return spec
    return "cuda" if torch.cuda.is_available() else "cpu"


def _splits(cfg: PipelineConfig, split_dirs: dict[str, Path], origins: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for split, path in split_dirs.items():
        if path.is_dir():
            name = f"{run_meta.short_dataset(cfg.data.source)}-{split}"
            out[split] = split_dataset(str(path), name, origins.get(split))
    return out


def prepare_run(
    tracker: RunLogger,
    cfg: PipelineConfig,
    stage: StageRun,
    split_dirs: dict[str, Path],
    origins: dict[str, Any] | None = None,
) -> None:
    """Params, dataset inputs (the stage's ``splits`` among ``split_dirs``: {split: its folder}, with ``origins``:
    {split: where its rows came from, dataset_inputs.split_dataset}; the train split's digest is a param of every
    stage that reads the splits) and the stage's ``before`` hook."""
    if not tracker:
        return
    splits = _splits(cfg, split_dirs, origins or {})
    digest = splits["train"].digest if "train" in splits else None
    tracker.log_params(run_meta.stage_params(cfg, stage, device_name(cfg.run.device), digest))
    log_datasets(tracker.client, tracker.run_id, {k: v for k, v in splits.items() if k in stage.splits})
    if stage.before is not None:
        stage.before(tracker, cfg)


def finish_run(
    tracker: RunLogger, cfg: PipelineConfig, ws: Workspace, stage: StageRun, summary: dict[str, Any]
) -> None:
    if not tracker:
        return
    tracker.log_dict(summary, "summary.json")
    metrics, counts = run_meta.summary_results(summary)
    tracker.log_metrics(metrics)
    tracker.log_params(counts)
    if stage.after is not None:
        stage.after(tracker, cfg, ws, summary)
    tracker.set_tags({NOTE: run_meta.describe(cfg, stage, summary)})
    if stage.trains and summary.get("model_path") and Path(summary["model_path"]).exists():
        params = tracker.params
        name = f"{stage.name}-{run_meta.short_model(cfg.model.name)}"
        tracker.log_model(  # through the run's journal: a server down at the stage's end gets it later
            name,
            summary["model_path"],
            {k: params[k] for k in MODEL_PARAMS if k in params},
            step=int(summary.get("steps") or 0),
        )
