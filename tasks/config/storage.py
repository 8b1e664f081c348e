"""The ``storage`` config section: how S3 is reached (no credentials: those come from the AWS chain only)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


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
        "big local files that stage keys name (.sha256-cache.json). Safe to delete.",
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
