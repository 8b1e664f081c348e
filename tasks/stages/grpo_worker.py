"""One process of a distributed GRPO stage: what torchrun starts (tasks/stages/grpo.py ``launch_grpo``).

    python -m grpoflow.tasks.stages.grpo_worker <launch>/spec.json
    python -m grpoflow.tasks.stages.grpo_worker s3://<workspace>/grpo/launch/spec.json     (a TrainJob's pods)

The spec holds the run config, the workspace, the stage's MLflow run and where to write the summary. Every rank
joins the process group (distributed.backend, distributed.timeout_s) and runs :func:`train_grpo`; rank 0 logs
to the stage's MLflow run and writes the summary; a rank that fails records its error beside the spec
(tasks/launch/torchrun.py reads it) and exits non-zero, and torchrun then stops the others.

A spec on S3 is a Kubeflow TrainJob's (tasks/stages/grpo_trainjob.py): each node pulls the workspace's upstream
stages and the GRPO folder into its own mirror first (its local rank 0, the others wait), paths in the spec are
re-rooted from the launcher's mirror to this node's, error records go to S3 beside the spec, each node uploads its
own ranks' checkpoint shards (tasks/grpo/dist_checkpoint.py ``publish``: a rerun resumes from S3), and rank 0 pushes
the GRPO folder with the summary (paths re-rooted back to the launcher's mirror) when done.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
from pathlib import Path

import torch

from grpoflow.tasks.config import config_from_json
from grpoflow.tasks.config.secrets import real_uri
from grpoflow.tasks.launch.dist import launched_world_size, process_group
from grpoflow.tasks.launch.torchrun import write_rank_error
from grpoflow.tasks.model.device import resolve_device
from grpoflow.tasks.pipeline.shell import USER_ERRORS
from grpoflow.tasks.stages.grpo import train_grpo
from grpoflow.tasks.storage.s3 import is_s3_uri
from grpoflow.tasks.storage.store import Store, open_store, write_atomic
from grpoflow.tasks.storage.workspace import Workspace, reroot
from grpoflow.tasks.tracking.tracker import RunLogger, logger_for


def _spec_store(where: str) -> tuple[Store, str]:
    """The store holding the launch spec (its folder, or for a TrainJob its S3 prefix, reached through the
    environment's endpoint) and the spec's name in it."""
    parent, _, name = where.rpartition("/")
    return open_store(parent), name


def read_spec(where: str) -> dict:
    """The launch spec, from a file or (a TrainJob's) from S3."""
    store, name = _spec_store(where)
    data = store.read(name)
    if data is None:
        raise FileNotFoundError(f"{where}: no launch spec there")
    return json.loads(data)


def report(where: str, folder: Path, rank: int, exc: BaseException) -> None:
    """Record this rank's error beside the spec: in its folder, and in the spec's store too (a TrainJob's S3)."""
    path = write_rank_error(folder, rank, exc, USER_ERRORS)
    store, _ = _spec_store(where)
    if path.parent != store.local_root:
        try:
            store.write(path.name, path.read_bytes())
        except Exception as e:  # S3 itself may be what failed: the pod's log still has the error
            logging.getLogger(__name__).error("rank %d: its error record could not reach S3: %s", rank, e)


def main(argv: list[str]) -> int:
    """Run this rank of the launch whose spec is ``argv[0]``; 0 on success, 1 on a user error (recorded beside
    the spec); a bug of ours is recorded and raised."""
    where = argv[0]
    remote = is_s3_uri(where)
    folder = Path(tempfile.mkdtemp(prefix="grpo-launch-")) if remote else Path(where).parent
    rank = int(os.environ.get("RANK", "0"))
    configure_logging(rank)
    try:
        run_rank(where, remote)
    except USER_ERRORS as e:  # the user's input: one line (its traceback is in the error record), as on one process
        report(where, folder, rank, e)
        logging.getLogger(__name__).error("rank %d failed: %s", rank, e)
        return 1
    except BaseException as e:  # a bug of ours: the traceback too
        report(where, folder, rank, e)
        raise
    return 0


def configure_logging(rank: int) -> None:
    """Rank 0 reports (INFO); the others log only their problems, with no progress bars; lines name the rank."""
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,  # rank 0 reports; the others only their problems
        format=f"[rank{rank}] %(levelname)s %(name)s: %(message)s",
        stream=sys.stdout,
        force=True,  # importing prefect configured the root logger already
    )
    if rank != 0:
        os.environ["GRPOFLOW_PROGRESS"] = "0"
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # its engine's start-up chatter is rank 0's to log


def run_rank(where: str, remote: bool) -> None:
    """Join the process group, run :func:`train_grpo` and (rank 0) write the summary; on a TrainJob's node
    (``remote``) first mirror the workspace, and push the GRPO folder at the end."""
    spec = read_spec(where)
    cfg = spec_config(spec)
    d = cfg.distributed
    with process_group(d.backend, d.timeout_s, resolve_device(cfg.run.device).type) as comm:
        ws = Workspace(spec["workspace"], cfg.storage)
        launcher_root = None  # a TrainJob node's: the launcher's mirror, which spec paths and the summary name
        if remote:  # a node of a TrainJob: its own mirror of the workspace
            if comm.local_rank == 0:
                ws.fetch(("data", "sft"), loose=("base_model",))
                ws.pull("grpo")
            comm.barrier()
            launcher_root = spec["root"]
            spec = reroot(spec, launcher_root, str(ws.root))
        tracker = rank_tracker(cfg, spec, comm, ws)
        try:
            summary = train_grpo(cfg, ws, tracker, spec["init_model"], comm, node_mirrors=remote)
        finally:
            tracker.close()  # within tracking.flush_timeout_s; the rest stays in its journal
        if comm.is_main:
            write_summary(spec, summary, ws, launcher_root)


def spec_config(spec: dict):
    """The run config of the spec; fails when torchrun started another number of processes than it asks for.
    Sets run.torch_threads."""
    cfg = config_from_json(spec["config"])  # the process boundary (grpo_launch.py wrote it)
    if launched_world_size() != cfg.distributed.world_size:
        raise ValueError(
            f"distributed: torchrun started {launched_world_size()} processes, the config asks for "
            f"{cfg.distributed.world_size} (nproc_per_node * nnodes)"
        )
    if cfg.run.torch_threads:
        torch.set_num_threads(cfg.run.torch_threads)
    return cfg


def rank_tracker(cfg, spec: dict, comm, ws: Workspace) -> RunLogger:
    """Rank 0 logs into the stage's MLflow run (journaled under its own name), skipping the steps a reopened run
    holds (the spec's ``skip``, RunLogger.reopened); the other ranks log nothing."""
    if comm.is_main and spec["run_id"]:
        from mlflow.tracking import MlflowClient

        also = " (for a TrainJob: spec.trainer.env of its template)"
        client = MlflowClient(real_uri(spec["tracking_uri"], who="this GRPO process", also=also))
        logger = logger_for(cfg, client, spec["run_id"], ws.root, f"{spec['run_id']}.rank0")
        logger.skip = {k: int(v) for k, v in (spec.get("skip") or {}).items()}
        return logger
    return RunLogger.disabled()


def write_summary(spec: dict, summary: dict, ws: Workspace, launcher_root: str | None) -> None:
    """Write the summary where the spec says (atomically: the launcher reads it). On a TrainJob's node
    (``launcher_root`` set) its paths are re-rooted to the launcher's mirror and the GRPO folder is pushed."""
    if launcher_root is not None:  # the launcher reads it under its own mirror
        summary = reroot(summary, str(ws.root), launcher_root)
    write_atomic(spec["summary"], json.dumps(summary).encode())
    if launcher_root is not None:
        ws.push_merged("grpo")  # the final model, history, summary (the other nodes' shards kept)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
