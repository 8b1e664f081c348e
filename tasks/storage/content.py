"""What a stage reads, by content: local files and folders (size + sha256) and S3 objects (size + ETag).

Stage keys (tasks/pipeline/fingerprint.py) include these digests, so an edited data file, a model folder
replaced in place or a rewritten S3 object reruns the stages that read it. Files larger than
:data:`HASH_LIMIT` are identified by size and mtime_ns instead of their sha256: hashing a multi-GB checkpoint on
every ``grpoflow run`` would cost minutes, and a replaced weight file practically always changes its mtime.
S3 objects are not read at all: their ETag (an MD5 for a single-part upload, a digest of the parts' MD5s for a
multipart one) changes with their content.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from grpoflow.tasks.config.storage import StorageConfig
from grpoflow.tasks.storage import s3

HASH_LIMIT = 64 * 2**20  # bytes: larger files are identified by size + mtime_ns


def file_digest(path: Path) -> dict[str, Any]:
    """{size, sha256} of one file; {size, mtime_ns} above HASH_LIMIT."""
    st = path.stat()
    if st.st_size > HASH_LIMIT:
        return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return {"size": st.st_size, "sha256": h.hexdigest()}


def path_digest(path: str | Path) -> dict[str, dict[str, Any]]:
    """{file name: file_digest} of a file, or of every file under a folder (names relative to it, sorted)."""
    p = Path(path).expanduser()
    if p.is_file():
        return {p.name: file_digest(p)}
    return {str(f.relative_to(p)): file_digest(f) for f in sorted(p.rglob("*")) if f.is_file()}


def s3_digest(uri: str, storage: StorageConfig) -> dict[str, dict[str, Any]]:
    """{key: {size, etag}} of the S3 object at ``uri``, or of every object under it when it is a prefix. S3's
    refusals are :class:`~s3.S3Error` naming ``uri`` and the endpoint (credentials, bucket, unreachable)."""
    bucket, key = s3.split_s3_uri(uri)
    client = s3.S3Client(storage)
    try:
        with client._errors(uri):
            head = client.client.head_object(Bucket=bucket, Key=key)
        return {key: {"size": head["ContentLength"], "etag": head["ETag"].strip('"')}}
    except s3.S3NoSuchBucketError:
        raise
    except s3.S3NotFoundError:
        pass
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
        return path_digest(source)
    return None
