"""Loading a run's config: a YAML file (or one shipped with the package) plus ``key=value`` overrides, validated
into a :class:`PipelineConfig`; credentials are refused by name."""

from __future__ import annotations

import re
import time
from importlib.resources import files
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from grpoflow.tasks.config.base import ConfigError
from grpoflow.tasks.config.pipeline import PipelineConfig
from grpoflow.tasks.config.secrets import redact, uri_credentials
from grpoflow.tasks.config.trl_keys import merge_trl_section

PACKAGED_CONFIGS = files("grpoflow.configs")  # configs/*.yaml, shipped with the package
DEFAULT_CONFIG = Path(str(PACKAGED_CONFIGS / "default.yaml"))


def packaged_configs() -> list[str]:
    """Names of the configs shipped with the package (configs/*.yaml)."""
    return sorted(p.name for p in PACKAGED_CONFIGS.iterdir() if p.name.endswith(".yaml"))


def resolve_config_path(config: str | Path | None) -> Path:
    """A config file: an existing path as given; else one shipped with the package named by its file name, with or
    without the folder and suffix (``configs/default.yaml``, ``default.yaml`` and ``default`` all name it), so
    ``grpoflow run configs/gsm8k-qwen2.5-0.5b.yaml`` works from any folder; None is the default config."""
    if config is None:
        return DEFAULT_CONFIG
    path = Path(config).expanduser()
    if path.is_file():
        return path
    name = path.name if path.suffix in (".yaml", ".yml") else f"{path.name}.yaml"
    packaged = PACKAGED_CONFIGS / name
    if packaged.is_file() and (len(path.parts) == 1 or path.parent.name == "configs"):
        return Path(str(packaged))
    raise ConfigError(f"config file not found: {config} (packaged configs: {', '.join(packaged_configs())})")


def parse_override(item: str) -> tuple[list[str], Any]:
    """'grpo.beta=0.04' -> (['grpo', 'beta'], 0.04); the value is parsed as YAML."""
    if "=" not in item:
        raise ConfigError(f"override {item!r}: expected key=value, e.g. grpo.beta=0.04")
    key, raw = item.split("=", 1)
    path = [p for p in key.strip().split(".") if p]
    if not path:
        raise ConfigError(f"override {item!r}: empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"override {key}: cannot parse value {raw!r}: {e}") from None
    return path, value


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for item in overrides:
        path, value = parse_override(item)
        node = raw
        for i, part in enumerate(path[:-1]):
            nxt = node.setdefault(part, {})
            if not isinstance(nxt, dict):
                raise ConfigError(f"override {item!r}: {'.'.join(path[: i + 1])} is not a section")
            node = nxt
        node[path[-1]] = value
    return raw


def _format_error(err: ValidationError, sources: dict[str, str] | None = None) -> str:
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "<root>"
        if sources and key in sources:  # a value the trl: section set
            key = f"{key} (from trl.{sources[key]})"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        elif "input" in e and e["type"] not in ("missing",) and not isinstance(e["input"], dict):
            got = f"(got {e['input']!r})"
            msg = msg if msg.endswith(got) or f"(got {e['input']})" in msg else f"{msg} {got}"
        lines.append(f"  {key}: {msg}")
    return "invalid config:\n" + "\n".join(lines)


# Credentials come from the AWS chain (env, ~/.aws), never from the config, which is logged to MLflow and saved
# in the workspace: a key that looks like one, or a URI with credentials in it (tasks/config/secrets.py), is refused.
_CREDENTIAL_KEY = re.compile(
    r"(^|_)(secret|secret_key|password|passwd|credentials?|api_key|access_key|access_key_id|session_token|"
    r"auth_token|hf_token)$|^token$"
)


def _reject_credentials(node: Any, path: str = "") -> None:
    if not isinstance(node, dict):
        return
    for k, v in node.items():
        key = f"{path}{k}"
        if _CREDENTIAL_KEY.search(str(k).lower()):
            raise ConfigError(
                f"{key}: credentials do not belong in the config (it is logged to MLflow and saved with the run); "
                "use the standard AWS chain instead: AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, or AWS_PROFILE with "
                "~/.aws/credentials (MLflow servers: MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD)"
            )
        if isinstance(v, str) and (what := uri_credentials(v)):
            raise ConfigError(
                f"{key}: holds {what} in the URI ({redact(v)}); credentials do not belong in the config "
                "(for an MLflow server use MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD, or "
                "MLFLOW_TRACKING_TOKEN)"
            )
        _reject_credentials(v, f"{key}.")


def _world_size(raw: dict[str, Any]) -> int:
    """distributed.nproc_per_node * nnodes of a raw config (1 when unset or malformed: validation reports those), so
    the grpo section checks that its round splits over that many processes, as TRL's GRPOConfig does."""
    d = raw.get("distributed") if isinstance(raw, dict) else None
    d = d if isinstance(d, dict) else {}
    n, nodes = d.get("nproc_per_node", 1), d.get("nnodes", 1)
    ok = all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in (n, nodes))
    return n * nodes if ok else 1


