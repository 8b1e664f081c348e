"""One process of a distributed GRPO stage: what torchrun starts (tasks/stages/grpo.py ``launch_grpo``).

    python -m grpoflow.tasks.stages.grpo_worker <launch>/spec.json

The spec holds the run config, the workspace, the stage's MLflow run and where to write the summary. Every rank
joins the process group (distributed.backend, distributed.timeout_s) and runs :func:`train_grpo`; rank 0 logs
to the stage's MLflow run and writes the summary; a rank that fails records its error beside the spec
(tasks/runtime/launch.py reads it) and exits non-zero, and torchrun then stops the others.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

import torch

from grpoflow.tasks.config import config_from_dict
from grpoflow.tasks.model.device import resolve_device
from grpoflow.tasks.runtime.dist import launched_world_size, process_group
from grpoflow.tasks.runtime.launch import write_rank_error
from grpoflow.tasks.runtime.stage import USER_ERRORS
from grpoflow.tasks.runtime.tracking import RunLogger
from grpoflow.tasks.runtime.workspace import Workspace
from grpoflow.tasks.stages.grpo import train_grpo


def main(argv: list[str]) -> int:
    spec_path = Path(argv[0])
    spec = json.loads(spec_path.read_text())
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,  # rank 0 reports; the others only their problems
        format=f"[rank{rank}] %(levelname)s %(name)s: %(message)s",
        stream=sys.stdout,
        force=True,  # importing prefect configured the root logger already
    )
    if rank != 0:
        os.environ["GRPOFLOW_PROGRESS"] = "0"
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # its engine's start-up chatter is rank 0's to log
    try:
        cfg = config_from_dict(spec["config"])
        if launched_world_size() != cfg.distributed.world_size:
            raise ValueError(
                f"distributed: torchrun started {launched_world_size()} processes, the config asks for "
                f"{cfg.distributed.world_size} (nproc_per_node * nnodes)"
            )
        if cfg.run.torch_threads:
            torch.set_num_threads(cfg.run.torch_threads)
        d = cfg.distributed
        with process_group(d.backend, d.timeout_s, resolve_device(cfg.run.device).type) as comm:
            ws = Workspace(spec["workspace"], cfg.storage)
            tracker = RunLogger.disabled()
            if comm.is_main and spec["run_id"]:
                from mlflow.tracking import MlflowClient

                tracker = RunLogger(MlflowClient(spec["tracking_uri"]), spec["run_id"])
            summary = train_grpo(cfg, ws, tracker, spec["init_model"], comm)
            if comm.is_main:
                out = Path(spec["summary"])
                out.with_suffix(".tmp").write_text(json.dumps(summary))
                os.replace(out.with_suffix(".tmp"), out)
    except USER_ERRORS as e:  # the user's input: one line (its traceback is in the error record), as on one process
        write_rank_error(spec_path.parent, rank, e, USER_ERRORS)
        logging.getLogger(__name__).error("rank %d failed: %s", rank, e)
        return 1
    except BaseException as e:  # a bug of ours: the traceback too
        write_rank_error(spec_path.parent, rank, e, USER_ERRORS)
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
