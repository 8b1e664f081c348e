"""What a stage reads, by content: local files and folders (size + sha256) and S3 objects (size + ETag).

Stage keys (tasks/pipeline/fingerprint.py) include these digests, so an edited data file, a model folder
replaced in place or a rewritten S3 object reruns the stages that read it, and the same bytes elsewhere (a model
folder copied to another machine, restored from a backup or checked out again: new mtimes) rerun nothing. Every
file is hashed; the sha256 of files of 64 MiB or more is remembered per machine in the hash cache under
storage.cache_dir (tasks/storage/hash_cache.py), so a multi-GB checkpoint is read once, not on every
``grpoflow run``. S3 objects are not read at all: their ETag (an MD5 for a single-part upload, a digest of the
parts' MD5s for a multipart one) changes with their content.

Keys recorded before that named files over :data:`LEGACY_LIMIT` by size + mtime_ns; :func:`legacy_digests`
computes digests that way again, so such keys can still be recognised and adopted (tasks/pipeline/legacy.py).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from grpoflow.tasks.config.storage import StorageConfig
from grpoflow.tasks.storage import s3
from grpoflow.tasks.storage.hash_cache import HashCache

LEGACY_LIMIT = 64 * 2**20  # bytes: files larger than this were named by size + mtime_ns in keys of older grpoflow
_LEGACY = contextvars.ContextVar("grpoflow_legacy_digests", default=False)


@contextlib.contextmanager
def legacy_digests() -> Iterator[None]:
    """Within it, files over LEGACY_LIMIT are digested as older grpoflow did ({size, mtime_ns}), to recompute
    the keys it recorded; nothing is hashed or cached for them."""
    token = _LEGACY.set(True)
    try:
        yield
    finally:
        _LEGACY.reset(token)


def file_digest(path: Path, cache: HashCache | None = None) -> dict[str, Any]:
    """{size, sha256} of one file, its hash from ``cache`` while the file is unchanged (:func:`legacy_digests`:
    {size, mtime_ns} above LEGACY_LIMIT)."""
    st = path.stat()
    if _LEGACY.get() and st.st_size > LEGACY_LIMIT:
        return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
    return {"size": st.st_size, "sha256": (cache or HashCache(None)).sha256(path, st)}


def path_digest(path: str | Path, cache_dir: str | Path | None = None) -> dict[str, dict[str, Any]]:
    """{file name: file_digest} of a file, or of every file under a folder (names relative to it, sorted); the
    hashes of big files kept in the hash cache of ``cache_dir`` (storage.cache_dir; None: no cache)."""
    p = Path(path).expanduser()
    cache = HashCache(cache_dir)
    if p.is_file():
        out = {p.name: file_digest(p, cache)}
    else:
        out = {str(f.relative_to(p)): file_digest(f, cache) for f in sorted(p.rglob("*")) if f.is_file()}
    cache.save()
    return out


def s3_digest(uri: str, storage: StorageConfig) -> dict[str, dict[str, Any]]:
    """{key: {size, etag}} of the S3 object at ``uri``, or of every object under it when it is a prefix. S3's
    refusals are :class:`~s3.S3Error` naming ``uri`` and the endpoint (credentials, bucket, unreachable)."""
    bucket, key = s3.split_s3_uri(uri)
    client = s3.S3Client(storage)
    if (head := client.head(uri)) is not None:
        return {key: head}
    prefix = key.rstrip("/") + "/" if key else ""
    out = {o["uri"][len(f"s3://{bucket}/") :]: {"size": o["size"], "etag": o["etag"]} for o in
           client.list_objects(f"s3://{bucket}/{prefix}")}  # fmt: skip
    if not out:
        raise FileNotFoundError(f"{uri}: no such S3 object or prefix")
    return out


def source_digest(source: str, storage: StorageConfig) -> dict[str, dict[str, Any]] | None:
    """The content digest of a source that is an s3:// URI or an existing local file or folder; None for anything
    else (a hub id, a builtin source: named by the config alone)."""
    if s3.is_s3_uri(source):
        return s3_digest(source, storage)
    if Path(source).expanduser().exists():
        return path_digest(source, storage.cache_dir)
    return None
