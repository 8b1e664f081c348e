"""The one place that talks to S3 (boto3), with the s3_*.py modules beside it: :class:`S3Client`, its object calls
(listing, file transfers, small JSON objects, deletes), and boto3's failures turned into :class:`S3Error`.

Any S3 endpoint works (AWS, SeaweedFS, MinIO, ...): the endpoint is ``storage.endpoint_url``, else
$AWS_ENDPOINT_URL_S3 / $AWS_ENDPOINT_URL, else AWS itself. Credentials never come from the config: boto3's
standard chain finds them ($AWS_ACCESS_KEY_ID / $AWS_SECRET_ACCESS_KEY, $AWS_PROFILE and ~/.aws, instance
roles). Addressing is path-style by default (http://host/bucket/key), which every S3 server accepts.

Transfers use boto3's managed transfer: files above ``storage.multipart_threshold_mb`` go up in parts of
``multipart_chunksize_mb`` (several at once), and botocore retries throttling, 5xx and connection errors with
exponential backoff ("standard" mode, ``storage.max_attempts`` attempts). Failures become :class:`S3Error`
(an OSError) whose message names the URI and the endpoint: :class:`S3NotFoundError` (also a
FileNotFoundError) for a missing bucket or key, :class:`S3AccessError` (a PermissionError) for refused or
missing credentials (:class:`S3ClockSkewError` when the refusal is this machine's clock, not the credentials),
plain S3Error for an unreachable endpoint.

Every call goes through an :class:`S3Client` built from the run's ``storage`` settings (passed, never
process-global). Its parts, one job per module and every public name importable from here: URIs (s3_uri.py), the
error types (s3_errors.py), the cached boto3 clients with their retries and timeouts (s3_connection.py), folder sync
(s3_sync.py: :meth:`S3Client.upload_dir`, :meth:`S3Client.download_dir`) and the conditional writes of a workspace's
lease (s3_conditional.py).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from grpoflow.tasks.config.storage import StorageConfig
from grpoflow.tasks.storage.s3_conditional import ConditionalWrites
from grpoflow.tasks.storage.s3_connection import (
    CONNECT_TIMEOUT_S,
    READ_TIMEOUT_S,
    attempt_limits,
    bounded_attempt,
    endpoint_url,
    s3_client,
)
from grpoflow.tasks.storage.s3_errors import (
    S3AccessError,
    S3ChangedError,
    S3ClockSkewError,
    S3Error,
    S3NoSuchBucketError,
    S3NotFoundError,
    S3UnsafeKeyError,
)
from grpoflow.tasks.storage.s3_sync import TRANSFER_CONCURRENCY, FolderSync, MiB, confined, local_etag
from grpoflow.tasks.storage.s3_uri import is_s3_uri, join_uri, local_path, split_s3_uri

__all__ = [  # the S3 layer's public names, importable from here whichever s3_*.py module holds them
    "CONNECT_TIMEOUT_S",
    "MiB",
    "READ_TIMEOUT_S",
    "S3AccessError",
    "S3Client",
    "S3ChangedError",
    "S3ClockSkewError",
    "S3Error",
    "S3NoSuchBucketError",
    "S3NotFoundError",
    "S3UnsafeKeyError",
    "TRANSFER_CONCURRENCY",
    "attempt_limits",
    "bounded_attempt",
    "confined",
    "endpoint_url",
    "is_s3_uri",
    "join_uri",
    "local_etag",
    "local_path",
    "s3_client",
    "split_s3_uri",
]


def _bucket_exists(client, bucket: str) -> bool:
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        client.head_bucket(Bucket=bucket)
        return True
    except ClientError as e:
        return e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") != 404
    except BotoCoreError:
        return True  # unknown: say "no such object" rather than guess


class S3Client(FolderSync, ConditionalWrites):
    """S3 with one set of ``storage`` settings: endpoint, addressing, retries, multipart sizes and the local cache
    folder. Built where the settings are known (the workspace, the data stage, the CLI) and passed on."""

    def __init__(self, settings: StorageConfig | None = None):
        self.settings = settings if settings is not None else StorageConfig()

    def __repr__(self) -> str:
        return f"S3Client({self.where})"

    @property
    def client(self):
        return s3_client(self.settings)

    @property
    def where(self) -> str:
        """The endpoint, for messages."""
        return endpoint_url(self.settings) or "AWS S3 (no endpoint set)"

    def local_path(self, uri: str) -> Path:
        """The local copy of ``uri`` under storage.cache_dir."""
        return local_path(uri, self.settings.cache_dir)

    def _transfer_config(self):
        from boto3.s3.transfer import TransferConfig

        s = self.settings
        return TransferConfig(
            multipart_threshold=s.multipart_threshold_mb * MiB,
            multipart_chunksize=s.multipart_chunksize_mb * MiB,
            max_concurrency=TRANSFER_CONCURRENCY,
        )

    @contextlib.contextmanager
    def _errors(self, uri: str, check_bucket: bool = True) -> Iterator[None]:
        """Turn botocore/boto3 failures into S3Error subclasses whose message names ``uri`` and the endpoint; with
        ``check_bucket``, a 404 asks whether the bucket itself is missing."""
        from boto3.exceptions import S3UploadFailedError
        from botocore.exceptions import (
            BotoCoreError,
            ClientError,
            ConnectionError,
            NoCredentialsError,
            PartialCredentialsError,
        )

        where = self.where
        try:
            yield
        except (NoCredentialsError, PartialCredentialsError) as e:
            raise S3AccessError(
                f"{uri}: no AWS credentials ({e}); set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE "
                "with ~/.aws/credentials (credentials never go in the config)"
            ) from None
        except ConnectionError as e:  # EndpointConnectionError, ConnectTimeoutError, ... after every retry
            raise S3Error(f"{uri}: cannot reach the S3 endpoint {where}: {e}") from None
        except S3UploadFailedError as e:  # boto3 wraps the ClientError of a managed upload in text only
            cause = e.__context__
            if isinstance(cause, ClientError):
                raise self._client_error(uri, cause, check_bucket) from None
            raise S3Error(f"{uri}: upload to {where} failed: {e}") from None
        except ClientError as e:
            raise self._client_error(uri, e, check_bucket) from None
        except BotoCoreError as e:
            raise S3Error(f"{uri}: S3 request to {where} failed: {e}") from None

    def _client_error(self, uri: str, e, check_bucket: bool) -> S3Error:
        err = e.response.get("Error", {})
        code = str(err.get("Code", ""))
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        where = self.where
        bucket = split_s3_uri(uri)[0] if is_s3_uri(uri) else "?"
        if code == "NoSuchBucket":
            return S3NoSuchBucketError(f"{uri}: bucket {bucket!r} does not exist at {where}")
        if code in ("NoSuchKey", "404", "NotFound") or status == 404:
            if check_bucket and not _bucket_exists(self.client, bucket):
                return S3NoSuchBucketError(f"{uri}: bucket {bucket!r} does not exist at {where}")
            return S3NotFoundError(f"{uri}: no such object at {where}")
        if code == "PreconditionFailed" or status == 412:
            return S3ChangedError(f"{uri}: the object changed at {where} since its ETag was read ({code or status})")
        if code == "RequestTimeTooSkewed":
            times = ", ".join(f"{k} {err[k]}" for k in ("RequestTime", "ServerTime") if err.get(k))
            return S3ClockSkewError(
                f"{uri}: {where} refused the request as sent at the wrong time (RequestTimeTooSkewed"
                f"{': ' + times if times else ''}): this machine's clock differs from the server's by more than "
                "15 minutes; the credentials are not the cause. Sync the clock (`timedatectl set-ntp true`, "
                "`chronyc makestep`, or in a container the host's clock) and run again"
            )
        if code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403", "Forbidden") or status == 403:
            return S3AccessError(
                f"{uri}: access denied by {where} ({code or status}: {err.get('Message', '')}); check the credentials "
                "(AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or AWS_PROFILE) and the bucket policy"
            )
        return S3Error(f"{uri}: S3 request to {where} failed: {code or status}: {err.get('Message', e)}")

    def list_objects(self, prefix_uri: str, *, page_size: int = 1000) -> list[dict[str, Any]]:
        """Every object whose key starts with the prefix (all pages): dicts with uri, size, etag, last_modified.

        A plain prefix: 's3://b/runs/r1' also matches 's3://b/runs/r10/...'; end it with '/' for a folder."""
        bucket, key = split_s3_uri(prefix_uri)
        client = self.client
        out = []
        with self._errors(prefix_uri, check_bucket=False):
            pages = client.get_paginator("list_objects_v2").paginate(
                Bucket=bucket, Prefix=key, PaginationConfig={"PageSize": page_size}
            )
            for page in pages:
                for obj in page.get("Contents", []):
                    out.append(
                        {
                            "uri": f"s3://{bucket}/{obj['Key']}",
                            "size": int(obj["Size"]),
                            "etag": obj.get("ETag", "").strip('"'),
                            "last_modified": obj["LastModified"],
                        }
                    )
        return out

    def check_access(self, uri: str) -> None:
        """Fail now, naming the URI and endpoint, when the bucket of ``uri`` cannot be listed (missing bucket,
        credentials, endpoint): one request, before a run starts rather than after its first stage."""
        bucket, key = split_s3_uri(uri)
        client = self.client
        with self._errors(uri):
            client.list_objects_v2(Bucket=bucket, Prefix=key, MaxKeys=1)

    def head(self, uri: str) -> dict[str, Any] | None:
        """{size, etag} of the object at ``uri``; None when there is no such key (a missing bucket, refused
        credentials or a dead endpoint raise, naming the URI)."""
        bucket, key = split_s3_uri(uri)
        client = self.client
        try:
            with self._errors(uri):
                head = client.head_object(Bucket=bucket, Key=key)
        except S3NoSuchBucketError:
            raise
        except S3NotFoundError:
            return None
        return {"size": head["ContentLength"], "etag": head["ETag"].strip('"')}

    def exists(self, uri: str) -> bool:
        return self.head(uri) is not None

    def download_file(self, uri: str, path: str | Path, *, if_match: str | None = None) -> Path:
        """Copy one object to ``path`` (written beside it and renamed, so a failed download leaves no file); with
        ``if_match`` (an ETag), only that version: :class:`S3ChangedError` when the object was overwritten since."""
        bucket, key = split_s3_uri(uri)
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.part")
        client = self.client
        try:
            with self._errors(uri):
                if if_match:  # one GET (the managed transfer takes no If-Match): one version, start to end
                    body = client.get_object(Bucket=bucket, Key=key, IfMatch=f'"{if_match}"')["Body"]
                    with open(tmp, "wb") as f:
                        for block in body.iter_chunks(MiB):
                            f.write(block)
                else:
                    client.download_file(bucket, key, str(tmp), Config=self._transfer_config())
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        return path

    def upload_file(self, path: str | Path, uri: str) -> str:
        """Copy a local file to ``uri`` (managed transfer: multipart above storage.multipart_threshold_mb)."""
        bucket, key = split_s3_uri(uri)
        if not key or key.endswith("/"):
            raise ValueError(f"{uri!r}: an object URI needs a key that does not end with '/'")
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"cannot upload {path} to {uri}: no such file")
        client = self.client
        with self._errors(uri):
            client.upload_file(str(path), bucket, key, Config=self._transfer_config())
        return uri

    def get_bytes(self, uri: str) -> bytes:
        bucket, key = split_s3_uri(uri)
        client = self.client
        with self._errors(uri):
            return client.get_object(Bucket=bucket, Key=key)["Body"].read()

    def put_bytes(self, data: bytes, uri: str) -> str:
        bucket, key = split_s3_uri(uri)
        client = self.client
        with self._errors(uri):
            client.put_object(Bucket=bucket, Key=key, Body=data)
        return uri

    def get_json(self, uri: str, default: Any = ...) -> Any:
        """The parsed JSON object at ``uri``; ``default`` (when given) if there is no such key."""
        try:
            data = self.get_bytes(uri)
        except S3NoSuchBucketError:
            raise
        except S3NotFoundError:
            if default is ...:
                raise
            return default
        try:
            return json.loads(data)
        except ValueError as e:
            raise ValueError(f"{uri}: not valid JSON: {e}") from None

    def delete_objects(self, uris: Sequence[str]) -> None:
        """Delete these objects (in this order, 1000 per request); missing ones are fine."""
        client = self.client
        by_bucket: dict[str, list[str]] = {}
        for uri in uris:
            bucket, key = split_s3_uri(uri)
            by_bucket.setdefault(bucket, []).append(key)
        for bucket, keys in by_bucket.items():
            for i in range(0, len(keys), 1000):
                batch = keys[i : i + 1000]
                with self._errors(f"s3://{bucket}/{batch[0]}"):
                    res = client.delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": k} for k in batch]})
                if res.get("Errors"):
                    first = res["Errors"][0]
                    raise S3Error(
                        f"s3://{bucket}/{first.get('Key')}: delete failed at {self.where}: {first.get('Message')}"
                    )

    def delete_prefix(self, prefix_uri: str, *, markers: Sequence[str] = ()) -> int:
        """Delete every object under the prefix (``markers`` first); returns how many there were."""
        uris = [o["uri"] for o in self.list_objects(prefix_uri)]
        first = [u for u in uris if u.rsplit("/", 1)[-1] in markers]
        if first:
            self.delete_objects(first)
        self.delete_objects([u for u in uris if u not in set(first)])
        return len(uris)
