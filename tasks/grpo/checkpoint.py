"""Checkpoints of a GRPO run in one process (several processes: dist_checkpoint.py).

    checkpoint-N/
        adapter or model files  save_pretrained() of the model being trained
        trainer_state.pt        tensors only (loads with torch.load(weights_only=True): a checkpoint pulled from a
                                shared bucket cannot run code): trainable weights, optimizer, scheduler, torch/CUDA
                                RNG states, the round shuffler, the round in progress (its tensors)
        trainer_state.json      step counters, sampler position, config hash, history, python and numpy RNG states,
                                the round's metadata, the size of every other file; its presence marks the folder
                                complete (list_checkpoints)

Written into checkpoint-N.tmp, fsynced (files and folders) and renamed, the parent folder fsynced after, so a
half-written checkpoint is never picked up, not even after a power loss. A checkpoint damaged anyway (a file cut
short, trainer_state.json truncated) raises :class:`CheckpointCorrupt` on load, naming the file, before the
trainer is touched; the trainer then resumes from the one before it (GRPOTrainer.resume). A write that runs out
of disk space (:func:`out_of_space`) removes checkpoint-N.tmp and raises :class:`CheckpointDiskFull`, naming the
folder and the bytes free and needed; the checkpoints already there are untouched.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import pickle
import random
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from grpoflow.tasks.grpo.rounds import Round
from grpoflow.tasks.storage.store import fsync_dir, fsync_tree

log = logging.getLogger(__name__)


MiB = 1024 * 1024
FULL_BELOW = MiB  # a write that fails with less free than this on its device ran out of space (torch.save says
# only "unexpected pos" or "file write failed" then)


class CheckpointDiskFull(OSError):
    """A checkpoint could not be written for lack of disk space; the previous checkpoints are intact."""


class CheckpointCorrupt(ValueError):
    """A checkpoint that cannot be resumed: its trainer_state.json truncated or not JSON, a file it lists missing or
    shorter than written, or a tensor file that does not load. Names the checkpoint and the file. ``modified``: the
    trainer was partly overwritten before the failure (a sharded load), so it cannot start from scratch."""

    def __init__(self, path: Path, file: Path | str, why: str, modified: bool = False):
        self.path, self.file, self.why, self.modified = Path(path), Path(file), why, modified
        super().__init__(f"checkpoint {self.path.name} ({self.path}): {self.file.name}: {why}")


STATE = "trainer_state.json"
REQUIRED = ("step", "micro_step", "num_tokens", "sampler", "config_hash", "history", "round")


def file_sizes(folder: Path) -> dict[str, int]:
    """{relative name: bytes} of every file in checkpoint folder ``folder`` but its marker: trainer_state.json
    records them, so a resume can tell a file lost or cut short in a crash (:func:`check_files`)."""
    return {
        p.relative_to(folder).as_posix(): p.stat().st_size
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != STATE
    }


def read_json_state(path: Path) -> dict:
    """trainer_state.json of checkpoint ``path``; :class:`CheckpointCorrupt` when missing, truncated, not JSON or
    lacking the fields every checkpoint writes."""
    file = path / STATE
    try:
        state = json.loads(file.read_bytes())
    except FileNotFoundError:
        raise CheckpointCorrupt(path, file, "missing (the checkpoint is incomplete)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        size = file.stat().st_size if file.is_file() else 0
        raise CheckpointCorrupt(path, file, f"not valid JSON ({size} bytes; truncated or corrupt): {e}") from None
    if not isinstance(state, dict) or (missing := [k for k in REQUIRED if k not in state]):
        what = f"lacks {', '.join(missing)}" if isinstance(state, dict) else f"holds a {type(state).__name__}"
        raise CheckpointCorrupt(path, file, f"{what} (truncated or written by something else)")
    return state


def check_files(path: Path, state: dict) -> None:
    """Every file trainer_state.json lists (``files``, written since durable checkpoints) present at its size;
    :class:`CheckpointCorrupt` naming the first that is not."""
    for name, size in (state.get("files") or {}).items():
        file = path / name
        if not file.is_file():
            raise CheckpointCorrupt(path, file, f"missing (trainer_state.json lists it, {size} bytes)")
        if (got := file.stat().st_size) != size:
            raise CheckpointCorrupt(path, file, f"{got} bytes, {size} written (cut short)")


def load_tensors(path: Path, file: Path) -> dict:
    """torch.load(``file``, weights_only=True) of checkpoint ``path``; :class:`CheckpointCorrupt` when it does not
    load (missing, truncated, not a torch file)."""
    try:  # weights_only: a checkpoint pulled from a shared bucket cannot run code when loaded
        return torch.load(file, weights_only=True, map_location="cpu")
    except FileNotFoundError:
        raise CheckpointCorrupt(path, file, "missing") from None
    except (OSError, EOFError, RuntimeError, pickle.UnpicklingError, ValueError) as e:
        raise CheckpointCorrupt(path, file, f"does not load ({type(e).__name__}: {e})") from None


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else 0


def out_of_space(exc: BaseException, folder: Path) -> bool:
    """Whether a failed write into ``folder`` ran out of space: ENOSPC (EDQUOT), a message saying so (safetensors'
    "os error 28"), or under :data:`FULL_BELOW` bytes left on its device."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    if "No space left on device" in str(exc) or "os error 28" in str(exc):
        return True
    try:
        return shutil.disk_usage(folder).free < FULL_BELOW
    except OSError:
        return False


