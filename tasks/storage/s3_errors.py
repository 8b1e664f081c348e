"""The errors of S3 requests: :class:`S3Error` (an OSError) and its kinds, each message naming the URI and the
endpoint. :class:`S3NotFoundError` (also a FileNotFoundError) for a missing bucket or key, :class:`S3AccessError`
(a PermissionError) for refused or missing credentials (:class:`S3ClockSkewError` when the refusal is this
machine's clock), :class:`S3ChangedError` for an object that is no longer the version a request named (If-Match),
:class:`S3UnsafeKeyError` for a key that would download outside its folder, plain S3Error for an
unreachable endpoint. :meth:`S3Client._errors <grpoflow.tasks.storage.s3.S3Client._errors>` raises them."""

from __future__ import annotations


class S3Error(OSError):
    """An S3 request failed; the message names the URI and the endpoint."""


class S3NotFoundError(S3Error, FileNotFoundError):
    """No such bucket or key."""


class S3NoSuchBucketError(S3NotFoundError):
    """The bucket itself does not exist."""


class S3ChangedError(S3Error):
    """The object is no longer the version the request named (If-Match: 412 Precondition Failed): it was
    overwritten since its ETag was read."""


class S3UnsafeKeyError(S3Error, ValueError):
    """An object whose key, relative to the prefix being downloaded, would be written outside the target folder
    (a '..' segment, an absolute name): refused before anything is written."""


class S3AccessError(S3Error, PermissionError):
    """Missing, wrong or insufficient credentials."""


class S3ClockSkewError(S3AccessError):
    """The server refused the request's signature time (RequestTimeTooSkewed): this machine's clock is off by more
    than S3's 15 minutes. A 403 like bad credentials, but new credentials would not help; syncing the clock does."""
