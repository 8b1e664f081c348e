"""S3 URIs: ``s3://bucket/key`` recognised, split (the bucket name checked), joined, and mapped to the local copy
under a cache folder."""

from __future__ import annotations

import re
from pathlib import Path

_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


def is_s3_uri(s: str) -> bool:
    return isinstance(s, str) and s.startswith("s3://")


def split_s3_uri(uri: str) -> tuple[str, str]:
    """'s3://bucket/a/b' -> ('bucket', 'a/b'); 's3://bucket' -> ('bucket', '')."""
    if not is_s3_uri(uri):
        raise ValueError(f"{uri!r} is not an S3 URI (expected s3://bucket/key)")
    bucket, _, key = uri[len("s3://") :].partition("/")
    if not _BUCKET.match(bucket):
        raise ValueError(
            f"{uri!r}: {bucket!r} is not a valid bucket name (3-63 lowercase letters, digits, '.' or '-'); "
            "expected s3://bucket/key"
        )
    if "//" in key:
        raise ValueError(f"{uri!r}: empty path segment ('//') in the key")
    return bucket, key


def join_uri(uri: str, *parts: str) -> str:
    """'s3://b/runs' + 'r1', 'data' -> 's3://b/runs/r1/data'."""
    out = uri.rstrip("/")
    for part in parts:
        part = part.strip("/")
        if part:
            out = f"{out}/{part}"
    return out


def local_path(uri: str, cache_dir: str | Path) -> Path:
    """The local copy of ``uri``: <cache_dir>/<bucket>/<key> (deterministic, so a rerun finds it again)."""
    bucket, key = split_s3_uri(uri)
    root = Path(cache_dir).expanduser().resolve()
    return root / bucket / key if key else root / bucket
