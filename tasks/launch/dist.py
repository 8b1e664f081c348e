"""torch.distributed for the GRPO processes: the process group, this process's rank, and the few collectives the
trainer needs.

:class:`Comm` is what the trainer holds. ``Comm()`` is one process (world size 1, no process group): every
collective returns its input unchanged, so the single-process path runs the very same operations as before
distributed training existed. :func:`process_group` initializes the default group from torchrun's environment
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT) with a bounded timeout and destroys it on exit.

Collectives run on ``Comm.device``: the CPU for gloo, this process's GPU for nccl; tensors are moved there and
back, so callers pass what they have.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


def resolve_backend(backend: str, device_type: str) -> str:
    """distributed.backend resolved: auto -> nccl for CUDA processes, gloo otherwise; nccl without CUDA is refused."""
    if backend == "auto":
        return "nccl" if device_type == "cuda" else "gloo"
    if backend == "nccl" and device_type != "cuda":
        raise ValueError(f"distributed.backend=nccl needs CUDA processes (this one runs on {device_type}); use gloo")
    return backend


def launched_world_size() -> int:
    """WORLD_SIZE that torchrun set for this process (1 when it was not launched by torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


@dataclass(frozen=True)
class Comm:
    """This process's place in the group and the collectives over it; world 1 = no group, every call a no-op."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def is_main(self) -> bool:
        """Rank 0: the one process that logs to MLflow and writes the stage's files."""
        return self.rank == 0

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` (the same shape on all ranks) concatenated along dim 0, in rank order."""
        if self.world == 1:
            return x
        y = x.to(self.device, torch.uint8 if x.dtype == torch.bool else x.dtype).contiguous()  # gloo: no bool
        parts = [torch.empty_like(y) for _ in range(self.world)]
        dist.all_gather(parts, y)
        return torch.cat(parts).to(x.device, x.dtype)

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's picklable ``obj``, in rank order."""
        if self.world == 1:
            return [obj]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        """Wait until every rank is here."""
        if self.world > 1:
            dist.barrier()

    def all_reduce(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """``x`` reduced over the ranks (sum | min | max), as a new tensor on ``x``'s device."""
        if self.world == 1:
            return x
        ops = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}
        if op not in ops:
            raise ValueError(f"all_reduce: op must be sum, min or max (got {op!r})")
        y = x.detach().to(self.device, copy=True)
        dist.all_reduce(y, ops[op])
        return y.to(x.device)


# seconds a rank idles without the GIL after destroying its process group (process_group says why)
SHUTDOWN_GRACE_S = 0.25


@contextlib.contextmanager
def process_group(backend: str = "auto", timeout_s: float = 300.0, device_type: str = "cpu") -> Iterator[Comm]:
    """The default process group of a torchrun-launched process, destroyed on exit; ``Comm()`` without torchrun.

    ``timeout_s`` bounds every collective: a rank that died or hangs makes the others fail after it, not wait.
    On CUDA each process takes the GPU of its LOCAL_RANK.

    A body that ends normally meets the other ranks at a barrier, and after the group is destroyed the process
    sleeps ``SHUTDOWN_GRACE_S`` without the GIL. A gloo worker thread that ran an all-gather of Python-made tensors
    (``all_gather_object``) frees them after the collective has returned, and needs the GIL for it; a rank that
    went straight on to exit could start interpreter shutdown first, which ends that waiting thread mid-C++ and
    aborts the process ("terminate called without an active exception", SIGABRT, seen in a core dump under
    ``ProcessGroupGloo::runLoop`` -> ``~AsyncAllgatherWork``) after all its work was done, so torchrun reported the
    run failed. A body that raises skips both: the other ranks may be gone."""
    world = launched_world_size()
    if world == 1:
        yield Comm()
        return
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    name = resolve_backend(backend, device_type)
    device = torch.device("cpu")
    if name == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    dist.init_process_group(name, timeout=datetime.timedelta(seconds=timeout_s))
    log.info("process group: rank %d of %d (local %d), %s, timeout %.0f s", rank, world, local_rank, name, timeout_s)
    try:
        comm = Comm(rank=rank, world=world, local_rank=local_rank, device=device)
        yield comm
        if dist.is_initialized():  # vLLM's teardown may have destroyed the default group already
            comm.barrier()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    time.sleep(SHUTDOWN_GRACE_S)  # only on a normal exit: a raise leaves through the finally above
