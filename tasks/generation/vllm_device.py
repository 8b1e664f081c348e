"""Where the co-located vLLM engine runs, and what starting and waking it does to the trainer's process
(tasks/generation/vllm_engine.py holds the engine itself).

- The GPU. vLLM's uni-process worker picks its GPU from its local rank, 0 in one process, and makes it torch's
  current device when it starts (vllm/v1/executor/uniproc_executor.py ``_distributed_args``,
  vllm/v1/worker/gpu_worker.py ``init_device``: ``torch.accelerator.set_device_index``). Left alone, an engine
  next to a model on cuda:1 loads onto cuda:0 and leaves cuda:0 current for the trainer. vLLM >= 0.32 takes
  ``device_ids`` (EngineArgs; vllm PR #45026): the GPUs its local ranks map to, as indices into the visible
  devices, so ``device_ids=[N]`` puts the one-process engine on cuda:N (:func:`placement_kwargs`). Under torchrun
  (``external_launcher``) the worker takes LOCAL_RANK's GPU itself, the one the trainer's process took.
  Whatever vLLM sets, the trainer's current device is restored after the start (:func:`keep_current_device`).
- The process state. Constructing an engine reseeds the global RNGs and, on the CPU backend, replaces
  ``torch.set_num_threads`` with a no-op: :func:`keep_process_state` undoes both.
- Waking up. After a training step the caching allocator still holds the step's freed blocks; the engine's
  wake-up allocates its weights and KV cache through its own allocator, beside them. :func:`release_cached_blocks`
  hands them back to the driver first (TRL 1.16 does the same before waking the weights).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
import torch


def engine_device(platform_is_cpu: bool, model_device: torch.device, current_index: Callable[[], int]) -> str:
    """The engine's device as a string: "cpu" on vLLM's CPU platform; else the GPU the model is on ("cuda:N"), or
    the current GPU for a model that is not on one."""
    if platform_is_cpu:
        return "cpu"
    index = model_device.index if model_device.type == "cuda" and model_device.index is not None else current_index()
    return f"cuda:{index}"


def cuda_index(device: str) -> int | None:
    """N of "cuda:N"; None for "cpu" or a bare "cuda"."""
    kind, _, index = device.partition(":")
    return int(index) if kind == "cuda" and index else None


def placement_kwargs(device: str, world: int, has_device_ids: bool) -> dict:
    """The ``vllm.LLM`` arguments that place a one-process engine on ``device``: ``device_ids=[N]`` for "cuda:N"
    (nothing on CPU, nor under torchrun, where vLLM's worker takes LOCAL_RANK's GPU). A vLLM without
    ``device_ids`` can only run on cuda:0 in one process: any other GPU is refused, naming run.device."""
    index = cuda_index(device)
    if world > 1 or index is None:
        return {}
    if has_device_ids:
        return {"device_ids": [index]}
    if index == 0:
        return {}
    raise ValueError(
        f"run.device: the model is on {device}, and this vLLM has no device_ids argument (vLLM >= 0.32): its "
        "one-process engine would load onto cuda:0; upgrade vLLM, or select the GPU with CUDA_VISIBLE_DEVICES and "
        "run.device=cuda"
    )


def vllm_has_device_ids() -> bool:
    """Whether the installed vLLM's EngineArgs takes ``device_ids``."""
    from vllm.engine.arg_utils import EngineArgs

    return "device_ids" in {f.name for f in dataclasses.fields(EngineArgs)}


@contextmanager
def keep_current_device(
    enabled: bool | None = None,
    current_index: Callable[[], int] = torch.cuda.current_device,
    set_device: Callable[[int], None] = torch.cuda.set_device,
) -> Iterator[None]:
    """Inside: anything may change torch's current CUDA device (vLLM's worker sets its own when it starts); on exit,
    error or not, the device that was current is current again. ``enabled`` None: when torch sees CUDA."""
    if not (torch.cuda.is_available() if enabled is None else enabled):
        yield
        return
    index = current_index()
    try:
        yield
    finally:
        set_device(index)


@contextmanager
def keep_process_state() -> Iterator[None]:
    """Undo what constructing a vLLM engine does to the process: reseeded RNGs, torch thread count
    (and, on the CPU backend, a torch.set_num_threads replaced by a no-op)."""
    set_threads, threads = torch.set_num_threads, torch.get_num_threads()
    states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        torch.set_num_threads = set_threads
        torch.set_num_threads(threads)
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)


def release_cached_blocks(device: str) -> None:
    """Return the caching allocator's free blocks to the driver before the engine wakes (CUDA only; the CPU
    backend has no sleep mode)."""
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
