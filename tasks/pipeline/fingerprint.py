"""A stage's fingerprint: everything its result depends on, and the key derived from it.

    fingerprint(stage) = {
        "stage":    stage.name,
        "config":   {path: keyed_values(cfg at path) for path in stage.keys},     # IGNORED fields left out
        "upstream": {name: key(name) for name in stage.upstream(cfg)},
        "content":  {label: digest for reader in stage.reads for label, digest in reader(cfg).items()},
    }
    key(stage) = sha256(json(fingerprint(stage), sort_keys=True))

``keyed_values`` and IGNORED (the one list of fields that cannot change a result) are in
tasks/config/fingerprint.py. The content digests (tasks/storage/content.py) are:

    data.source, data.eval_source   a local file or folder: {file: size + sha256}; s3://: {object: size + ETag};
                                    a hub id or builtin source: none (the config names it)
    model.name                      a local model folder or .gguf file: {file: size + sha256}, every file hashed
                                    (its sha256 cached per machine for files of 64 MiB or more: a copy with new
                                    mtimes keeps the key); a hub id: none (model.revision is in the config,
                                    pinned to a commit when the run starts: tasks/pipeline/revision.py)
    model.warm_start                the folder GRPO starts from (the continuous flow's champion), as model.name
    reward <module>                 the source files (size + sha256) of each custom reward module of
                                    grpo.reward_funcs (``module:function`` entries): its own file (named by its
                                    file name) and the local files it imports (named by their path under the
                                    module's sys.path entry; tasks/pipeline/imports.py)
    grpo.reward_files               what the rewards read (a rubric, a word list): a file {path: size + sha256},
                                    a folder or s3:// prefix {path/name: digest} of each of its files

A changed key changes every downstream key. The code version of grpoflow itself is not in the key. The manifest of
a published stage records its fingerprint, so :func:`explain` can say what changed since. Keys recorded before big
files were hashed (size + mtime_ns over 64 MiB), or before a reward module's imports were keyed (its own file
only), are recognised and adopted by tasks/pipeline/legacy.py.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from grpoflow.tasks.config import PipelineConfig
from grpoflow.tasks.config.fingerprint import digest, section_value
from grpoflow.tasks.pipeline.imports import imported_sources
from grpoflow.tasks.pipeline.spec import Pipeline, StageSpec
from grpoflow.tasks.storage.content import file_digest, path_digest, source_digest
from grpoflow.tasks.storage.s3_uri import is_s3_uri, split_s3_uri


# ------------------------------------------------------------------ content readers (a StageSpec's ``reads``)
def data_files(cfg: PipelineConfig) -> dict[str, Any]:
    """The content of data.source and data.eval_source when they are local paths or s3:// URIs."""
    out = {}
    for label, source in (("data.source", cfg.data.source), ("data.eval_source", cfg.data.eval_source)):
        if source and (found := source_digest(source, cfg.storage)) is not None:
            out[label] = found
    return out


def model_files(cfg: PipelineConfig) -> dict[str, Any]:
    """The content of model.name when it is a local folder or .gguf file, and of model.warm_start (the folder GRPO
    starts from) when it is set."""
    out = {}
    path = Path(cfg.model.name).expanduser()
    if cfg.model.name != "tiny" and (path.is_dir() or (path.is_file() and path.suffix.lower() == ".gguf")):
        out["model.name"] = path_digest(path, cfg.storage.cache_dir)
    if cfg.model.warm_start is not None and (start := Path(cfg.model.warm_start).expanduser()).is_dir():
        out["model.warm_start"] = path_digest(start, cfg.storage.cache_dir)
    return out


def reward_module_file(module: str) -> Path | None:
    """The source file of a reward module, found as importing it would find it; None when there is none."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    origin = getattr(spec, "origin", None)
    return Path(origin) if origin and Path(origin).is_file() else None


_OWN_FILE_ONLY = contextvars.ContextVar("grpoflow_reward_own_file_only", default=False)


@contextlib.contextmanager
def reward_files_only() -> Iterator[None]:
    """Within it, a reward module is keyed by its own file only, as older grpoflow did (tasks/pipeline/legacy.py)."""
    token = _OWN_FILE_ONLY.set(True)
    try:
        yield
    finally:
        _OWN_FILE_ONLY.reset(token)


def reward_modules(cfg: PipelineConfig) -> dict[str, Any]:
    """The source files of each custom reward module of grpo.reward_funcs (``module:function`` entries): its own
    file, by its name (not its folder: a moved run keeps its key), and each local file it imports, by its path
    under the module's sys.path entry (tasks/pipeline/imports.py)."""
    out = {}
    for entry in cfg.grpo.reward_funcs:
        module = entry.partition(":")[0] if ":" in entry else None
        if not module or (path := reward_module_file(module)) is None:
            continue
        files = {path.name: file_digest(path)}
        for name, found in ({} if _OWN_FILE_ONLY.get() else imported_sources(module, path)).items():
            files[name if name != path.name else f"./{name}"] = file_digest(found)  # a helper named as the module
        out[f"reward {module}"] = files
    return out


