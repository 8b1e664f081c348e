"""Which S3 endpoint a bucket's local mirror <storage.cache_dir>/<bucket> belongs to.

The mirror's path names the bucket and key, not the endpoint, so two endpoints holding a bucket of the same name (a
trial MinIO/SeaweedFS and production S3, two clusters) would share one folder: a run on one would take the other's
files for its own (a checkpoint saved and not yet uploaded is resumed from and uploaded to the wrong S3, or removed
as another attempt's). So the first use of a bucket's mirror records its endpoint in
<cache_dir>/.<bucket>.endpoint (created exclusively: of two first users, one writes it), and a use with another
endpoint is refused with :class:`MirrorEndpointError` before the mirror is touched. A mirror written before this
record existed is adopted: the current endpoint is recorded. Bucket names never start with '.', so the record
never lies in a bucket's mirror. Endpoints are compared as :func:`endpoint_id` names them, so one server spelled
two ways (localhost and 127.0.0.1, a default port and none) is one endpoint.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from urllib.parse import urlsplit

from grpoflow.tasks.config.secrets import without_userinfo
from grpoflow.tasks.storage.s3_uri import split_s3_uri

DEFAULT_ENDPOINT = "AWS S3 (no endpoint set)"  # what S3Client.where says without an endpoint


class MirrorEndpointError(ValueError):
    """A bucket's local mirror was recorded for another S3 endpoint than the one this run uses."""


_LOOPBACK = {"localhost", "::1", "ip6-localhost"}  # and 127.0.0.0/8
_DEFAULT_PORTS = {"http": 80, "https": 443}


def spelling(where: str | None) -> str:
    """The endpoint as a mirror records it and its messages name it: no user:password@, no trailing '/', scheme
    and host in lower case."""
    if not where:
        return DEFAULT_ENDPOINT
    url = without_userinfo(where.strip()).rstrip("/")
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    host, slash, path = rest.partition("/")
    return f"{scheme.lower()}://{host.lower()}{slash}{path}"


def endpoint_id(where: str | None) -> str:
    """The server an endpoint names, for comparing two: its :func:`spelling` with the scheme's default port left
    out and this machine's loopback spelled ``localhost`` (127.0.0.1, [::1] and localhost are one server: a
    process reaches the same one by each)."""
    url = spelling(where)
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:  # not a number: compared as spelled
        return url
    if not parts.scheme or not parts.hostname:
        return url
    host = "localhost" if parts.hostname in _LOOPBACK or parts.hostname.startswith("127.") else parts.hostname
    host = f"[{host}]" if ":" in host else host  # an IPv6 address, bracketed as in a URL
    shown = "" if port is None or port == _DEFAULT_PORTS.get(parts.scheme) else f":{port}"
    return f"{parts.scheme}://{host}{shown}{parts.path}"


def record_path(uri: str, cache_dir: str | Path) -> Path:
    """<cache_dir>/.<bucket>.endpoint: where the endpoint of the mirror of ``uri``'s bucket is recorded."""
    bucket, _ = split_s3_uri(uri)
    return Path(cache_dir).expanduser().resolve() / f".{bucket}.endpoint"


def _create(path: Path, text: str) -> bool:
    """Create ``path`` holding ``text``, whole or not at all (a temp file, fsynced, hard-linked to ``path``: the
    link fails when ``path`` exists); False when another process created it first."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f"{path.name}.", suffix=".tmp", dir=path.parent)
    tmp = Path(name)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text + "\n")
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            raise
        except OSError:  # a file system without hard links: an exclusive create (torn only by a crash mid-write)
            with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644), "w") as f:
                f.write(text + "\n")
    except FileExistsError:
        return False
    finally:
        tmp.unlink(missing_ok=True)
    dir_fd = os.open(path.parent, os.O_RDONLY)  # the new name durable too
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return True


def claim_mirror(uri: str, cache_dir: str | Path, where: str | None) -> Path:
    """Check that the local mirror of ``uri``'s bucket belongs to endpoint ``where`` (None: AWS), recording it on
    first use (an older mirror without a record is adopted); :class:`MirrorEndpointError` naming the mirror, both
    endpoints and what to do when it was recorded for another. Returns the record's path."""
    path = record_path(uri, cache_dir)
    mine = spelling(where)
    if not path.is_file() and _create(path, mine):
        return path
    recorded = path.read_text().strip()
    if endpoint_id(recorded) != endpoint_id(mine):  # one server, however each spells it
        bucket, _ = split_s3_uri(uri)
        mirror = path.parent / bucket
        raise MirrorEndpointError(
            f"{uri}: the local mirror {mirror} holds bucket {bucket!r} of S3 endpoint {recorded} (recorded in {path}), "
            f"not of {mine} used now; set storage.cache_dir to another folder for this endpoint, or, once everything "
            f"in {mirror} is on {recorded} (run `grpoflow resume` there to upload pending checkpoints), delete "
            f"{mirror} and {path}"
        )
    return path


def mirrored_uri(folder: str | Path) -> str | None:
    """The s3:// URI whose local mirror ``folder`` is (or lies in): an ancestor ``A`` of it beside the record
    ``.<A's name>.endpoint`` is bucket A's mirror (:func:`claim_mirror` writes the record there, bucket names never
    start with '.'). None for any other folder."""
    path = Path(folder).expanduser().resolve()
    for bucket in (path, *path.parents):
        if bucket.name and (bucket.parent / f".{bucket.name}.endpoint").is_file():
            key = path.relative_to(bucket).as_posix()
            return f"s3://{bucket.name}" + ("" if key == "." else f"/{key}")
    return None