@contextlib.contextmanager
def disk_full_guard(tmp: Path, final: Path) -> Iterator[None]:
    """Around the writes of checkpoint ``final`` into ``tmp``: when they run out of space, remove ``tmp`` and raise
    :class:`CheckpointDiskFull` naming the folder, the bytes free and, from the newest complete checkpoint, about the
    bytes needed."""
    try:
        yield
    except Exception as e:
        if not out_of_space(e, tmp.parent):
            raise
        written = folder_bytes(tmp)
        shutil.rmtree(tmp, ignore_errors=True)
        free = shutil.disk_usage(tmp.parent).free
        previous = [p for p in list_checkpoints(final.parent) if p != final]
        need = folder_bytes(previous[-1]) if previous else None
        needed = f"about {need / MiB:.1f} MiB needed (the size of {previous[-1].name})" if need else "needed: unknown"
        kept = f"{previous[-1].name} is intact" if previous else "no earlier checkpoint exists"
        raise CheckpointDiskFull(
            errno.ENOSPC,
            f"no space left on the device of {final.parent} for {final.name}: {free / MiB:.1f} MiB free after "
            f"removing the partial {tmp.name} ({written / MiB:.1f} MiB written), {needed}; {kept}. Free space "
            "there, or point run.output_dir (storage.cache_dir for an S3 workspace) at a larger disk, and resume",
        ) from e


def save(t, final: Path) -> None:
    """Write ``t``'s (a GRPOTrainer) state to ``final`` through ``final``.tmp."""
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    with disk_full_guard(tmp, final):
        _write(t, tmp, final)


def _write(t, tmp: Path, final: Path) -> None:
    tmp.mkdir(parents=True)
    t.model.save_pretrained(tmp)
    trainable = {n: p.detach().cpu().clone() for n, p in t.model.named_parameters() if p.requires_grad}
    round_tensors, round_meta = t.round.to_state() if t.round is not None else (None, None)
    torch.save(  # tensors, dicts, lists and numbers only: loads with weights_only=True
        {
            "trainable": trainable,
            "optimizer": t.optimizer.state_dict(),
            "scheduler": t.scheduler.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            "perm_rng": t.perm_rng.get_state(),
            "round": round_tensors,
            **reference_state(t),
        },
        tmp / "trainer_state.pt",
    )
    state = {**shared_state(t, round_meta), "files": file_sizes(tmp)}
    (tmp / STATE).write_text(json.dumps(state))
    publish_folder(tmp, final)


def publish_folder(tmp: Path, final: Path) -> None:
    """Rename the written checkpoint ``tmp`` to ``final``, durably: every file and folder in it fsynced first (the
    rename must not publish bytes still only in the page cache), the parent folder after (the rename itself)."""
    fsync_tree(tmp)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    fsync_dir(final.parent)