def reward_files(cfg: PipelineConfig) -> dict[str, Any]:
    """The content of grpo.reward_files (what the custom rewards read): {path: digest} of a file, {path/name:
    digest} of each file of a folder or S3 prefix, under one label. A path that is gone is a ValueError naming it
    (`grpoflow run` and `resume` refuse it before any stage)."""
    if problem := missing_reward_file(cfg):
        raise ValueError(problem)
    files: dict[str, Any] = {}
    for path in cfg.grpo.reward_files:
        found = source_digest(path, cfg.storage) or {}
        if is_s3_uri(path):  # an object or every object under a prefix, named by its key in the bucket
            bucket = split_s3_uri(path)[0]
            files.update({f"s3://{bucket}/{name}": digest for name, digest in found.items()})
        elif Path(path).expanduser().is_file():
            files[path] = next(iter(found.values()))
        else:
            files.update({f"{path.rstrip('/')}/{name}": digest for name, digest in found.items()})
    return {"grpo.reward_files": files} if files else {}


def missing_reward_file(cfg: PipelineConfig) -> str | None:
    """The first local grpo.reward_files entry that does not exist, as the error naming it and where it was looked
    for; None when every one does (an s3:// entry is checked when it is read)."""
    for path in cfg.grpo.reward_files:
        if not is_s3_uri(path) and not (where := Path(path).expanduser()).exists():
            return f"grpo.reward_files: {path}: no such file or folder (looked at {where.absolute()})"
    return None


# ------------------------------------------------------------------ fingerprints and keys
def fingerprint(spec: StageSpec, cfg: PipelineConfig, keys: dict[str, str]) -> dict[str, Any]:
    """The fingerprint of ``spec`` (the module docstring's formula); ``keys`` holds its upstream stages' keys."""
    return {
        "stage": spec.name,
        "config": {path: section_value(cfg, path) for path in spec.keys},
        "upstream": {name: keys[name] for name in spec.upstream(cfg)},
        "content": {label: found for reader in spec.reads for label, found in reader(cfg).items()},
    }


def key_of(fp: dict[str, Any]) -> str:
    """A stage's key: sha256 of its fingerprint."""
    return digest(fp)


def fingerprints(pipeline: Pipeline, cfg: PipelineConfig) -> dict[str, dict[str, Any]]:
    """The fingerprint of every keyed spec of ``pipeline`` (stages in order, then the loose folders)."""
    fps: dict[str, dict[str, Any]] = {}
    keys: dict[str, str] = {}
    for spec in pipeline.keyed():
        fps[spec.name] = fingerprint(spec, cfg, keys)
        keys[spec.name] = key_of(fps[spec.name])
    return fps


def continue_key(fp: dict[str, Any], extends: tuple[str, ...]) -> str:
    """The key of fingerprint ``fp`` without the ``extends`` fields (a StageSpec's): two attempts with one
    continue_key differ at most in how far they go, so the later one may continue the earlier one's files."""
    fp = copy.deepcopy(fp)
    for path in extends:
        for key, value in fp["config"].items():
            if path == key:
                fp["config"][key] = None
            elif path.startswith(key + ".") and isinstance(value, dict):
                *parents, last = path[len(key) + 1 :].split(".")
                for name in parents:
                    value = value.get(name, {})
                value.pop(last, None)
    return digest(fp)


def extents(spec: StageSpec, cfg: PipelineConfig) -> dict[str, Any]:
    """{path: value} of the spec's ``extends`` fields in ``cfg`` (how far a run of it goes)."""
    return {path: section_value(cfg, path) for path in spec.extends}


def stage_keys(pipeline: Pipeline, cfg: PipelineConfig) -> dict[str, str]:
    """{stage: key} of every keyed spec of ``pipeline``."""
    return {name: key_of(fp) for name, fp in fingerprints(pipeline, cfg).items()}
