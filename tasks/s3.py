"""The one place that talks to S3 (boto3): URIs, listing, file and folder transfers, small JSON objects.

Any S3 endpoint works (AWS, SeaweedFS, MinIO, ...): the endpoint is ``storage.endpoint_url``, else
$AWS_ENDPOINT_URL_S3 / $AWS_ENDPOINT_URL, else AWS itself. Credentials never come from the config: boto3's
standard chain finds them ($AWS_ACCESS_KEY_ID / $AWS_SECRET_ACCESS_KEY, $AWS_PROFILE and ~/.aws, instance
roles). Addressing is path-style by default (http://host/bucket/key), which every S3 server accepts.

Transfers use boto3's managed transfer: files above ``storage.multipart_threshold_mb`` go up in parts of
``multipart_chunksize_mb`` (several at once), and botocore retries throttling, 5xx and connection errors with
exponential backoff ("standard" mode, ``storage.max_attempts`` attempts). Failures become :class:`S3Error`
(an OSError) whose message names the URI and the endpoint: :class:`S3NotFoundError` (also a
FileNotFoundError) for a missing bucket or key, :class:`S3AccessError` (a PermissionError) for refused or
missing credentials, plain S3Error for an unreachable endpoint.

Folder sync (:func:`upload_dir`, :func:`download_dir`) skips files whose size and ETag already match, where
the ETag of a local file is computed as S3 computes it: md5 of the bytes, or for an object uploaded in N
parts, md5 of the concatenated part md5s followed by "-N". ``markers`` name files that mark a folder complete
(a checkpoint's trainer_state.json): they are uploaded after, and deleted before, everything else.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MiB = 1024 * 1024
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


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
        description="Local copies of s3:// workspaces and data files: <cache_dir>/<bucket>/<key>. Safe to delete.",
    )
    multipart_threshold_mb: int = Field(64, ge=5, description="Files at least this large are uploaded in parts.")
    multipart_chunksize_mb: int = Field(16, ge=5, description="Part size of multipart uploads (S3's minimum: 5).")
    max_attempts: int = Field(5, ge=1, description="Attempts per request, with exponential backoff in between.")


class S3Error(OSError):
    """An S3 request failed; the message names the URI and the endpoint."""


class S3NotFoundError(S3Error, FileNotFoundError):
    """No such bucket or key."""


class S3NoSuchBucketError(S3NotFoundError):
    """The bucket itself does not exist."""


class S3AccessError(S3Error, PermissionError):
    """Missing, wrong or insufficient credentials."""


_settings = StorageConfig()


def configure(settings: StorageConfig) -> None:
    """Use these settings for every later call (the pipeline calls this with its config's ``storage``)."""
    global _settings
    _settings = settings


def current_settings() -> StorageConfig:
    return _settings


# --------------------------------------------------------------------------------------------
# URIs
# --------------------------------------------------------------------------------------------
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


def endpoint_url(settings: StorageConfig | None = None) -> str | None:
    s = settings or _settings
    return s.endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None


def _where(settings: StorageConfig | None = None) -> str:
    return endpoint_url(settings) or "AWS S3 (no endpoint set)"


def local_path(uri: str, cache_dir: str | Path | None = None) -> Path:
    """The local copy of ``uri``: <cache_dir>/<bucket>/<key> (deterministic, so a rerun finds it again)."""
    bucket, key = split_s3_uri(uri)
    root = Path(cache_dir if cache_dir is not None else _settings.cache_dir).expanduser().resolve()
    return root / bucket / key if key else root / bucket


# --------------------------------------------------------------------------------------------
# client and errors
# --------------------------------------------------------------------------------------------
# Environment variables that change which client (endpoint, credentials) a call gets.
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


def s3_client(settings: StorageConfig | None = None):
    """A boto3 S3 client: endpoint from the settings or $AWS_ENDPOINT_URL, path-style, retries with backoff.

    Clients are thread-safe and cost about 0.5 s to build (botocore parses its service model), so one is kept
    per settings, process and AWS environment (hashed: the values themselves are not kept)."""
    s = settings or _settings
    env = hashlib.sha256(repr([os.environ.get(k) for k in _CLIENT_ENV]).encode()).hexdigest()
    return _cached_client(s, env, os.getpid())


@functools.lru_cache(maxsize=8)
def _cached_client(s: StorageConfig, env: str, pid: int):
    import boto3
    from botocore.config import Config

    config = Config(
        retries={"max_attempts": s.max_attempts, "mode": "standard"},
        s3={"addressing_style": s.addressing_style},
        connect_timeout=10,
        read_timeout=120,
    )
    return boto3.session.Session().client("s3", endpoint_url=endpoint_url(s), region_name=s.region, config=config)


def _transfer_config(settings: StorageConfig | None = None):
    from boto3.s3.transfer import TransferConfig

    s = settings or _settings
    return TransferConfig(
        multipart_threshold=s.multipart_threshold_mb * MiB, multipart_chunksize=s.multipart_chunksize_mb * MiB
    )


@contextlib.contextmanager
def _errors(uri: str, client=None) -> Iterator[None]:
    """Turn botocore/boto3 failures into S3Error subclasses whose message names ``uri`` and the endpoint."""
    from boto3.exceptions import S3UploadFailedError
    from botocore.exceptions import (
        BotoCoreError,
        ClientError,
        ConnectionError,
        NoCredentialsError,
        PartialCredentialsError,
    )

    where = _where()
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
            raise _client_error(uri, cause, client) from None
        raise S3Error(f"{uri}: upload to {where} failed: {e}") from None
    except ClientError as e:
        raise _client_error(uri, e, client) from None
    except BotoCoreError as e:
        raise S3Error(f"{uri}: S3 request to {where} failed: {e}") from None


def _client_error(uri: str, e, client=None) -> S3Error:
    err = e.response.get("Error", {})
    code = str(err.get("Code", ""))
    status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    where = _where()
    bucket = split_s3_uri(uri)[0] if is_s3_uri(uri) else "?"
    if code == "NoSuchBucket":
        return S3NoSuchBucketError(f"{uri}: bucket {bucket!r} does not exist at {where}")
    if code in ("NoSuchKey", "404", "NotFound") or status == 404:
        if client is not None and not _bucket_exists(client, bucket):
            return S3NoSuchBucketError(f"{uri}: bucket {bucket!r} does not exist at {where}")
        return S3NotFoundError(f"{uri}: no such object at {where}")
    if code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403", "Forbidden") or status == 403:
        return S3AccessError(
            f"{uri}: access denied by {where} ({code or status}: {err.get('Message', '')}); check the credentials "
            "(AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or AWS_PROFILE) and the bucket policy"
        )
    return S3Error(f"{uri}: S3 request to {where} failed: {code or status}: {err.get('Message', e)}")


def _bucket_exists(client, bucket: str) -> bool:
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        client.head_bucket(Bucket=bucket)
        return True
    except ClientError as e:
        return e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") != 404
    except BotoCoreError:
        return True  # unknown: say "no such object" rather than guess


# --------------------------------------------------------------------------------------------
# objects
# --------------------------------------------------------------------------------------------
def list_objects(prefix_uri: str, *, page_size: int = 1000, client=None) -> list[dict[str, Any]]:
    """Every object whose key starts with the prefix (all pages): dicts with uri, size, etag, last_modified.

    A plain prefix: 's3://b/runs/r1' also matches 's3://b/runs/r10/...'; end it with '/' for a folder."""
    bucket, key = split_s3_uri(prefix_uri)
    client = client or s3_client()
    out = []
    with _errors(prefix_uri):
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


def check_access(uri: str, *, client=None) -> None:
    """Fail now, naming the URI and endpoint, when the bucket of ``uri`` cannot be listed (missing bucket,
    credentials, endpoint): one request, before a run starts rather than after its first stage."""
    bucket, key = split_s3_uri(uri)
    client = client or s3_client()
    with _errors(uri, client):
        client.list_objects_v2(Bucket=bucket, Prefix=key, MaxKeys=1)


def exists(uri: str, *, client=None) -> bool:
    bucket, key = split_s3_uri(uri)
    client = client or s3_client()
    try:
        with _errors(uri, client):
            client.head_object(Bucket=bucket, Key=key)
    except S3NoSuchBucketError:
        raise
    except S3NotFoundError:
        return False
    return True


def download_file(uri: str, path: str | Path, *, client=None) -> Path:
    """Copy one object to ``path`` (written beside it and renamed, so a failed download leaves no file)."""
    bucket, key = split_s3_uri(uri)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.part")
    client = client or s3_client()
    try:
        with _errors(uri, client):
            client.download_file(bucket, key, str(tmp), Config=_transfer_config())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def upload_file(path: str | Path, uri: str, *, client=None) -> str:
    """Copy a local file to ``uri`` (managed transfer: multipart above storage.multipart_threshold_mb)."""
    bucket, key = split_s3_uri(uri)
    if not key or key.endswith("/"):
        raise ValueError(f"{uri!r}: an object URI needs a key that does not end with '/'")
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"cannot upload {path} to {uri}: no such file")
    client = client or s3_client()
    with _errors(uri, client):
        client.upload_file(str(path), bucket, key, Config=_transfer_config())
    return uri