def config_from_dict(raw: dict[str, Any]) -> PipelineConfig:
    """Validate a run config; its ``trl:`` section (TRL GRPOConfig keys, tasks/config/trl_keys.py) is translated
    into our sections first."""
    _reject_credentials(raw)
    raw, sources = merge_trl_section(raw)
    try:
        return PipelineConfig.model_validate(raw, context={"num_processes": _world_size(raw)})
    except ValidationError as err:
        raise ConfigError(_format_error(err, sources)) from None


def config_to_json(cfg: PipelineConfig) -> dict[str, Any]:
    """The process boundary, outward: ``cfg`` as JSON data for another process to read with
    :func:`config_from_json` (a torchrun worker's or a TrainJob pod's launch spec). Within one process the typed
    config is passed as it is (the CLI, the flows, the Prefect stage tasks and the stage shell all take a
    :class:`PipelineConfig`); this and :func:`config_from_json` are the only conversions on its way."""
    return cfg.to_dict()


def config_from_json(raw: dict[str, Any]) -> PipelineConfig:
    """The process boundary, inward: the config another process wrote with :func:`config_to_json`, validated
    again here (the same checks as a config file's)."""
    return config_from_dict(raw)


def load_config(
    path: str | Path | None = None, overrides: list[str] | None = None, trl_config: str | Path | None = None
) -> PipelineConfig:
    """Read a YAML config (the embedded default when path is None), add a TRL GRPOConfig file to its ``trl:``
    section, apply key=value overrides, validate."""
    path = resolve_config_path(path)
    raw = _read_mapping(path, "the top level must be a mapping of sections")
    if trl_config is not None:
        raw = _with_trl_file(raw, Path(trl_config).expanduser())
    return config_from_dict(apply_overrides(raw, list(overrides or [])))


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a key given twice in one mapping: YAML keeps the last, so a second ``grpo:``
    block silently dropped every key of the first (learning_rate, reward_funcs back to their defaults)."""


def _unique_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        line = key_node.start_mark.line + 1
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None,
                None,
                f"key {key!r} given twice (lines {seen[key]} and {line}): merge the two",
                key_node.start_mark,
            )
        seen[key] = line
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)


def _read_mapping(path: Path, what: str) -> dict[str, Any]:
    try:
        raw = yaml.load(path.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader) or {}  # noqa: S506 - a SafeLoader
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason}); save it as UTF-8") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: {what}")
    return raw


def _with_trl_file(raw: dict[str, Any], path: Path) -> dict[str, Any]:
    """``--trl-config FILE``: a flat YAML/JSON mapping of TRL GRPOConfig keys (a TRL config as TRL's own CLI reads
    it, or a dumped GRPOConfig) joins the config's ``trl:`` section; a key in both with different values is an
    error naming the file."""
    trl = _read_mapping(path, "a TRL config file must be a mapping of GRPOConfig keys")
    section = dict(raw.get("trl") or {})
    for key, value in trl.items():
        if key in section and section[key] != value:
            raise ConfigError(f"trl.{key}: {path} sets {value!r}, the config's trl: section {section[key]!r}")
        section[key] = value
    return {**raw, "trl": section}


def load_run_config(
    config: str | None, overrides: list[str] | None = None, name: bool = True, trl_config: str | None = None
) -> PipelineConfig:
    """The config of a run, as `grpoflow run` and the deployed flows read it: CONFIG (default: the embedded one)
    plus key=value overrides (a first argument with "=" that is no file is an override); run.name defaults to
    run-<time>."""
    overrides = list(overrides or [])
    if config and "=" in config and not Path(config).exists():  # `grpoflow run key=value` without a file
        overrides.insert(0, config)
        config = None
    cfg = load_config(config, overrides, trl_config)
    if name and cfg.run.name is None:
        cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"name": time.strftime("run-%Y%m%d-%H%M%S")})})
    return cfg
