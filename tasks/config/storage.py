"""The ``storage`` config section: how S3 is reached (no credentials: those come from the AWS chain only)."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


def s3_uri_problem(uri: str) -> str | None:
    """Why ``uri`` is not a usable s3://bucket/key (a sentence that does not repeat it), None when it is one.

    The key's segments must be names: S3 stores 'runs/../x', 'runs/./x' and 'runs//x' as they are, but the local
    copy of a key is <storage.cache_dir>/<bucket>/<key>, where '..' climbs into another run's mirror (or out of
    the cache folder), and '.' or an empty segment names the same folder as another key: two runs would share,
    and empty, one mirror. A trailing '/' (a prefix) is fine."""
    if not uri.startswith("s3://"):
        return "not an S3 URI (expected s3://bucket/key)"
    bucket, _, key = uri[len("s3://") :].partition("/")
    if not _BUCKET.match(bucket):
        return (
            f"{bucket!r} is not a valid bucket name (3-63 lowercase letters, digits, '.' or '-'); "
            "expected s3://bucket/key"
        )
    segments = key.split("/")[:-1] if key.endswith("/") else key.split("/")
    for bad, what in (("", "empty path segment ('//')"), (".", "'.' path segment"), ("..", "'..' path segment")):
        if key and bad in segments:
            return (
                f"{what} in the key: its local copy under storage.cache_dir would not be <bucket>/<key> (it would "
                "lie in another run's folder, or outside the cache); name the key without '.', '..' or '//'"
            )
    return None


def check_s3_uri(value: str | None) -> str | None:
    """A field validator's body: ``value`` unchanged unless it is an s3:// URI with a problem (ValueError)."""
    if isinstance(value, str) and value.startswith("s3://") and (problem := s3_uri_problem(value)):
        raise ValueError(problem)
    return value


class StorageConfig(BaseModel):
    """The ``storage`` config section: how S3 is reached and where its local copies live (no credentials)."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)

    endpoint_url: str | None = Field(
        None, description="S3 endpoint, e.g. http://127.0.0.1:8333. Default: $AWS_ENDPOINT_URL, else AWS."
    )
    region: str | None = Field(None, description="Region name. Default: $AWS_REGION / ~/.aws/config.")
    addressing_style: Literal["path", "virtual", "auto"] = Field(
        "path", description="path: http://host/bucket/key (any S3 server); virtual: http://bucket.host/key."
    )
    cache_dir: str = Field(
        "~/.cache/grpoflow/s3",
        description="Local copies of s3:// workspaces and data files (<cache_dir>/<bucket>/<key>), and the sha256 of "
        "big local files that stage keys name (.sha256-cache.json). A bucket's copies belong to the S3 endpoint first "
        "used with them (.<bucket>.endpoint): use another cache_dir per endpoint. Safe to delete once no run has a "
        "checkpoint waiting to upload (`grpoflow resume` uploads it).",
    )
    multipart_threshold_mb: int = Field(64, ge=5, description="Files at least this large are uploaded in parts.")
    multipart_chunksize_mb: int = Field(16, ge=5, description="Part size of multipart uploads (S3's minimum: 5).")
    max_attempts: int = Field(5, ge=1, description="Attempts per request, with exponential backoff in between.")
    outage_budget_s: float = Field(
        300.0,
        gt=0,
        description="How long checkpoint and artifact uploads to an s3:// run.output_dir keep retrying (exponential "
        "backoff, in the background while training goes on) before the stage fails; counted from the first failed "
        "attempt of an outage (docs/storage.md).",
    )
    max_pending_uploads: int = Field(
        2,
        ge=1,
        description="Checkpoints at most waiting for their upload to S3 (kept locally meanwhile); when this many "
        "are queued, training waits for the oldest to be on S3.",
    )
