"""Counting what makes a CUDA device wait for the host (a device-to-host sync), on any device: the aten ops that
read a tensor's value back (``_local_scalar_dense``: ``.item()``, ``bool()``, ``int()``, ``float()`` of a tensor) or
whose output shape depends on values (``nonzero``, ``masked_select``, ``unique``, indexing by a boolean mask), seen
by a TorchDispatchMode, and ``Tensor.tolist`` (which reads memory without dispatching), patched. On CPU there is no
device to wait for, so tests count these calls: each is a sync when the same code runs on CUDA."""

from __future__ import annotations

import contextlib
import traceback
from collections import Counter
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

SYNCING_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "_unique", "_unique2", "unique_dim"}
SYNCING_OPS |= {"unique_consecutive", "unique_dim_consecutive"}
MASK_INDEXED_OPS = {"index", "index_put", "index_put_", "_index_put_impl_"}  # a sync when an index is a bool mask


def _caller(skip: int) -> str:
    """``file:line`` of the innermost frame of grpoflow code (tasks/, kernels/) on the stack (else the innermost),
    followed by `` via PACKAGE`` when the call was made inside a library that grpoflow code called (transformers'
    masks, say): the innermost frame outside torch is then in site-packages."""
    frames = traceback.extract_stack()[:-skip]
    ours = [f for f in frames if "/tasks/" in f.filename or "/kernels/" in f.filename]
    f = (ours or frames)[-1]
    where = f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno}"
    outside_torch = [g for g in frames if "/torch/" not in g.filename and "host_syncs" not in g.filename]
    if outside_torch and "site-packages/" in outside_torch[-1].filename:
        where += " via " + outside_torch[-1].filename.split("site-packages/")[1].split("/")[0]
    return where


class SyncCounter(TorchDispatchMode):
    """Inside (``with``): ``where`` counts the syncing calls by "op file:line" (the grpoflow line that led to them);
    ``total`` sums them."""

    def __init__(self) -> None:
        super().__init__()
        self.where: Counter[str] = Counter()

    @property
    def total(self) -> int:
        return sum(self.where.values())

    def ours(self) -> dict[str, int]:
        """The calls made by grpoflow code itself (not inside a library it called)."""
        return {k: v for k, v in self.where.items() if " via " not in k}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in SYNCING_OPS or (
            name in MASK_INDEXED_OPS
            and any(
                isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
                for i in (args[1] if len(args) > 1 and isinstance(args[1], (list, tuple)) else ())
            )
        ):
            self.where[f"{name} {_caller(2)}"] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def counting_syncs() -> Iterator[SyncCounter]:
    """A :class:`SyncCounter` counting inside the block (``Tensor.tolist`` included)."""
    counter = SyncCounter()
    tolist = torch.Tensor.tolist

    def counted_tolist(self, *args, **kwargs):
        counter.where[f"tolist {_caller(2)}"] += 1
        return tolist(self, *args, **kwargs)

    torch.Tensor.tolist = counted_tolist
    try:
        with counter:
            yield counter
    finally:
        torch.Tensor.tolist = tolist