def get_bytes(uri: str, *, client=None) -> bytes:
    bucket, key = split_s3_uri(uri)
    client = client or s3_client()
    with _errors(uri, client):
        return client.get_object(Bucket=bucket, Key=key)["Body"].read()


def put_bytes(data: bytes, uri: str, *, client=None) -> str:
    bucket, key = split_s3_uri(uri)
    client = client or s3_client()
    with _errors(uri, client):
        client.put_object(Bucket=bucket, Key=key, Body=data)
    return uri


def get_json(uri: str, default: Any = ..., *, client=None) -> Any:
    """The parsed JSON object at ``uri``; ``default`` (when given) if there is no such key."""
    try:
        data = get_bytes(uri, client=client)
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


def put_json(obj: Any, uri: str, *, client=None) -> str:
    return put_bytes(json.dumps(obj, indent=2, sort_keys=True, default=str).encode(), uri, client=client)


def delete_objects(uris: Sequence[str], *, client=None) -> None:
    """Delete these objects (in this order, 1000 per request); missing ones are fine."""
    client = client or s3_client()
    by_bucket: dict[str, list[str]] = {}
    for uri in uris:
        bucket, key = split_s3_uri(uri)
        by_bucket.setdefault(bucket, []).append(key)
    for bucket, keys in by_bucket.items():
        for i in range(0, len(keys), 1000):
            batch = keys[i : i + 1000]
            with _errors(f"s3://{bucket}/{batch[0]}", client):
                res = client.delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": k} for k in batch]})
            if res.get("Errors"):
                first = res["Errors"][0]
                raise S3Error(f"s3://{bucket}/{first.get('Key')}: delete failed at {_where()}: {first.get('Message')}")