def load(t, path: Path) -> None:
    """Restore ``t``'s (a GRPOTrainer) state from the checkpoint folder ``path``. Everything is read and checked
    before the trainer is touched, so a :class:`CheckpointCorrupt` leaves it as it was."""
    state = read_state(t, path)
    if "python_rng" not in state:
        raise ValueError(
            f"checkpoint {path} is in the older pickled format, which this version does not load (it could run "
            f"code); remove {path.parent} or set grpo.resume=never to start over"
        )
    check_files(path, state)
    blob = load_tensors(path, path / "trainer_state.pt")
    params = dict(t.model.named_parameters())
    with torch.no_grad():
        for name, value in blob["trainable"].items():
            params[name].copy_(value)  # copy_ moves it to the parameter's device
    restore_reference(t, blob)
    t.optimizer.load_state_dict(blob["optimizer"])  # casts and moves the state to the parameters' devices
    t.scheduler.load_state_dict(blob["scheduler"])
    torch.set_rng_state(blob["torch_rng"])
    if blob["cuda_rng"] and torch.cuda.is_available() and len(blob["cuda_rng"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(blob["cuda_rng"])
    t.perm_rng.set_state(blob["perm_rng"])
    t.round = None if state["round"] is None else Round.from_state(blob["round"], state["round"], t.device)
    restore_shared(t, state)
    log.info("resumed GRPO from %s (step %d)", path, t.step)


# what both formats (one process here, several in dist_checkpoint.py) write and read alike
def shared_state(t, round_meta: dict | None) -> dict:
    """trainer_state.json: step counters, sampler position, config hash, history, python and numpy RNG states,
    the round's metadata and the adaptive entropy controller."""
    np_state = np.random.get_state()
    return {
        "step": t.step,
        "micro_step": t.micro_step,
        "num_tokens": t.num_tokens,
        "sampler": t.sampler.state(),
        "config_hash": t.config_hash,
        "history": t.history,
        "python_rng": random.getstate(),
        "numpy_rng": [np_state[0], np_state[1].tolist(), *np_state[2:]],
        "round": round_meta,
        **({"entropy_control": t.entropy.state()} if t.entropy is not None else {}),
    }


def read_state(t, path: Path) -> dict:
    """trainer_state.json of checkpoint ``path`` (:func:`read_json_state`), refused when written with other grpo
    settings (a ValueError: not a damaged checkpoint, so no earlier one is tried)."""
    state = read_json_state(path)
    if state["config_hash"] != t.config_hash:
        raise ValueError(
            f"checkpoint {path} was written with other grpo settings; remove {path.parent} or set "
            "grpo.resume=never to start over"
        )
    return state


def restore_shared(t, state: dict) -> None:
    """Put back what :func:`shared_state` wrote (all but the round, which each format restores itself)."""
    version, internal, gauss = state["python_rng"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, *rest = state["numpy_rng"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), *rest))
    t.step, t.micro_step, t.num_tokens = state["step"], state["micro_step"], state["num_tokens"]
    t.sampler.load(state["sampler"])
    t.history = state["history"]
    if t.entropy is not None:
        t.entropy.load(state["entropy_control"])


def reference_state(t) -> dict:
    """sync_ref_model: the reference model moves with the policy, so it is saved too (tensors)."""
    return {"ref_model": cpu_params(t.ref_model)} if t.cfg.sync_ref_model and t.ref_model is not None else {}


def restore_reference(t, blob: dict) -> None:
    if "ref_model" in blob:
        ref = dict(t.ref_model.named_parameters())
        with torch.no_grad():
            for name, value in blob["ref_model"].items():
                ref[name].copy_(value)


def cpu_params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().cpu().clone() for n, p in model.named_parameters()}


def checkpoint_folders(folder: Path) -> list[Path]:
    """The renamed checkpoint-N folders (no checkpoint-N.tmp), oldest first; complete or not."""
    found = [p for p in folder.glob("checkpoint-*") if re.fullmatch(r"checkpoint-\d+", p.name) and p.is_dir()]
    return sorted(found, key=lambda p: int(p.name.split("-")[1]))


def list_checkpoints(folder: Path) -> list[Path]:
    """Complete checkpoints (renamed, trainer_state.json written last), oldest first."""
    return [p for p in checkpoint_folders(folder) if (p / STATE).is_file()]
