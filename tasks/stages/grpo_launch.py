"""What a launch of the GRPO stage on several processes hands every process: the worker module torchrun runs and
the spec it reads (tasks/stages/grpo_worker.py). Shared by the local torchrun launch (tasks/stages/grpo.py) and
the TrainJob launch (tasks/stages/grpo_trainjob.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

from grpoflow.tasks.config import PipelineConfig, config_to_json
from grpoflow.tasks.config.secrets import redact
from grpoflow.tasks.stages.common import base_model_path
from grpoflow.tasks.storage.workspace import Workspace
from grpoflow.tasks.tracking.tracker import RunLogger, tracking_uri

WORKER = "grpoflow.tasks.stages.grpo_worker"


def launch_spec(cfg: PipelineConfig, ws: Workspace, tracker: RunLogger, init_model: str | None, folder: Path) -> dict:
    """What every process of a launch reads (grpo_worker.py): config, workspace, starting model, MLflow run, where
    rank 0 writes the summary. Empties the launch ``folder`` and tags the stage's run with the world size."""
    d = cfg.distributed
    init_model = init_model or base_model_path(cfg, ws)  # built here once (tiny), not by every rank at once
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    tracker.set_tags(
        {"distributed.world_size": d.world_size, "distributed.strategy": d.strategy, "distributed.nnodes": d.nnodes}
    )
    return {
        "config": config_to_json(cfg),  # the process boundary: the workers read it back with config_from_json
        "workspace": ws.location,
        "init_model": init_model,
        "tracking_uri": redact(tracking_uri(cfg)) if tracker else None,  # the real one: the workers' environment
        "run_id": tracker.run_id,
        "skip": tracker.skip,  # a reopened run's last step per metric: rank 0 does not log them again
        "summary": str(folder / "summary.json"),
    }
