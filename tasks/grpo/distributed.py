"""GRPO over several processes: TRL's batch layout, the gathered round statistics, and the wrapped root module.

The layout (TRL GRPOTrainer, where num_processes is the world size W; docs/grpo.md, docs/distributed.md):

    a round holds generation_batch_size = per_device_train_batch_size * W * steps_per_generation completions
    of unique_prompts = generation_batch_size / num_generations prompts, prompt-major, the same prompts in
    the same order on every rank;
    rank r generates, scores and trains rows [r*L, (r+1)*L) of it, L = per_device_train_batch_size *
    steps_per_generation (:func:`local_rows`), so a prompt's group may straddle two ranks;
    the rewards [B, K] are all-gathered, the advantages computed over the whole round on every rank and sliced
    to the rank's rows (TRL's ``process_slice``); the logged reward statistics come from the gathered tensors;
    the dapo normalizer is the all-reduced active-token count of the round / W * (GA / steps_per_generation);
    grpo and dr_grpo normalize locally (the gradient average over the ranks makes them the global mean); bnpo
    normalizes by the local token count, as TRL does, so it is not invariant to W.

At world size 1 every function here is the identity on what the single-process trainer computes. The micro-step
metrics, reduced over the ranks once per optimizer step, are in tasks/grpo/step_metrics.py.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator

import torch

from grpoflow.tasks.config import Batching
from grpoflow.tasks.launch.dist import Comm


def local_rows(b: Batching, rank: int) -> slice:
    """The rows of a round that ``rank`` owns: [rank*L, (rank+1)*L), L = rows_per_process (TRL's process_slice)."""
    n = b.rows_per_process
    return slice(rank * n, (rank + 1) * n)


def rounds_done(epoch: int, cursor: int, n_rows: int, unique_prompts: int) -> int:
    """How many rounds the prompt sampler has served: (epoch * n_rows + cursor) // unique_prompts."""
    return (epoch * n_rows + cursor) // unique_prompts


def row_seed(seed: int, round_index: int, row: int) -> int:
    """The sampling seed of row ``row`` of round ``round_index``: 63 bits of sha256("seed/round/row"), so a
    completion depends on where it sits in the run, never on which process or batch drew it."""
    digest = hashlib.sha256(f"{seed}/{round_index}/{row}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def mixed_precision(autocast_dtype: torch.dtype | None):
    """FSDP2's MixedPrecisionPolicy for a run that trains under ``autocast_dtype`` (tasks/model/loading.py
    train_dtypes), or None (FSDP2 then computes in the parameters' own dtype).

    Full fine-tuning in bf16 (float32 master weights, bf16 autocast): the shards stay float32 (the optimizer steps
    them), each layer is all-gathered and computed in bf16 (half the all-gather traffic and unsharded memory of
    float32), and gradients are reduce-scattered in float32, so the sum over the ranks does not round in bf16.
    LoRA (autocast None): no policy. The frozen base is already bf16 and is gathered as it is; the float32 adapters,
    the only trainable parameters (FSDP2 asks a uniform dtype of those alone), are small enough that gathering
    them in bf16 saves nothing worth their precision, and they compute in float32 as on one process (peft's
    default)."""
    if autocast_dtype is None:
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=autocast_dtype, reduce_dtype=torch.float32)


def wrap_root(
    root: torch.nn.Module, comm: Comm, strategy: str = "ddp", autocast_dtype: torch.dtype | None = None
) -> torch.nn.Module:
    """The root module as the distributed engine's: DistributedDataParallel, or FSDP2 (fully_shard per decoder
    layer, then the root) on a device mesh of the ranks, with :func:`mixed_precision` for ``autocast_dtype``;
    ``root`` itself at world size 1."""
    if comm.world == 1:
        return root
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [comm.device.index] if comm.device.type == "cuda" else None
        return DistributedDataParallel(root, device_ids=device_ids)
    if strategy == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        check_fsdp2_placement(next(root.parameters()).device.type, comm.device.type)
        mesh = init_device_mesh(comm.device.type, (comm.world,))
        policy = mixed_precision(autocast_dtype)
        kw = {} if policy is None else {"mp_policy": policy}
        for layer in decoder_layers(root):
            fully_shard(layer, mesh=mesh, **kw)
        fully_shard(root, mesh=mesh, **kw)
        return root
    raise ValueError(f"distributed.strategy must be ddp or fsdp2 (got {strategy!r})")


def check_fsdp2_placement(param_device_type: str, comm_device_type: str) -> None:
    """FSDP2 shards and gathers parameters over the process group's device: the mesh must be where the weights are.
    With distributed.backend=gloo on GPUs the group's tensors live on the CPU while the weights are on CUDA, and
    FSDP2 would build a CPU mesh around CUDA parameters; refused with what to set instead."""
    if param_device_type != comm_device_type:
        raise ValueError(
            f"distributed.strategy=fsdp2: the weights are on {param_device_type} but the process group communicates "
            f"on {comm_device_type} (distributed.backend=gloo on GPUs); use distributed.backend=nccl (or auto) on "
            "GPUs, or distributed.strategy=ddp"
        )


def decoder_layers(root: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks of a causal LM (the ``layers`` ModuleList of its backbone), the unit FSDP2 shards."""
    for name, module in root.named_modules():
        if name.endswith(".layers") and isinstance(module, torch.nn.ModuleList):
            return list(module)
    raise ValueError(f"{type(root).__name__}: no decoder layer list found (a '.layers' ModuleList) to shard")


def collective_free(root: torch.nn.Module) -> torch.nn.Module | None:
    """The module a forward of ``root``'s computation can go through without collectives, for rows that take no
    gradient (micro_plan.py): ``root`` itself at world size 1, DDP's inner module (DDP's collectives are in its
    wrapper: the buffer broadcast in forward, the gradient all-reduce in backward), None under FSDP2 (every forward
    all-gathers the layers' shards, a collective each rank must make alike)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(root, DistributedDataParallel):
        return root.module
    return None if any(isinstance(m, FSDPModule) for m in root.modules()) else root


@contextlib.contextmanager
def gradient_sync(root: torch.nn.Module, enabled: bool) -> Iterator[None]:
    """Inside: how backward() treats the gradients of a micro-step; ``enabled`` on the micro-step that completes an
    optimizer step.

    DDP: unless ``enabled``, gradients accumulate locally (``no_sync``) and the last micro-step's backward all-reduces
    their sum: a DDP rank holds the whole model and its whole gradient anyway, so skipping the all-reduces costs no
    memory. FSDP2: every micro-step reduce-scatters, ``enabled`` or not, and FSDP2 adds each reduced shard into the
    sharded ``.grad`` it keeps, so a rank holds 1/world of the gradient across the accumulation window.
    ``set_requires_gradient_sync(False)`` would instead keep each layer's *unsharded* gradient, upcast to the
    reduce dtype, from one micro-step to the next (a float32 gradient of the whole model per rank: 28 GB for 7B
    parameters), which defeats the sharding; one reduce-scatter per layer per micro-step is the price of not doing
    that. The sum is the same either way (the reduction is linear); only its rounding order differs. Nothing for a
    plain module."""
    if enabled or not hasattr(root, "no_sync"):
        yield
        return
    with root.no_sync():
        yield


@contextlib.contextmanager
def gathered(root: torch.nn.Module) -> Iterator[None]:
    """Inside: every FSDP2 module of ``root`` holds its full parameters and keeps them through its forwards, so a rank
    can run the model alone (generation: each rank decodes its own rows, a different number of steps); resharded
    on exit. The all-gathers walk the modules in the same order on every rank. Nothing for a module FSDP2 does not
    shard (one process, DDP)."""
    from torch.distributed.fsdp import FSDPModule

    mods = [m for m in root.modules() if isinstance(m, FSDPModule)]
    if not mods:
        yield
        return
    mods[0]._get_fsdp_state()._lazy_init()  # what the root's first forward does: FSDP requires the root first
    saved = []
    for m in mods:
        m.unshard()
        state = m._get_fsdp_state()  # reshard_after_forward as it was (the root's is set by FSDP at its first forward)
        saved.append(
            (m, state._auto_reshard_after_forward, [g.post_forward_mesh_info for g in state._fsdp_param_groups])
        )
        m.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for m, auto, infos in saved:
            state = m._get_fsdp_state()
            state._auto_reshard_after_forward = auto
            for group, info in zip(state._fsdp_param_groups, infos):
                group.post_forward_mesh_info = info
            m.reshard()


def full_state_dict(root: torch.nn.Module, comm: Comm) -> dict[str, torch.Tensor] | None:
    """The wrapped model's whole state dict, gathered onto rank 0's CPU (keys as ``root.model.state_dict()``), when
    FSDP2 shards it (a collective every rank makes; None on the other ranks); None when the model is not sharded
    (one process, DDP: every rank holds it whole)."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(root, FSDPModule):
        return None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(root, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not comm.is_main:
        return None
    return {k.removeprefix("model."): v for k, v in state.items()}
