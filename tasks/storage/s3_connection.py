"""The boto3 S3 clients every request goes through: the endpoint of ``storage.endpoint_url`` (else
$AWS_ENDPOINT_URL_S3 / $AWS_ENDPOINT_URL), path-style addressing, botocore's "standard" retries with backoff and
request timeouts; one client kept per settings, process and AWS environment. Inside :func:`bounded_attempt` (an
upload attempt under an outage budget) a request gets one try and timeouts that fit the budget left."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import hashlib
import os
from collections.abc import Iterator

from grpoflow.tasks.config.storage import StorageConfig


def endpoint_url(settings: StorageConfig) -> str | None:
    return settings.endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None


_CLIENT_ENV = (
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_PROFILE",
    "AWS_SHARED_CREDENTIALS_FILE",
    "AWS_CONFIG_FILE",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
)


CONNECT_TIMEOUT_S, READ_TIMEOUT_S = 10, 120  # a request's timeouts outside an outage budget
_CONNECT_LEVELS, _READ_LEVELS = (1, 2, 5, 10), (5, 15, 60, 120)
_ATTEMPT_LIMITS: contextvars.ContextVar[tuple[int, int] | None] = contextvars.ContextVar("s3_attempt", default=None)


def attempt_limits(remaining_s: float) -> tuple[int, int]:
    """(connect_timeout, read_timeout) of the requests of one upload attempt with ``remaining_s`` of its outage
    budget left: the largest of the levels (1, 2, 5, 10) s and (5, 15, 60, 120) s not above max(remaining_s, the
    smallest level). Levels, not the exact rest, so a handful of clients serve every attempt (each costs 0.5 s).
    A request that gets no answer thus ends about 7 s after the budget at most (1 s to connect, botocore's 1 s wait
    for "100 Continue", 5 s to read when under 5 s remain); a refused connection ends at once."""

    def level(levels: tuple[int, ...]) -> int:
        return max(v for v in levels if v <= max(remaining_s, levels[0]))

    return level(_CONNECT_LEVELS), level(_READ_LEVELS)


@contextlib.contextmanager
def bounded_attempt(remaining_s: float) -> Iterator[None]:
    """S3 requests made in this block, in this thread (an upload attempt under storage.outage_budget_s), get one
    try each (no botocore retries: the caller retries with its own backoff within the budget) and the timeouts of
    :func:`attempt_limits`, so one attempt cannot outlast the budget by its own retries or a silent endpoint."""
    token = _ATTEMPT_LIMITS.set(attempt_limits(remaining_s))
    try:
        yield
    finally:
        _ATTEMPT_LIMITS.reset(token)


def s3_client(settings: StorageConfig):
    """A boto3 S3 client: endpoint from the settings or $AWS_ENDPOINT_URL, path-style, retries with backoff
    (one try and shorter timeouts inside :func:`bounded_attempt`).

    Clients are thread-safe and cost about 0.5 s to build (botocore parses its service model), so one is kept
    per settings, process, AWS environment (hashed: the values themselves are not kept) and attempt limits."""
    env = hashlib.sha256(repr([os.environ.get(k) for k in _CLIENT_ENV]).encode()).hexdigest()
    return _cached_client(settings, env, os.getpid(), _ATTEMPT_LIMITS.get())


@functools.lru_cache(maxsize=16)
def _cached_client(s: StorageConfig, env: str, pid: int, limits: tuple[int, int] | None = None):
    import boto3
    from botocore.config import Config

    attempts, (connect, read) = (s.max_attempts, (CONNECT_TIMEOUT_S, READ_TIMEOUT_S)) if limits is None else (1, limits)
    config = Config(
        retries={"total_max_attempts": attempts, "mode": "standard"},  # (botocore's "max_attempts": retries)
        s3={"addressing_style": s.addressing_style},
        connect_timeout=connect,
        read_timeout=read,
    )
    return boto3.session.Session().client("s3", endpoint_url=endpoint_url(s), region_name=s.region, config=config)
