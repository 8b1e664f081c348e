"""Whether a folder is a grpoflow run: what `grpoflow run`, `resume` and `sync` and the pipeline flow check before
they write into <output_dir>/<run name> (or RUN_DIR), so that a folder of another tool is refused, not emptied.

A grpoflow run folder holds the config.yaml grpoflow wrote (flows/pipeline.py: every section of the resolved
config, since the first version) and, once a stage started, its records: <stage>/attempt.json (the key of the
stage's latest attempt), <stage>/manifest.json (naming its stage, written when it finished) and run.json (the
MLflow parent run). A config.yaml is grpoflow's when it loads as a :class:`PipelineConfig`, or, written by an
earlier version whose keys no longer all load, when it is a mapping of grpoflow's config sections holding every
section grpoflow has always written. A folder whose config.yaml is neither, and that holds none of those records,
is some other tool's (a Hydra output folder, a project, notes): :func:`foreign_config` says why, and a run there
would empty its data/, sft/, grpo/, eval/ and export/ folders and overwrite the file.

:func:`run_folder_problem` adds the other half: a folder with no config.yaml that holds files (a lock file
aside). Both read through the store, so a local folder and an s3:// workspace are checked alike, and neither writes.
"""

from __future__ import annotations

import json
from typing import Any

import yaml

from grpoflow.tasks.config import PipelineConfig, config_from_dict
from grpoflow.tasks.storage.lock import LEASE, LOCK_FILE
from grpoflow.tasks.storage.store import S3Store, Store, join_location
from grpoflow.tasks.storage.workspace import ATTEMPT, MANIFEST

CONFIG = "config.yaml"
RUN_FILE = "run.json"  # the MLflow parent run of the workspace (tasks/pipeline/resume.py writes it)
WARM_START_FILE = "warm_start.json"  # the registry version of model.warm_start (resume.py warm_start_version)
STAGES = ("data", "sft", "grpo", "eval", "export")  # the stage folders a record may lie in (flows/stages.py)
# the sections of every config.yaml grpoflow has written (the first version's; later ones only added sections)
ALWAYS_WRITTEN = ("run", "data", "model", "sft", "grpo", "generation", "eval", "export", "tracking")
WOULD_EMPTY = "a run there would empty its data/, sft/, grpo/, eval/ and export/ folders"


def mirror_problem(store: Store) -> str | None:
    """Why a local RUN_DIR must not be run as a workspace of its own: it is the local copy of an s3:// workspace
    (<storage.cache_dir>/<bucket>/<key>). Run there, a pipeline beside the S3 run's own would write the same
    folder, and the S3 run's next pull would delete what it made. None for any other folder or an s3:// store."""
    if isinstance(store, S3Store):
        return None
    from grpoflow.tasks.storage.mirror import mirrored_uri

    uri = mirrored_uri(store.local_root)
    if uri is None:
        return None
    return (
        f"{store.local_root} is the local copy of the S3 workspace {uri} (storage.cache_dir): run it as "
        f"`grpoflow resume {uri}`, which keeps this copy and S3 in step"
    )


def config_problem(text: bytes) -> str | None:
    """Why ``text`` is no config.yaml grpoflow wrote (one short phrase), or None when it is one: it loads as a
    PipelineConfig, or it is a mapping of grpoflow's sections only that holds each of :data:`ALWAYS_WRITTEN`."""
    try:
        raw = yaml.safe_load(text)
    except (yaml.YAMLError, UnicodeDecodeError):
        return "not valid YAML"
    if not isinstance(raw, dict):
        return "not a mapping of config sections"
    try:
        config_from_dict(raw)
        return None
    except Exception:  # any reason it does not load: maybe an earlier version's config, its shape decides
        pass
    unknown = [str(k) for k in raw if k not in PipelineConfig.model_fields]
    if unknown:
        return f"top-level keys that are no config section: {', '.join(unknown[:3])}"
    if missing := [s for s in ALWAYS_WRITTEN if not isinstance(raw.get(s), dict)]:
        return f"no {', '.join(missing[:3])} section{'s' if len(missing) > 1 else ''}"
    return None


def _json(store: Store, name: str) -> dict[str, Any]:
    data = store.read(name)
    try:
        value = json.loads(data) if data else {}
    except (ValueError, UnicodeDecodeError):
        return {}
    return value if isinstance(value, dict) else {}


def has_run_records(store: Store) -> bool:
    """Whether the folder holds a record only grpoflow writes: run.json naming an MLflow run, a stage's
    manifest.json naming that stage, or its attempt.json holding a key."""
    if "mlflow_run_id" in _json(store, RUN_FILE):
        return True
    for stage in STAGES:
        if _json(store, f"{stage}/{MANIFEST}").get("stage") == stage:
            return True
        if isinstance(_json(store, f"{stage}/{ATTEMPT}").get("key"), str):
            return True
    return False


def foreign_config(store: Store) -> str | None:
    """When the folder's config.yaml is no grpoflow run's (:func:`config_problem`) and no record of a run is there
    (:func:`has_run_records`): what says so, naming the file (:data:`WOULD_EMPTY` says what a run would do
    there). None when there is no config.yaml, or the folder is a grpoflow run."""
    return _foreign(store, store.read(CONFIG))


def _foreign(store: Store, text: bytes | None) -> str | None:
    if text is None or (problem := config_problem(text)) is None or has_run_records(store):
        return None
    where = join_location(store.location, CONFIG)
    return f"{where} is no config grpoflow wrote ({problem}) and no grpoflow stage record is there"


def run_folder_problem(store: Store, config: bytes | None) -> str | None:
    """Why a run may not write into this folder, or None (a grpoflow run, an empty folder, none); ``config``: its
    config.yaml as the caller read it, None when absent. Its config.yaml is another tool's (:func:`foreign_config`),
    or it has none but holds files (its lock file aside): the stages would empty its data/, sft/, grpo/, eval/ and
    export/ folders."""
    if config is not None:
        foreign = _foreign(store, config)
        return f"{foreign}; {WOULD_EMPTY} and overwrite it" if foreign else None
    if other := [e.name for e in store.list("") if e.name not in (LOCK_FILE, LEASE)]:
        shown = ", ".join(other[:3]) + (f" and {len(other) - 3} more" if len(other) > 3 else "")
        return (
            f"{store.location} holds files of no grpoflow run ({shown}; no config.yaml); {WOULD_EMPTY} and write "
            "its config.yaml"
        )
    return None
