"""Stage keys recorded before every file was hashed: recognised while they still hold, then adopted.

Older grpoflow named files over 64 MiB (model weights) by size + mtime_ns in the content part of a fingerprint
(tasks/storage/content.py). Today's key of the same stage differs, so without this every finished run with a local
model folder would rerun from scratch after the upgrade. Instead the keys are recomputed the old way
(content.legacy_digests, only when some file is that large): a manifest or attempt record holding the old key of a
stage counts as holding its current key (:func:`legacy_fingerprints`: `grpoflow resume` and `grpoflow run` say
nothing reruns, a raised grpo.max_steps continues), and when the stage shell meets it, it rewrites the record with
the current key and fingerprint (:func:`adopt_legacy_keys`), once. Only after that is the run safe to move: an old
key can only be checked against the mtimes it recorded, so a run moved (or its model folder restored) before any
stage of it ran with this version reruns the stages that read the big files, once.
"""

from __future__ import annotations

import logging
from typing import Any

from grpoflow.tasks.config import PipelineConfig
from grpoflow.tasks.pipeline.fingerprint import continue_key, fingerprints, key_of
from grpoflow.tasks.pipeline.spec import Pipeline
from grpoflow.tasks.storage.content import LEGACY_LIMIT, legacy_digests
from grpoflow.tasks.storage.workspace import CorruptManifest, Workspace

log = logging.getLogger(__name__)


def _has_big_files(fps: dict[str, dict[str, Any]]) -> bool:
    """Whether a fingerprint names a hashed file over LEGACY_LIMIT (the only files an older key named otherwise)."""
    return any(
        "sha256" in d and d.get("size", 0) > LEGACY_LIMIT
        for fp in fps.values()
        for files in fp["content"].values()
        for d in files.values()
    )


def legacy_fingerprints(pipeline: Pipeline, cfg: PipelineConfig, fps: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """{stage: the fingerprint an older grpoflow made} for each keyed spec whose key that way differs from its key
    in ``fps`` (today's fingerprints); {} when no file is big enough to differ."""
    if not _has_big_files(fps):
        return {}
    with legacy_digests():
        old = fingerprints(pipeline, cfg)
    return {name: fp for name, fp in old.items() if key_of(fp) != key_of(fps[name])}


def legacy_key(old: dict[str, Any], name: str) -> str | None:
    """The old key of stage ``name`` in ``old`` (:func:`legacy_fingerprints`); None when it has none."""
    return key_of(old[name]) if name in old else None


def legacy_continue_key(pipeline: Pipeline, old: dict[str, Any], name: str) -> str | None:
    """The old continue key of stage ``name`` (fingerprint.continue_key); None when it has none."""
    spec = pipeline[name]
    return continue_key(old[name], spec.extends) if name in old and spec.extends else None


def _holds_another_key(ws: Workspace, stage: str, key: str) -> bool:
    """Whether the stage's manifest or attempt record holds a key other than ``key`` (maybe an older one)."""
    try:
        manifest = ws.read_manifest(stage) or {}
    except CorruptManifest:
        manifest = {}
    return bool({manifest.get("key"), ws.last_attempt(stage).get("key")} - {None, key})


def adopt_legacy_keys(
    pipeline: Pipeline,
    cfg: PipelineConfig,
    ws: Workspace,
    stages: tuple[str, ...] | None = None,
    fps: dict[str, dict[str, Any]] | None = None,
) -> list[str]:
    """Rewrite the manifest and attempt record of each of ``stages`` (default: every keyed spec) that holds its old
    key with today's key and fingerprint (and continue key); the names of those rewritten. Their summary and files
    are kept: the content they were made from is the same (its size and mtime still match). ``fps``: today's
    fingerprints, when the caller has them."""
    fps = fps if fps is not None else fingerprints(pipeline, cfg)
    wanted = [s for s in (stages if stages is not None else pipeline.names) if s in fps]
    if not _has_big_files(fps) or not any(_holds_another_key(ws, s, key_of(fps[s])) for s in wanted):
        return []  # nothing an older key could name: the old-way fingerprints (a rehash, S3 lists) are not needed
    old = legacy_fingerprints(pipeline, cfg, fps)
    done = []
    for name in [s for s in wanted if s in old]:
        spec = pipeline[name]
        new_continues = continue_key(fps[name], spec.extends) if spec.extends else None
        keys = (key_of(old[name]), key_of(fps[name]))
        continues = (legacy_continue_key(pipeline, old, name), new_continues)
        if ws.rekey(name, keys, continues, {"fingerprint": fps[name]}):
            log.info("stage %s: key %s adopted as %s (big files now named by sha256)", name, keys[0][:12], keys[1][:12])
            done.append(name)
    return done
