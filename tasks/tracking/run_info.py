"""What the stage shell (tasks/pipeline/shell.py) logs on a stage run before and after the stage itself.

Before: the settings that shaped the stage as params (run_meta.stage_params: its config section under TRL's names,
model, dataset and the train split's digest, seed, device), the prepared splits it reads as dataset inputs, and,
for grpo, the metrics that cannot move at these settings (not logged; a tag says why).
After: summary.json, the summary's floats as run metrics and its counts as ``result.*`` params, the description
(what the stage did and its key result), and for the training stages the trained model as a logged model output.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from grpoflow.tasks.config import PipelineConfig
from grpoflow.tasks.storage.workspace import Workspace
from grpoflow.tasks.tracking import run_meta
from grpoflow.tasks.tracking.entities import STAGE_SPLITS, log_datasets, split_dataset
from grpoflow.tasks.tracking.tracker import NOTE, RunLogger

log = logging.getLogger(__name__)
TRAINING_STAGES = ("sft", "grpo")
MODEL_PARAMS = ("learning_rate", "loss_type", "max_steps", "beta", "model", "dataset", "dataset_digest", "seed")


def device_name(spec: str) -> str:
    """run.device as the stage sees it: 'auto' resolved to cuda or cpu."""
    if spec != "auto":
        return spec
    return "cuda" if torch.cuda.is_available() else "cpu"


def _splits(cfg: PipelineConfig, ws: Workspace, names: tuple[str, ...]) -> dict[str, Any]:
    out = {}
    for split in names:
        path = ws.root / "data" / split
        if path.is_dir():
            out[split] = split_dataset(str(path), f"{run_meta.short_dataset(cfg.data.source)}-{split}")
    return out


def prepare_run(tracker: RunLogger, cfg: PipelineConfig, ws: Workspace, stage: str) -> None:
    if not tracker:
        return
    splits = _splits(cfg, ws, ("train", *STAGE_SPLITS.get(stage, ()))) if stage != "data" else {}
    digest = splits["train"].digest if "train" in splits else None
    tracker.log_params(run_meta.stage_params(cfg, stage, device_name(cfg.run.device), digest))
    log_datasets(tracker.client, tracker.run_id, {k: v for k, v in splits.items() if k in STAGE_SPLITS.get(stage, ())})
    if stage == "grpo":
        tracker.omit_constant(run_meta.constant_metrics(cfg))


def finish_run(tracker: RunLogger, cfg: PipelineConfig, ws: Workspace, stage: str, summary: dict[str, Any]) -> None:
    if not tracker:
        return
    tracker.log_dict(summary, "summary.json")
    metrics, counts = run_meta.summary_results(summary)
    tracker.log_metrics(metrics)
    tracker.log_params(counts)
    if stage == "data":
        train = _splits(cfg, ws, ("train",)).get("train")
        tracker.log_params({"dataset_digest": train.digest if train is not None else None})
    tracker.set_tags({NOTE: run_meta.describe(cfg, stage, summary)})
    if stage in TRAINING_STAGES and summary.get("model_path") and Path(summary["model_path"]).exists():
        params = tracker.params
        name = f"{stage}-{run_meta.short_model(cfg.model.name)}"
        tracker.log_model(  # through the run's journal: a server down at the stage's end gets it later
            name,
            summary["model_path"],
            {k: params[k] for k in MODEL_PARAMS if k in params},
            step=int(summary.get("steps") or 0),
        )
