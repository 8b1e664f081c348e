"""The one list of config fields that do not change a result, and the digest of a config without them.

A stage key (tasks/pipeline/fingerprint.py), the MLflow ``config_hash`` tag (tasks/tracking/run_meta.py) and the
GRPO checkpoint's compatibility hash (tasks/grpo/trainer.py) all hash config values through :func:`keyed_values`,
so they agree on what "the same config" means. A field belongs in :data:`IGNORED` only when it cannot change a
sampled token or a weight: logging cadence, where the run lives, tracking, storage, resume policy, and the
plumbing of distributed processes (addresses, ports, timeouts, launcher). Thread counts and batch sizes are NOT
here: they change the order of floating-point sums, and so the sampled completions (measured). Nor is
``generation.compile``: compiled kernels sum in another order too (log-probs agree to ~1e-6, not bit for bit).

The list is typed per config class and checked against each class's ``model_fields`` at import: a renamed or
removed field raises here instead of silently dropping out of (or into) every key.

A field added after runs recorded their keys goes in :data:`ADDED` with the value that behaves as before it
existed: while it holds that value it is left out of the key, so upgrading grpoflow reruns no finished stage of
an existing run (a key holds every field of a section, so any new field would change it); set to anything else
it is keyed like any other field. Checked at import too, against each field's default.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pydantic import BaseModel
from pydantic_core import to_jsonable_python

from grpoflow.tasks.config.distributed import DistributedConfig
from grpoflow.tasks.config.model import ModelConfig
from grpoflow.tasks.config.pipeline import DataConfig, PipelineConfig, RunConfig
from grpoflow.tasks.config.training import CodeRewardConfig, GRPOConfig, OptimizerFields

# {config class: {field: why it cannot change a result}}; a class's entries apply to its subclasses too
IGNORED: dict[type[BaseModel], dict[str, str]] = {
    PipelineConfig: {
        "tracking": "where and how runs are logged (MLflow), not what is computed",
        "storage": "where the workspace's files are stored (S3 endpoint, local mirror, retries)",
    },
    RunConfig: {
        "name": "the workspace's name: where the run lives",
        "output_dir": "the folder or bucket that holds the workspace: where the run lives",
    },
    ModelConfig: {"cache_dir": "where downloaded weights are cached, not which weights"},
    OptimizerFields: {"logging_steps": "how often metrics are logged"},
    GRPOConfig: {
        "save_steps": "how often checkpoints are written; a resumed run continues bit-for-bit from one",
        "log_completions": "whether sampled completions are logged as a table",
        "resume": "whether a killed stage continues from its checkpoint (resume policy)",
        "reward_timeout_s": "a reward over the bound fails the stage; a completed stage scored the same",
    },
    DistributedConfig: {
        "timeout_s": "how long processes wait for each other before giving up",
        "node_rank": "which node this process is: set per node by the launcher",
        "rdzv_endpoint": "where the processes meet",
        "master_addr": "where the processes meet",
        "master_port": "where the processes meet",
        "launcher": "how the processes are started (torchrun or a Kubeflow TrainJob)",
        "trainjob": "where a TrainJob's pods run (namespace, image, polling)",
    },
}


# {config class: {field added after keys were first recorded: (the value that keys as before it existed, why)}}
ADDED: dict[type[BaseModel], dict[str, tuple[Any, str]]] = {
    GRPOConfig: {
        "reward_files": ([], "no data file of the rewards keyed, as before the field"),
    },
    DataConfig: {
        "revision": (None, "a hub dataset read at its default branch, as every run did before the field"),
    },
    ModelConfig: {
        "warm_start": (None, "GRPO starts from model.name (or SFT's model), as every run did before the field"),
    },
    CodeRewardConfig: {
        "cpus": (1.0, "the per-run CPU cap; before it a run's processes shared the CPUs uncapped"),
    },
}


def _check() -> None:
    for table, listed in (("IGNORED", IGNORED), ("ADDED", ADDED)):
        for cls, fields in listed.items():
            unknown = sorted(set(fields) - set(cls.model_fields))
            if unknown:
                raise AttributeError(f"tasks/config/fingerprint.py {table}: {cls.__name__} has no field {unknown}")
    for cls, fields in ADDED.items():
        for name, (value, _) in fields.items():
            if cls.model_fields[name].default != value:
                raise AttributeError(
                    f"tasks/config/fingerprint.py ADDED: {cls.__name__}.{name} defaults to "
                    f"{cls.model_fields[name].default!r}, not {value!r}: every existing key would change"
                )


_check()


def ignored_fields(cls: type[BaseModel]) -> set[str]:
    """The fields of ``cls`` (its own and its bases') that no key sees."""
    return {name for base in cls.__mro__ for name in IGNORED.get(base, {})}


def added_at_default(model: BaseModel) -> set[str]:
    """The ADDED fields of ``model`` (its class's and its bases') that hold the value keyed as before they existed."""
    added = {name: value for base in type(model).__mro__ for name, (value, _) in ADDED.get(base, {}).items()}
    return {name for name, value in added.items() if getattr(model, name) == value}


def keyed_values(value: Any, exclude: frozenset[str] = frozenset()) -> Any:
    """``value`` as JSON-able data without the IGNORED fields of any config model in it, nor the ADDED ones at
    their old value (and without ``exclude``, fields of ``value`` itself when it is a model)."""
    if isinstance(value, BaseModel):
        skip = ignored_fields(type(value)) | added_at_default(value) | exclude
        return {name: keyed_values(getattr(value, name)) for name in type(value).model_fields if name not in skip}
    if isinstance(value, (list, tuple)):
        return [keyed_values(v) for v in value]
    if isinstance(value, dict):
        return {str(k): keyed_values(v) for k, v in value.items()}
    return to_jsonable_python(value)


def digest(value: Any) -> str:
    """sha256 (hex) of JSON-able ``value``, keys sorted."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


def config_digest(section: BaseModel, exclude: frozenset[str] = frozenset()) -> str:
    """sha256 of a config section's values that can change a result (:func:`keyed_values`)."""
    return digest(keyed_values(section, exclude))


def section_value(cfg: PipelineConfig, path: str) -> Any:
    """The config value at dotted ``path`` (e.g. ``run.seed``, ``model.tiny``), without IGNORED fields."""
    value: Any = cfg
    for name in path.split("."):
        value = getattr(value, name)
    return keyed_values(value)


def check_path(path: str) -> None:
    """Raise when dotted ``path`` names no field of PipelineConfig (a spec naming a renamed field)."""
    cls: Any = PipelineConfig
    for name in path.split("."):
        fields = getattr(cls, "model_fields", None)
        if fields is None or name not in fields:
            raise AttributeError(f"config path {path!r}: {getattr(cls, '__name__', cls)} has no field {name!r}")
        cls = fields[name].annotation
