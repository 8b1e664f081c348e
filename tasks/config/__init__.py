"""Configuration: typed, frozen pydantic sections, loaded from YAML plus overrides. Imports no other part of
grpoflow: storage settings are a plain section here, and the code that uses them (tasks/storage/s3.py) takes them as
an argument."""

from grpoflow.tasks.config.base import ConfigError
from grpoflow.tasks.config.distributed import DistributedConfig
from grpoflow.tasks.config.load import (
    DEFAULT_CONFIG,
    apply_overrides,
    config_from_dict,
    config_from_json,
    config_to_json,
    load_config,
    load_run_config,
    packaged_configs,
    parse_override,
    resolve_config_path,
)
from grpoflow.tasks.config.model import LoraConfig, ModelConfig, TinyModelConfig
from grpoflow.tasks.config.pipeline import (
    DEVICE_PATTERN,
    GSM8K_SYSTEM_PROMPT,
    ArithmeticConfig,
    DataConfig,
    EvalConfig,
    ExportConfig,
    GenerationConfig,
    PipelineConfig,
    RunConfig,
    TrackingConfig,
    resolve_eval_size,
)
from grpoflow.tasks.config.storage import StorageConfig
from grpoflow.tasks.config.training import Batching, CodeRewardConfig, GRPOConfig, ScaleRewards, SFTConfig

__all__ = [
    "DEFAULT_CONFIG",
    "DEVICE_PATTERN",
    "GSM8K_SYSTEM_PROMPT",
    "ArithmeticConfig",
    "Batching",
    "ConfigError",
    "DataConfig",
    "DistributedConfig",
    "EvalConfig",
    "ExportConfig",
    "CodeRewardConfig",
    "GRPOConfig",
    "GenerationConfig",
    "LoraConfig",
    "ModelConfig",
    "PipelineConfig",
    "RunConfig",
    "SFTConfig",
    "ScaleRewards",
    "StorageConfig",
    "TinyModelConfig",
    "TrackingConfig",
    "apply_overrides",
    "config_from_dict",
    "config_from_json",
    "config_to_json",
    "load_config",
    "load_run_config",
    "packaged_configs",
    "parse_override",
    "resolve_config_path",
    "resolve_eval_size",
]
