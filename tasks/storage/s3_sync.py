"""Folder sync between a local folder and an S3 prefix (:meth:`FolderSync.upload_dir`,
:meth:`FolderSync.download_dir`, methods of :class:`~grpoflow.tasks.storage.s3.S3Client`).

Each call runs through one s3transfer ``TransferManager`` (``TRANSFER_CONCURRENCY`` files at once) and skips files
whose size and ETag already match, where the ETag of a local file is computed as S3 computes it: md5 of the bytes,
or for an object uploaded in N parts, md5 of the concatenated part md5s followed by "-N". ``markers`` name files
that mark a folder complete (a checkpoint's trainer_state.json): they are uploaded after, and deleted before,
everything else. A key that would download outside its folder is refused (:func:`confined`).
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from grpoflow.tasks.storage.s3_errors import S3UnsafeKeyError
from grpoflow.tasks.storage.s3_uri import split_s3_uri

MiB = 1024 * 1024
TRANSFER_CONCURRENCY = 8  # files (or parts) in flight at once in a folder sync: within botocore's pool of 10


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


class FolderSync:
    """S3Client's folder sync: uses its ``client``, ``settings``, ``_transfer_config``, ``_errors``,
    ``list_objects`` and ``delete_objects``."""

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
