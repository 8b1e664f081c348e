"""Checkpoints of a GRPO run on several processes (the single-process format is GRPOTrainer.save_checkpoint's).

    checkpoint-N/
        dcp/                  model and optimizer state, torch.distributed.checkpoint (each rank writes its shards;
                              the trainable parameters only: a LoRA base is reloaded from its source)
        rank<r>.pt            rank r's scheduler, RNG states (torch, CUDA, the round shuffler) and round in progress
        trainer_state.json    rank 0's: step counters, sampler position, config hash, world size, history, python
                              and numpy RNG states, the round's statistics; written last, so it marks the folder
                              complete (list_checkpoints)

Written into checkpoint-N.tmp by every rank and renamed by rank 0 after a barrier, so a killed run never leaves a
half-written checkpoint; the newest two are kept. On nodes with their own disks (a TrainJob's) each node holds its
own ranks' files and uploads them to the S3 workspace before rank 0 uploads the rest (:func:`publish`).

Resuming on the same number of processes continues exactly. On another number, torch.distributed.checkpoint
reshards the model and optimizer and the round in progress is dropped (it is regenerated, with a warning), as are
the per-rank RNG states.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from grpoflow.tasks.grpo import checkpoint
from grpoflow.tasks.grpo.checkpoint import CheckpointCorrupt
from grpoflow.tasks.grpo.rounds import Round

log = logging.getLogger(__name__)


def _state_dicts(trainer) -> dict:
    """The trainable parameters and optimizer state of ``trainer`` (a GRPOTrainer) by parameter name."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model, optim = get_state_dict(trainer.root, trainer.optimizer, options=StateDictOptions(ignore_frozen_params=True))
    return {"model": model, "optim": optim}


def save(trainer, final: Path) -> None:
    """Every rank writes its part of checkpoint ``final`` of ``trainer`` (a GRPOTrainer; a collective); rank 0
    renames it into place."""
    import torch.distributed.checkpoint as dcp

    comm = trainer.comm
    tmp = final.with_name(final.name + ".tmp")
    if comm.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    comm.barrier()
    round_tensors, round_meta = trainer.round.to_state() if trainer.round is not None else (None, None)
    with checkpoint.disk_full_guard(tmp, final):  # the rank out of space fails; torchrun stops the others
        dcp.save(_state_dicts(trainer), checkpoint_id=str(tmp / "dcp"))
        torch.save(
            {
                "scheduler": trainer.scheduler.state_dict(),
                "torch_rng": torch.get_rng_state(),
                "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
                "perm_rng": trainer.perm_rng.get_state(),
                "round": round_tensors,
                **checkpoint.reference_state(trainer),
            },
            tmp / f"rank{comm.rank}.pt",
        )
    comm.barrier()  # every rank's files are written
    if comm.is_main:
        state = {**checkpoint.shared_state(trainer, round_meta), "world_size": comm.world}
        state["files"] = checkpoint.file_sizes(tmp)  # every rank's (on one node; a TrainJob's node 0's only)
        with checkpoint.disk_full_guard(tmp, final):
            (tmp / "trainer_state.json").write_text(json.dumps(state))
        checkpoint.publish_folder(tmp, final)  # every rank's files fsynced, then renamed


def publish(trainer, final: Path, node_push: Callable[[Path], None] | None) -> None:
    """After :func:`save` (a collective): rank 0 prunes and calls the trainer's ``on_checkpoint`` (its upload).

    With ``node_push`` every node has its own disk (a TrainJob's nodes, each with its own mirror of the S3
    workspace), so checkpoint ``final`` is split over the nodes: first each other node's local rank 0 renames its
    own ``checkpoint-N.tmp``, keeps its newest two and calls ``node_push`` (which adds its ranks' files to the
    checkpoint on S3), then, after a barrier, rank 0 publishes, its trainer_state.json (the marker) last. So on S3
    a checkpoint is complete only with every node's shards."""
    comm = trainer.comm
    if node_push is not None:
        if comm.local_rank == 0 and not comm.is_main:
            checkpoint.publish_folder(final.with_name(final.name + ".tmp"), final)
            for stale in checkpoint.checkpoint_folders(final.parent)[:-2]:
                shutil.rmtree(stale, ignore_errors=True)
            node_push(final)
        comm.barrier()  # every node's shards are on S3 before rank 0 uploads the marker
    if comm.is_main:
        trainer._after_save(final)
    comm.barrier()  # no rank starts the next checkpoint before this one is in place


def _checked(trainer, path: Path) -> tuple[dict, dict]:
    """trainer_state.json and this rank's tensor file of checkpoint ``path``, every listed file checked, before
    anything is loaded into the trainer; every rank learns whether all did (a collective), so all raise the same
    :class:`CheckpointCorrupt` (the first failing rank's) and fall back together."""
    try:
        state = checkpoint.read_state(trainer, path)
        checkpoint.check_files(path, state)
        same_world = state["world_size"] == trainer.comm.world
        mine = path / (f"rank{trainer.comm.rank}.pt" if same_world else "rank0.pt")
        blob, error = checkpoint.load_tensors(path, mine), None
    except CheckpointCorrupt as e:
        state, blob, error = {}, {}, (str(e.file), e.why)
    errors = [x for x in trainer.comm.all_gather_object(error) if x is not None]
    if errors:
        raise CheckpointCorrupt(path, errors[0][0], errors[0][1])
    return state, blob


def load(trainer, path: Path) -> None:
    """Continue from checkpoint ``path`` (written by :func:`save`, on any number of processes)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    state, blob = _checked(trainer, path)
    dicts = _state_dicts(trainer)
    try:
        dcp.load(dicts, checkpoint_id=str(path / "dcp"))  # a collective: a bad shard fails it on every rank
    except Exception as e:  # noqa: BLE001 - any failure to read the shards is a damaged checkpoint
        raise CheckpointCorrupt(path, path / "dcp", f"shards do not load ({type(e).__name__}: {e})", True) from None
    options = StateDictOptions(ignore_frozen_params=True, strict=False)  # the frozen base is not in a checkpoint
    set_state_dict(
        trainer.root,
        trainer.optimizer,
        model_state_dict=dicts["model"],
        optim_state_dict=dicts["optim"],
        options=options,
    )
    same_world = state["world_size"] == trainer.comm.world
    trainer.scheduler.load_state_dict(blob["scheduler"])
    checkpoint.restore_reference(trainer, blob)
    if same_world:
        torch.set_rng_state(blob["torch_rng"])
        if blob["cuda_rng"] and torch.cuda.is_available() and len(blob["cuda_rng"]) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(blob["cuda_rng"])
        trainer.perm_rng.set_state(blob["perm_rng"])
        meta = state["round"]
        trainer.round = None if meta is None else Round.from_state(blob["round"], meta, trainer.device)
    else:
        trainer.round = None
        if state["round"] is not None:
            log.warning(
                "checkpoint %s was written by %d processes, this run has %d: the model and optimizer are resharded, "
                "the round in progress is dropped and generated anew (the run will not match an uninterrupted one)",
                path,
                state["world_size"],
                trainer.comm.world,
            )
    checkpoint.restore_shared(trainer, state)
    log.info("resumed GRPO from %s (step %d, written by %d processes)", path, trainer.step, state["world_size"])