def delete_prefix(prefix_uri: str, *, markers: Sequence[str] = (), client=None) -> int:
    """Delete every object under the prefix (``markers`` first); returns how many there were."""
    client = client or s3_client()
    uris = [o["uri"] for o in list_objects(prefix_uri, client=client)]
    first = [u for u in uris if u.rsplit("/", 1)[-1] in markers]
    if first:
        delete_objects(first, client=client)
    delete_objects([u for u in uris if u not in set(first)], client=client)
    return len(uris)


# --------------------------------------------------------------------------------------------
# folders
# --------------------------------------------------------------------------------------------
def local_etag(path: Path, size: int, parts: int | None, chunksize: int) -> str:
    """The ETag S3 gives ``path``: md5 hex of the bytes, or for ``parts`` parts of ``chunksize`` bytes,
    md5(md5(part 1) + ... + md5(part N)) hex + '-N'."""
    if not parts:
        h = hashlib.md5(usedforsecurity=False)
        with path.open("rb") as f:
            for block in iter(lambda: f.read(MiB), b""):
                h.update(block)
        return h.hexdigest()
    digests = []
    with path.open("rb") as f:
        for _ in range(parts):
            h = hashlib.md5(usedforsecurity=False)
            left = chunksize
            while left > 0 and (block := f.read(min(MiB, left))):
                h.update(block)
                left -= len(block)
            digests.append(h.digest())
    return f"{hashlib.md5(b''.join(digests), usedforsecurity=False).hexdigest()}-{parts}"


