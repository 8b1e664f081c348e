"""S3 URIs: ``s3://bucket/key`` recognised, split (the bucket name and the key's segments checked), joined, and
mapped to the local copy under a cache folder."""

from __future__ import annotations

from pathlib import Path

from grpoflow.tasks.config.storage import s3_uri_problem


def is_s3_uri(s: str) -> bool:
    return isinstance(s, str) and s.startswith("s3://")


def split_s3_uri(uri: str) -> tuple[str, str]:
    """'s3://bucket/a/b' -> ('bucket', 'a/b'); 's3://bucket' -> ('bucket', ''). A bad bucket name and '.', '..' or
    empty key segments are a ValueError naming the URI (tasks/config/storage.py s3_uri_problem says why)."""
    if problem := s3_uri_problem(uri) if isinstance(uri, str) else "not an S3 URI (expected s3://bucket/key)":
        raise ValueError(f"{uri!r}: {problem}")
    bucket, _, key = uri[len("s3://") :].partition("/")
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
