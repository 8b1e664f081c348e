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
missing credentials (:class:`S3ClockSkewError` when the refusal is this machine's clock, not the credentials),
plain S3Error for an unreachable endpoint.

Every call goes through an :class:`S3Client` built from the run's ``storage`` settings (passed, never
process-global). Folder sync (:meth:`S3Client.upload_dir`, :meth:`S3Client.download_dir`) runs
through one s3transfer ``TransferManager`` per call (``TRANSFER_CONCURRENCY`` files at once) and skips files whose size
and ETag already match, where the ETag of a local file is computed as S3 computes it: md5 of the bytes, or for
an object uploaded in N parts, md5 of the concatenated part md5s followed by "-N". ``markers`` name files that
mark a folder complete (a checkpoint's trainer_state.json): they are uploaded after, and deleted before,
everything else.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import hashlib
import json
import os
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from grpoflow.tasks.config.storage import StorageConfig

MiB = 1024 * 1024
TRANSFER_CONCURRENCY = 8  # files (or parts) in flight at once in a folder sync: within botocore's pool of 10

_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


class S3Error(OSError):
    """An S3 request failed; the message names the URI and the endpoint."""


class S3NotFoundError(S3Error, FileNotFoundError):
    """No such bucket or key."""


class S3NoSuchBucketError(S3NotFoundError):
    """The bucket itself does not exist."""


class S3UnsafeKeyError(S3Error, ValueError):
    """An object whose key, relative to the prefix being downloaded, would be written outside the target folder
    (a '..' segment, an absolute name): refused before anything is written."""


class S3AccessError(S3Error, PermissionError):
    """Missing, wrong or insufficient credentials."""


class S3ClockSkewError(S3AccessError):
    """The server refused the request's signature time (RequestTimeTooSkewed): this machine's clock is off by more
    than S3's 15 minutes. A 403 like bad credentials, but new credentials would not help; syncing the clock does."""


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


def endpoint_url(settings: StorageConfig) -> str | None:
    return settings.endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None


def local_path(uri: str, cache_dir: str | Path) -> Path:
    """The local copy of ``uri``: <cache_dir>/<bucket>/<key> (deterministic, so a rerun finds it again)."""
    bucket, key = split_s3_uri(uri)
    root = Path(cache_dir).expanduser().resolve()
    return root / bucket / key if key else root / bucket


# --------------------------------------------------------------------------------------------
# client
# --------------------------------------------------------------------------------------------
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


def _bucket_exists(client, bucket: str) -> bool:
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        client.head_bucket(Bucket=bucket)
        return True
    except ClientError as e:
        return e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") != 404
    except BotoCoreError:
        return True  # unknown: say "no such object" rather than guess


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


class _KnownSize:
    """An s3transfer subscriber that gives a download the object's size from the listing."""

    def __init__(self, size: int):
        self.size = size

    def on_queued(self, future, **kwargs) -> None:
        future.meta.provide_transfer_size(self.size)

    def on_progress(self, **kwargs) -> None:
        pass

    def on_done(self, **kwargs) -> None:
        pass


def confined(folder: Path, name: str, uri: str) -> Path:
    """folder/name for the object ``uri`` whose key below the downloaded prefix is ``name``, refused with
    :class:`S3UnsafeKeyError` when it would land outside ``folder``: an absolute name, a '..' or '.' segment, or a
    path that resolves (through links too) elsewhere. S3 keys are plain strings, so a bucket shared with others may
    hold 'prefix/../../.bashrc'."""
    parts = name.replace("\\", "/").split("/")
    root = folder.resolve()
    target = (folder / name).resolve()
    if name.startswith("/") or any(p in ("..", ".") for p in parts) or not target.is_relative_to(root):
        raise S3UnsafeKeyError(
            f"{uri}: its key below the prefix, {name!r}, resolves outside {folder} ({target}); refused, nothing "
            "downloaded (remove or rename the object)"
        )
    return folder / name


def _files(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


class S3Client:
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

    def exists(self, uri: str) -> bool:
        bucket, key = split_s3_uri(uri)
        client = self.client
        try:
            with self._errors(uri):
                client.head_object(Bucket=bucket, Key=key)
        except S3NoSuchBucketError:
            raise
        except S3NotFoundError:
            return False
        return True

    def download_file(self, uri: str, path: str | Path) -> Path:
        """Copy one object to ``path`` (written beside it and renamed, so a failed download leaves no file)."""
        bucket, key = split_s3_uri(uri)
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.part")
        client = self.client
        try:
            with self._errors(uri):
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

    def same_content(self, path: Path, obj: dict[str, Any]) -> bool:
        """Whether a local file holds the object's bytes (size, then ETag as S3 computes it)."""
        if not path.is_file() or path.stat().st_size != obj["size"]:
            return False
        etag = obj["etag"]
        parts = int(etag.rsplit("-", 1)[1]) if "-" in etag else None
        chunk = self.settings.multipart_chunksize_mb * MiB
        if parts and parts != -(-obj["size"] // chunk):  # uploaded with another part size: cannot tell
            return False
        return local_etag(path, obj["size"], parts, chunk) == etag

    @contextlib.contextmanager
    def _transfers(self) -> Iterator[Any]:
        """One s3transfer TransferManager over this client: up to ``TRANSFER_CONCURRENCY`` requests at once (files,
        or parts of a multipart file). Leaving the block waits for (or, after an error, cancels) what is left."""
        from s3transfer.manager import TransferManager

        with TransferManager(self.client, self._transfer_config()) as manager:
            yield manager

    def _wait(self, futures: list[tuple[str, Any]]) -> None:
        """Wait for every transfer; then raise the first failure (as an S3Error naming its URI and the endpoint)."""
        first: BaseException | None = None
        for uri, future in futures:
            try:
                with self._errors(uri):
                    future.result()
            except Exception as e:  # noqa: BLE001 - the others still finish before the first failure is raised
                first = first or e
        if first is not None:
            raise first

    def upload_dir(
        self,
        path: str | Path,
        prefix_uri: str,
        *,
        delete: bool = False,
        markers: Sequence[str] = (),
        exclude: Sequence[str] = (),
    ) -> list[str]:
        """Make s3 prefix_uri/ hold the files of folder ``path``: upload what differs, many files at once through
        one TransferManager, ``markers`` only after every other file is up; with ``delete``, first remove objects
        that have no local file (``markers`` first). Relative names in ``exclude`` are neither uploaded nor
        deleted. Returns the uploaded URIs."""
        folder = Path(path)
        prefix = prefix_uri.rstrip("/") + "/"
        bucket, key_prefix = split_s3_uri(prefix)
        remote = {o["uri"][len(prefix) :]: o for o in self.list_objects(prefix)}
        remote = {name: o for name, o in remote.items() if name not in exclude}
        names = [n for n in _files(folder) if n not in exclude] if folder.is_dir() else []
        if delete:
            stale = [prefix + n for n in remote if n not in set(names)]
            stale.sort(key=lambda u: u.rsplit("/", 1)[-1] not in markers)  # markers first
            if stale:
                self.delete_objects(stale)
        changed = [n for n in names if not (n in remote and self.same_content(folder / n, remote[n]))]
        batches = [[n for n in changed if n.rsplit("/", 1)[-1] not in markers]]
        batches.append([n for n in changed if n.rsplit("/", 1)[-1] in markers])  # after all the rest is up
        with self._transfers() as manager:
            for batch in batches:
                futures = [(prefix + n, manager.upload(str(folder / n), bucket, key_prefix + n)) for n in batch]
                self._wait(futures)
        return [prefix + n for batch in batches for n in batch]

    def download_dir(
        self,
        prefix_uri: str,
        path: str | Path,
        *,
        delete: bool = False,
        markers: Sequence[str] = (),
        exclude: Sequence[str] = (),
    ) -> list[Path]:
        """Make folder ``path`` hold the objects under s3 prefix_uri/: download what differs, many files at once
        through one TransferManager (each written beside its target and renamed), ``markers`` last; with
        ``delete``, first remove local files that have no object (``markers`` first). Relative names in
        ``exclude`` are neither downloaded nor deleted. A key that would land outside ``path`` ('..', absolute) fails
        the whole download with :class:`S3UnsafeKeyError` before any file is touched. Returns the downloaded
        paths."""
        folder = Path(path)
        prefix = prefix_uri.rstrip("/") + "/"
        remote = {o["uri"][len(prefix) :]: o for o in self.list_objects(prefix)}
        remote = {n: o for n, o in remote.items() if n and not n.endswith("/") and n not in exclude}  # no dir markers
        for name, obj in remote.items():  # every key checked before anything is deleted or written
            confined(folder, name, obj["uri"])
        if delete and folder.is_dir():
            stale = [n for n in _files(folder) if n not in remote and n not in exclude]
            for name in sorted(stale, key=lambda n: n.rsplit("/", 1)[-1] not in markers):  # markers first
                (folder / name).unlink(missing_ok=True)
        changed = [n for n, obj in sorted(remote.items()) if not self.same_content(folder / n, obj)]
        batches = [[n for n in changed if n.rsplit("/", 1)[-1] not in markers]]
        batches.append([n for n in changed if n.rsplit("/", 1)[-1] in markers])
        with self._transfers() as manager:
            for batch in batches:
                futures = []
                for name in batch:
                    (folder / name).parent.mkdir(parents=True, exist_ok=True)
                    bucket, key = split_s3_uri(remote[name]["uri"])
                    size = [_KnownSize(remote[name]["size"])]  # listed already: no HEAD request per file
                    futures.append((remote[name]["uri"], manager.download(bucket, key, str(folder / name), None, size)))
                self._wait(futures)
        return [folder / n for batch in batches for n in batch]

    # ------------------------------------------------------------------ conditional writes (a workspace's lease)
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
