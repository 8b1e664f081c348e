"""Conditional writes on S3 (:class:`ConditionalWrites`, methods of :class:`~grpoflow.tasks.storage.s3.S3Client`):
write if absent or still a given version, read with the version and its age by the server's clock, delete if still
that version. The compare-and-swap a workspace's lease is built on (:mod:`grpoflow.tasks.storage.lock`)."""

from __future__ import annotations

from grpoflow.tasks.storage.s3_errors import S3NoSuchBucketError, S3NotFoundError
from grpoflow.tasks.storage.s3_uri import split_s3_uri


class ConditionalWrites:
    """S3Client's conditional writes: use its ``client`` and ``_errors``."""

    def put_if(self, data: bytes, uri: str, *, etag: str | None = None) -> str | None:
        """Write ``data`` at ``uri`` only if the object is absent (``etag`` None: If-None-Match: *) or still the
        version ``etag`` names (If-Match); its new ETag, or None when the condition did not hold (412, or 409 for
        a concurrent conditional write). The compare-and-swap :mod:`grpoflow.tasks.storage.lock` leases build on."""
        from botocore.exceptions import ClientError

        bucket, key = split_s3_uri(uri)
        condition = {"IfNoneMatch": "*"} if etag is None else {"IfMatch": etag}
        client = self.client
        with self._errors(uri):
            try:
                return client.put_object(Bucket=bucket, Key=key, Body=data, **condition)["ETag"]
            except ClientError as e:
                if e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") in (409, 412):
                    return None
                raise

    def get_with_etag(self, uri: str) -> tuple[bytes, str, float] | None:
        """The object's bytes, ETag and age in seconds by the server's clock (its Date answer minus the object's
        LastModified, so this machine's clock does not matter); None when there is no such key."""
        from email.utils import parsedate_to_datetime

        bucket, key = split_s3_uri(uri)
        client = self.client
        try:
            with self._errors(uri):
                got = client.get_object(Bucket=bucket, Key=key)
                date = got.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
                now = parsedate_to_datetime(date) if date else None
                age = (now - got["LastModified"]).total_seconds() if now else 0.0
                return got["Body"].read(), got["ETag"], age
        except S3NoSuchBucketError:
            raise
        except S3NotFoundError:
            return None

    def delete_if(self, uri: str, etag: str) -> bool:
        """Delete the object only while it is still the version ``etag`` names; whether it was."""
        from botocore.exceptions import ClientError

        bucket, key = split_s3_uri(uri)
        client = self.client
        with self._errors(uri):
            try:
                client.delete_object(Bucket=bucket, Key=key, IfMatch=etag)
                return True
            except ClientError as e:
                if e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") in (404, 409, 412):
                    return False
                raise