def same_content(path: Path, obj: dict[str, Any]) -> bool:
    """Whether a local file holds the object's bytes (size, then ETag as S3 computes it)."""
    if not path.is_file() or path.stat().st_size != obj["size"]:
        return False
    etag = obj["etag"]
    parts = int(etag.rsplit("-", 1)[1]) if "-" in etag else None
    chunk = _settings.multipart_chunksize_mb * MiB
    if parts and parts != -(-obj["size"] // chunk):  # uploaded with another part size: cannot tell
        return False
    return local_etag(path, obj["size"], parts, chunk) == etag


def _files(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


def upload_dir(
    path: str | Path,
    prefix_uri: str,
    *,
    delete: bool = False,
    markers: Sequence[str] = (),
    exclude: Sequence[str] = (),
    client=None,
) -> list[str]:
    """Make s3 prefix_uri/ hold the files of folder ``path``: upload what differs (``markers`` last); with
    ``delete``, remove objects that have no local file (``markers`` first). Relative names in ``exclude`` are
    neither uploaded nor deleted. Returns the uploaded URIs."""
    folder = Path(path)
    client = client or s3_client()
    prefix = prefix_uri.rstrip("/") + "/"
    remote = {o["uri"][len(prefix) :]: o for o in list_objects(prefix, client=client)}
    remote = {name: o for name, o in remote.items() if name not in exclude}
    names = [n for n in _files(folder) if n not in exclude] if folder.is_dir() else []
    if delete:
        stale = [prefix + n for n in remote if n not in set(names)]
        stale.sort(key=lambda u: u.rsplit("/", 1)[-1] not in markers)  # markers first
        if stale:
            delete_objects(stale, client=client)
    names.sort(key=lambda n: n.rsplit("/", 1)[-1] in markers)  # markers last (stable: otherwise sorted)
    uploaded = []
    for name in names:
        if name in remote and same_content(folder / name, remote[name]):
            continue
        uploaded.append(upload_file(folder / name, prefix + name, client=client))
    return uploaded


def download_dir(
    prefix_uri: str,
    path: str | Path,
    *,
    delete: bool = False,
    markers: Sequence[str] = (),
    exclude: Sequence[str] = (),
    client=None,
) -> list[Path]:
    """Make folder ``path`` hold the objects under s3 prefix_uri/: download what differs (``markers`` last);
    with ``delete``, remove local files that have no object (``markers`` first). Relative names in ``exclude``
    are neither downloaded nor deleted. Returns the downloaded paths."""
    folder = Path(path)
    client = client or s3_client()
    prefix = prefix_uri.rstrip("/") + "/"
    remote = {o["uri"][len(prefix) :]: o for o in list_objects(prefix, client=client)}
    remote = {n: o for n, o in remote.items() if n and not n.endswith("/") and n not in exclude}  # no dir markers
    if delete and folder.is_dir():
        stale = [n for n in _files(folder) if n not in remote and n not in exclude]
        for name in sorted(stale, key=lambda n: n.rsplit("/", 1)[-1] not in markers):  # markers first
            (folder / name).unlink()
    got = []
    for name, obj in sorted(remote.items(), key=lambda item: item[0].rsplit("/", 1)[-1] in markers):
        target = folder / name
        if not same_content(target, obj):
            got.append(download_file(obj["uri"], target, client=client))
    return got
