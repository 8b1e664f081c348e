"""The one shell every Prefect stage task uses: config dict + workspace URI in, summary dict out.

Stages are plain functions ``fn(cfg, ws, tracker, **inputs) -> dict`` that know nothing of
Prefect; this wraps one in its nested MLflow run and logs the summary it returns.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tasks.config import PipelineConfig, config_from_dict
from tasks.tracking import stage_run
from tasks.workspace import Workspace

StageFn = Callable[..., dict[str, Any]]


def run_stage(
    name: str, fn: StageFn, cfg_dict: dict, workspace_root: str, parent_run_id: str | None, **inputs: Any
) -> dict[str, Any]:
    cfg: PipelineConfig = config_from_dict(cfg_dict)
    if cfg.run.torch_threads:
        torch.set_num_threads(cfg.run.torch_threads)
    ws = Workspace(workspace_root)
    with stage_run(cfg, parent_run_id, name) as tracker:
        summary = fn(cfg, ws, tracker, **inputs)
        tracker.log_dict(summary, "summary.json")
        numeric = {
            f"summary/{k}": v for k, v in summary.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        tracker.log_metrics(numeric)
        summary["mlflow_run_id"] = tracker.run_id
        return summary
