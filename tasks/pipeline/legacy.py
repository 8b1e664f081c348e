"""Stage keys older grpoflow computed another way: recognised while they still hold, then adopted.

Two ways (:data:`WAYS`), newest first:
- a custom reward module keyed by its own file only, before the local files it imports were keyed too
  (fingerprint.reward_files_only; it differs only for a module that imports such files);
- also files over 64 MiB (model weights) named by size + mtime_ns, before every file was hashed
  (content.legacy_digests; it differs only when some file is that large).
Today's key of the same stage differs, so without this every such finished run would rerun from scratch after the
upgrade. Instead the keys are recomputed each old way that can differ: a manifest or attempt record holding an old
key of a stage counts as holding its current key (:func:`legacy_fingerprints`: `grpoflow resume` and `grpoflow
run` say nothing reruns, a raised grpo.max_steps continues), and when the stage shell meets it, it rewrites the
record with the current key and fingerprint (:func:`adopt_legacy_keys`), once. An old key says nothing of what it
did not name: a helper edited before the upgrade is not seen, and a key with mtimes can only be checked against
the mtimes it recorded, so a run moved (or its model folder restored) before any stage of it ran with this
version reruns the stages that read the big files, once.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

from grpoflow.tasks.config import PipelineConfig
from grpoflow.tasks.pipeline.fingerprint import continue_key, fingerprints, key_of, reward_files_only
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


def _has_reward_imports(fps: dict[str, dict[str, Any]]) -> bool:
    """Whether a fingerprint names a file a reward module imports (more than its own file)."""
    return any(
        label.startswith("reward ") and len(files) > 1 for fp in fps.values() for label, files in fp["content"].items()
    )


# (what older grpoflow did, whether it can differ from today's fingerprints, the contexts that compute it)
WAYS: tuple[tuple[str, Callable[[dict], bool], tuple[Callable[[], Any], ...]], ...] = (
    ("reward modules' imports now keyed", _has_reward_imports, (reward_files_only,)),
    ("big files now named by sha256", _has_big_files, (reward_files_only, legacy_digests)),
)


def _may_differ(fps: dict[str, dict[str, Any]]) -> bool:
    return any(applies(fps) for _, applies, _ in WAYS)


def legacy_fingerprints(
    pipeline: Pipeline, cfg: PipelineConfig, fps: dict[str, dict[str, Any]]
) -> dict[str, list[tuple[str, dict[str, Any]]]]:
    """{stage: [(way, the fingerprint an older grpoflow made that way), ...]} for each keyed spec whose key some
    old way (:data:`WAYS`) differs from its key in ``fps`` (today's fingerprints); {} when no way can differ."""
    out: dict[str, list[tuple[str, dict[str, Any]]]] = {}
    for way, applies, contexts in WAYS:
        if not applies(fps):
            continue
        with contextlib.ExitStack() as stack:
            for context in contexts:
                stack.enter_context(context())
            old = fingerprints(pipeline, cfg)
        for name, fp in old.items():
            known = {key_of(fps[name])} | {key_of(f) for _, f in out.get(name, [])}
            if key_of(fp) not in known:
                out.setdefault(name, []).append((way, fp))
    return out


def legacy_keys(old: dict[str, Any], name: str) -> list[str]:
    """The old keys of stage ``name`` in ``old`` (:func:`legacy_fingerprints`)."""
    return [key_of(fp) for _, fp in old.get(name, [])]


def legacy_continue_keys(pipeline: Pipeline, old: dict[str, Any], name: str) -> list[str]:
    """The old continue keys of stage ``name`` (fingerprint.continue_key); none for a spec that extends nothing."""
    spec = pipeline[name]
    return [continue_key(fp, spec.extends) for _, fp in old.get(name, [])] if spec.extends else []


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
    if not _may_differ(fps) or not any(_holds_another_key(ws, s, key_of(fps[s])) for s in wanted):
        return []  # nothing an older key could name: the old-way fingerprints (a rehash, S3 lists) are not needed
    old = legacy_fingerprints(pipeline, cfg, fps)
    done = []
    for name in [s for s in wanted if s in old]:
        spec = pipeline[name]
        new_continues = continue_key(fps[name], spec.extends) if spec.extends else None
        for way, fp in old[name]:
            keys = (key_of(fp), key_of(fps[name]))
            continues = (continue_key(fp, spec.extends) if spec.extends else None, new_continues)
            if ws.rekey(name, keys, continues, {"fingerprint": fps[name]}):
                log.info("stage %s: key %s adopted as %s (%s)", name, keys[0][:12], keys[1][:12], way)
                done.append(name)
                break
    return done
