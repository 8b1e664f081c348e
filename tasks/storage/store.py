"""Where a run's files live, behind one interface: a local folder or an s3://bucket/prefix (:class:`Store`).

A store is a ``location`` plus ``local_root``, the local folder where stages work on plain files. Every operation
takes names relative to the location ('grpo/manifest.json', 'grpo/checkpoints/'), so callers never branch on
where the files are. What every store guarantees:

* ``write`` is atomic: a reader sees the whole new content or the old (or nothing), never a part. Locally the
  bytes go to a temp file beside the target, fsynced, then ``os.replace`` and the folder fsynced (:func:`write_atomic`,
  the one helper for it: durable across a power loss);
  on S3 one PutObject is atomic by itself, and the local copy under ``local_root`` is written (atomically) first,
  so the mirror stays in step with what was written.
* ``delete`` removes names in the order given, and a missing name is fine (a local file the trainer pruned a
  moment before, an object another attempt removed). ``delete_folder`` deletes ``markers`` first and
  ``sync_up`` uploads them last: a folder holding its marker (a checkpoint's trainer_state.json) is complete.
* ``sync_up`` / ``sync_down`` make one side of a folder match the other: a file moves when its size or content
  digest differs (S3's ETag, computed locally as S3 computes it, multipart included); with ``delete`` what the
  source lacks is removed. For a :class:`LocalStore` local_root IS the location, so both are no-ops by
  construction; an :class:`S3Store` moves many files at once through one TransferManager per sync.
* ``guarded`` runs an upload within storage.outage_budget_s, retried through an outage of the S3 endpoint
  (tasks/storage/uploads.py); a local store just runs it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar, runtime_checkable

from grpoflow.tasks.config.storage import StorageConfig
from grpoflow.tasks.storage import s3
from grpoflow.tasks.storage.mirror import claim_mirror
from grpoflow.tasks.storage.uploads import retry_outage

T = TypeVar("T")

# s3:// location -> a check that raises while this process must not write there: the workspace lease it held was
# taken over (tasks/storage/lock.py registers it while it holds the lease); S3Store writes call :func:`fence` first
FENCES: dict[str, Callable[[], None]] = {}


def fence(uri: str) -> None:
    """Run the check of every lease held on ``uri`` or a prefix above it (:data:`FENCES`)."""
    for location, check in list(FENCES.items()):
        if uri == location or uri.startswith(location + "/"):
            check()


@dataclass(frozen=True)
class Entry:
    """One file of a store: its name relative to the location, its size, and a digest that changes with its
    content (S3's ETag; for a local file its size and modification time, which cost no read)."""

    name: str
    size: int
    etag: str


def fsync_dir(path: str | Path) -> None:
    """fsync folder ``path``, so the names created, renamed or removed in it survive a power loss (a rename is
    durable only once its folder is synced). Platforms that cannot open a folder (Windows) skip it."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except (IsADirectoryError, PermissionError):
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(folder: str | Path) -> None:
    """fsync every file under ``folder`` and every folder in it (``folder`` included): before a folder written
    file by file is published by a rename, so the rename never makes visible a folder whose bytes are still in the
    page cache only."""
    folder = Path(folder)
    for here, _, files in os.walk(folder):
        for name in files:
            fd = os.open(Path(here) / name, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(here)


def write_atomic(path: str | Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` whole or not at all, durably: a temp file in the same folder, flushed and
    fsynced, renamed over ``path``, then the folder fsynced (so the rename too survives a power loss). A crash
    leaves the old content, or no file, and at most a stray temp file that nothing reads; never an empty or
    truncated ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path


def join_location(location: str | Path, *names: str) -> str:
    """<location>/<names...> for a folder (made absolute) or an s3:// prefix."""
    if s3.is_s3_uri(str(location)):
        return s3.join_uri(str(location), *names)
    return str(Path(location).resolve().joinpath(*names))


def _join(*parts: str) -> str:
    return "/".join(p.strip("/") for p in parts if p.strip("/"))


@runtime_checkable
class Store(Protocol):
    """A local folder or an s3://bucket/prefix, and the local folder where its files are worked on."""

    settings: StorageConfig
    local_root: Path

    @property
    def location(self) -> str: ...

    @property
    def where(self) -> str: ...

    def write(self, name: str, data: bytes) -> None: ...

    def read(self, name: str) -> bytes | None: ...

    def exists(self, name: str) -> bool: ...

    def list(self, prefix: str = "") -> list[Entry]: ...

    def delete(self, names: Sequence[str]) -> None: ...

    def delete_folder(self, prefix: str, markers: Sequence[str] = ()) -> None: ...

    def sync_up(
        self, name: str, *, delete: bool = False, markers: Sequence[str] = (), exclude: Sequence[str] = ()
    ) -> list[str]: ...

    def sync_down(
        self, name: str, *, delete: bool = False, markers: Sequence[str] = (), exclude: Sequence[str] = ()
    ) -> list[str]: ...

    def guarded(self, fn: Callable[[], T], what: str) -> T: ...


def _local_files(root: Path, prefix: str) -> list[Entry]:
    """Files under root whose relative name starts with ``prefix``, sorted; files vanishing meanwhile are skipped
    (the trainer prunes checkpoints while a queued job lists them)."""
    base = root / prefix.rsplit("/", 1)[0] if "/" in prefix else root
    out = []
    for folder, _, files in os.walk(base):  # errors (a folder removed meanwhile) are ignored
        for file in files:
            path = Path(folder) / file
            name = path.relative_to(root).as_posix()
            if not name.startswith(prefix):
                continue
            try:
                st = path.stat()
            except FileNotFoundError:
                continue
            out.append(Entry(name, st.st_size, f"{st.st_size}-{st.st_mtime_ns}"))
    return sorted(out, key=lambda e: e.name)


def _unlink_local(root: Path, name: str) -> None:
    """Remove root/name (missing is fine) and the folders it leaves empty, up to root."""
    path = root / name
    path.unlink(missing_ok=True)
    for parent in path.parents:
        if parent == root or not parent.is_relative_to(root):
            break
        try:
            parent.rmdir()
        except OSError:  # not empty, or gone already
            break


class LocalStore:
    """A local folder: the location and local_root are the same folder, so syncing moves nothing."""

    def __init__(self, location: str | Path, settings: StorageConfig | None = None):
        self.settings = settings if settings is not None else StorageConfig()
        self.local_root = Path(location).resolve()

    def __repr__(self) -> str:
        return f"LocalStore({self.location!r})"

    @property
    def location(self) -> str:
        return str(self.local_root)

    @property
    def where(self) -> str:
        return str(self.local_root)

    def write(self, name: str, data: bytes) -> None:
        write_atomic(self.local_root / name, data)

    def read(self, name: str) -> bytes | None:
        try:
            return (self.local_root / name).read_bytes()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return None

    def exists(self, name: str) -> bool:
        return (self.local_root / name).is_file()

    def list(self, prefix: str = "") -> list[Entry]:
        return _local_files(self.local_root, prefix)

    def delete(self, names: Sequence[str]) -> None:
        for name in names:
            _unlink_local(self.local_root, name)

    def delete_folder(self, prefix: str, markers: Sequence[str] = ()) -> None:
        entries = self.list(_join(prefix) + "/")
        self.delete([e.name for e in entries if e.name.rsplit("/", 1)[-1] in markers])
        self.delete([e.name for e in entries if e.name.rsplit("/", 1)[-1] not in markers])
        shutil.rmtree(self.local_root / _join(prefix), ignore_errors=True)  # empty folders left behind

    def sync_up(
        self, name: str, *, delete: bool = False, markers: Sequence[str] = (), exclude: Sequence[str] = ()
    ) -> list[str]:
        return []  # local_root is the location

    def sync_down(
        self, name: str, *, delete: bool = False, markers: Sequence[str] = (), exclude: Sequence[str] = ()
    ) -> list[str]:
        return []

    def guarded(self, fn: Callable[[], T], what: str) -> T:
        return fn()


class S3Store:
    """s3://bucket/prefix, reached with the ``settings`` (endpoint, retries, multipart sizes); local_root is its
    mirror <storage.cache_dir>/<bucket>/<prefix>. S3 is the source of truth: reads go to S3, writes go to both.
    The mirror belongs to one endpoint: every call that touches it first :meth:`claim` s it."""

    def __init__(self, location: str, settings: StorageConfig | None = None):
        self.client = s3.S3Client(settings)
        self.settings = self.client.settings
        self.uri = s3.join_uri(location)
        s3.split_s3_uri(self.uri)  # a clear error for a malformed URI
        self.local_root = s3.local_path(self.uri, self.settings.cache_dir)
        self._claimed = False

    def claim(self) -> None:
        """Check (once) that the mirror belongs to this store's endpoint, recording it on first use: a
        :class:`~grpoflow.tasks.storage.mirror.MirrorEndpointError` when another endpoint's files are there
        (tasks/storage/mirror.py)."""
        if not self._claimed:
            claim_mirror(self.uri, self.settings.cache_dir, s3.endpoint_url(self.settings))
            self._claimed = True

    def __repr__(self) -> str:
        return f"S3Store({self.uri!r} at {self.where})"

    @property
    def location(self) -> str:
        return self.uri

    @property
    def where(self) -> str:
        return self.client.where

    def _uri(self, name: str) -> str:
        return s3.join_uri(self.uri, name)

    def write(self, name: str, data: bytes) -> None:
        fence(self.uri)
        self.claim()
        write_atomic(self.local_root / name, data)
        self.client.put_bytes(data, self._uri(name))

    def read(self, name: str) -> bytes | None:
        try:
            return self.client.get_bytes(self._uri(name))
        except s3.S3NoSuchBucketError:
            raise
        except s3.S3NotFoundError:
            return None

    def exists(self, name: str) -> bool:
        return self.client.exists(self._uri(name))

    def list(self, prefix: str = "") -> list[Entry]:
        base = self.uri + "/"
        objects = self.client.list_objects(base + prefix.lstrip("/"))
        return sorted((Entry(o["uri"][len(base) :], o["size"], o["etag"]) for o in objects), key=lambda e: e.name)

    def delete(self, names: Sequence[str]) -> None:
        fence(self.uri)
        self.claim()
        if names:
            self.client.delete_objects([self._uri(n) for n in names])
        for name in names:  # the mirror in step
            _unlink_local(self.local_root, name)

    def delete_folder(self, prefix: str, markers: Sequence[str] = ()) -> None:
        fence(self.uri)
        self.claim()
        self.client.delete_prefix(self._uri(prefix) + "/", markers=markers)
        shutil.rmtree(self.local_root / _join(prefix), ignore_errors=True)

    def sync_up(
        self, name: str, *, delete: bool = False, markers: Sequence[str] = (), exclude: Sequence[str] = ()
    ) -> list[str]:
        fence(self.uri)
        base = self._uri(name) + "/"
        self.claim()
        sent = self.client.upload_dir(self.local_root / name, base, delete=delete, markers=markers, exclude=exclude)
        return [_join(name, u[len(base) :]) for u in sent]

    def sync_down(
        self, name: str, *, delete: bool = False, markers: Sequence[str] = (), exclude: Sequence[str] = ()
    ) -> list[str]:
        self.claim()
        folder = self.local_root / name
        got = self.client.download_dir(self._uri(name), folder, delete=delete, markers=markers, exclude=exclude)
        return [_join(name, p.relative_to(folder).as_posix()) for p in got]

    def guarded(self, fn: Callable[[], T], what: str) -> T:
        out: list[T] = []
        retry_outage(lambda: out.append(fn()), self.where, what, self.settings.outage_budget_s)
        return out[-1]


def open_store(location: str | Path, storage: StorageConfig | None = None) -> Store:
    """The store of ``location``: an :class:`S3Store` for s3://bucket/prefix, else a :class:`LocalStore`."""
    if s3.is_s3_uri(str(location)):
        return S3Store(str(location), storage)
    return LocalStore(location, storage)
