"""The vLLM engine of one rank of a distributed GRPO run (tasks/generation/vllm_engine.py holds the engine itself).

Each rank runs its own co-located engine (tensor parallel 1) and samples only the rows of the round it owns
(tasks/grpo/distributed.py ``local_rows``). What changes from one process, and why:

- Executor: ``distributed_executor_backend="external_launcher"`` (what TRL's colocate mode passes). vLLM then
  joins the default group the trainer initialized from torchrun's environment (its ``init_distributed_environment``
  keeps an initialized group; the worker's rank and device come from RANK and LOCAL_RANK), and builds
  its model-parallel groups over it: with tensor parallel 1 every rank is a group of its own, so the engines
  never wait for each other while generating. Starting the engines is collective (``new_group``): every rank
  starts its engine at the same point. ``uni`` is for one process: it gives its worker rank 0 and the device
  index of its config (vllm/v1/executor/uniproc_executor.py ``_distributed_args``: cuda:0 on every rank), where
  ``external_launcher`` reads RANK and LOCAL_RANK.
- Seeds: each completion is one request seeded by its row of the round (``row_seed``: run seed, round, row), so
  a completion does not depend on the world size, on which rank drew it, or on the other requests of its batch
  (vLLM draws a seeded request's tokens from the request's own torch.Generator).
- Weight sync: decided from the trainer's optimizer step (the same on every rank), never from per-rank tensor
  versions; under FSDP2 every parameter is gathered with ``full_tensor()`` (a collective) as the sync walks
  them, in ``named_parameters`` order, which is the same on every rank (:func:`full`).
- Shutdown: vLLM's ``EngineCore.shutdown`` ends with ``cleanup_dist_env_and_memory``, which destroys the default
  process group (vllm/distributed/parallel_state.py ``destroy_distributed_environment``): a rank closes its engine
  only after its last collective (tasks/stages/grpo.py).
"""

from __future__ import annotations

import os

import torch


def launcher_world() -> int:
    """Processes in the initialized default torch.distributed group (1 when there is none). With several, the
    engine needs the RANK and LOCAL_RANK that torchrun sets (vLLM's external_launcher executor reads them)."""
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if world > 1 and not {"RANK", "LOCAL_RANK"} <= os.environ.keys():
        raise RuntimeError(
            f"generation.backend=vllm in a group of {world} processes needs the RANK and LOCAL_RANK environment "
            "variables torchrun sets (vLLM's external_launcher executor reads them)"
        )
    return world


def executor_backend(world: int) -> str:
    """vLLM's executor for an engine co-located in a process of a ``world``-process group: ``uni`` alone (the
    engine sets up its own one-process group), ``external_launcher`` inside torchrun's group."""
    return "uni" if world == 1 else "external_launcher"


def full(t: torch.Tensor) -> torch.Tensor:
    """``t`` whole: a DTensor (an FSDP2 shard) gathered with ``full_tensor()``, a collective every rank makes in the
    same order; any other tensor as it is."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def row_requests(prompts: list[list[int]], n: int, row_seeds: list[int]) -> list[tuple[list[int], int]]:
    """(prompt ids, seed) of each request when every completion is its own request: ``n`` per prompt, prompt-major,
    completion i seeded with ``row_seeds[i]``."""
    expanded = [p for p in prompts for _ in range(n)]
    if len(row_seeds) != len(expanded):
        raise ValueError(f"row_seeds: {len(row_seeds)} seeds for {len(expanded)} completions")
    return list(zip(expanded, row_seeds))
