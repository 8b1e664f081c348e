"""What the continuous flow watches: data files in a local folder or under an S3 prefix, and a ledger of the ones
it has already trained on.

A file is identified by its name (path relative to the source), size and content hash (sha256 for local files,
the ETag for S3 objects), so a file rewritten in place with new content counts as new, and the same bytes under
another name count as new too. An S3 ETag is not always a hash of the bytes (a multipart upload's is a hash of its
parts' hashes, so the same file uploaded with another part size, or to an SSE-KMS bucket, gets another ETag): the
ledger also records the sha256 of each snapshot a cycle read, and a file whose ETag is new but whose name, size
and sha256 are those of a file already recorded is not trained again (:meth:`Ledger.contents`, the cycle's
gather in tasks/ops/continuous.py). The ledger is one JSON file, replaced atomically and durably (a temporary file,
fsynced, then ``os.replace`` and an fsync of the folder), and the continuous flow adds to it only after a cycle
succeeded: a failed cycle consumes nothing. A cycle reads each file from one snapshot of the bytes its listing
identified (:func:`fetch`), so what it trains on is what the ledger records; a file changed since it was listed is
left for the next cycle.

Only data files the data stage reads are listed (.jsonl, .json, .csv, .parquet); names starting with "." or
"_", and everything in such folders, are skipped (in a local folder and under an S3 prefix alike), so a writer
can upload to a hidden name and rename when done (a half-written file is never trained on).
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from grpoflow.tasks.config.storage import StorageConfig
from grpoflow.tasks.storage.s3 import S3Client, is_s3_uri


@dataclass(frozen=True)
class DataFile:
    """One file of the source. ``uri`` is where to read it (a local path or s3:// URI); ``name`` its path relative
    to the source root (the part of the identity that survives moving the source)."""

    name: str
    uri: str
    size: int
    hash: str
    # of the bytes, once known (the hash itself for a local file, an S3 snapshot's); not part of equality: a file is
    # the one its listing named
    sha256: str | None = field(default=None, compare=False)

    @property
    def key(self) -> str:
        return f"{self.name}|{self.size}|{self.hash}"

    @property
    def content(self) -> tuple[str, int, str] | None:
        """(name, size, sha256): the file's identity by its bytes, whatever the ETag says; None until known."""
        return (self.name, self.size, self.sha256) if self.sha256 else None

    @classmethod
    def from_key(cls, key: str, uri: str = "") -> DataFile:
        """The file a :attr:`key` names (a name may hold "|"), at ``uri`` when known."""
        name, size, digest = key.rsplit("|", 2)
        return cls(name, uri, int(size), digest)


def _is_data_name(name: str) -> bool:
    from grpoflow.tasks.dataio.sources import (
        FILE_BUILDERS,  # here: dataio imports datasets, slow for a deployment's entry module
    )

    parts = name.split("/")  # a hidden folder ("_staging/", ".tmp/") hides its files too
    base = parts[-1]
    hidden = any(p.startswith((".", "_")) for p in parts)
    return bool(base) and not hidden and Path(base).suffix.lower() in FILE_BUILDERS


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def list_source(source: str, storage: StorageConfig | None = None) -> list[DataFile]:
    """Every data file under ``source`` (a local folder, or an s3://bucket/prefix reached with ``storage``), sorted
    by name."""
    if is_s3_uri(source):
        prefix = source.rstrip("/") + "/"
        files = [
            DataFile(o["uri"][len(prefix) :], o["uri"], int(o["size"]), str(o["etag"]).strip('"'))
            for o in S3Client(storage).list_objects(prefix)
            if o["uri"].startswith(prefix) and _is_data_name(o["uri"][len(prefix) :])
        ]
        return sorted(files, key=lambda f: f.name)
    root = Path(source).expanduser()
    if not root.is_dir():
        raise FileNotFoundError(f"data source {source!r}: not a folder (looked at {root.resolve()})")
    files = []
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if path.is_file() and _is_data_name(rel):
            digest = sha256_file(path)
            files.append(DataFile(rel, str(path.resolve()), path.stat().st_size, digest, digest))
    return files


class DataFileChanged(Exception):
    """A listed file's bytes are no longer the ones its listing identified (rewritten, appended to or deleted
    since): the cycle leaves it out and records nothing for it, so the next cycle lists and trains the new
    version once. The message names the file."""


def fetch(file: DataFile, dest_dir: Path, storage: StorageConfig | None = None) -> Path:
    """A local snapshot in ``dest_dir`` of exactly the bytes ``file`` names (its size and hash), which the cycle
    checks, trains on and then records: a local file is copied while hashed, an S3 object downloaded only while
    its ETag is still the listed one (If-Match). :class:`DataFileChanged` when the file changed since it was
    listed, so the ledger never records one version for rows read from another."""
    dest = dest_dir / file.name
    dest.parent.mkdir(parents=True, exist_ok=True)
    if is_s3_uri(file.uri):
        from grpoflow.tasks.storage.s3 import S3ChangedError, S3NoSuchBucketError, S3NotFoundError

        try:
            return S3Client(storage).download_file(file.uri, dest, if_match=file.hash)
        except S3NoSuchBucketError:
            raise
        except (S3ChangedError, S3NotFoundError) as e:
            raise DataFileChanged(f"{file.uri}: changed since it was listed ({e})") from None
    try:
        size, digest = _copy_hashed(Path(file.uri), dest)
    except FileNotFoundError:
        raise DataFileChanged(f"{file.uri}: deleted since it was listed") from None
    if (size, digest) != (file.size, file.hash):
        dest.unlink()
        raise DataFileChanged(f"{file.uri}: changed since it was listed ({file.size} -> {size} bytes)")
    return dest


def _copy_hashed(src: Path, dest: Path, chunk: int = 1 << 20) -> tuple[int, str]:
    """Copy ``src`` to ``dest``; the size and sha256 of the bytes copied (one read: what was hashed is what
    was copied)."""
    h, size = hashlib.sha256(), 0
    with open(src, "rb") as f, open(dest, "wb") as out:
        while block := f.read(chunk):
            h.update(block)
            out.write(block)
            size += len(block)
    return size, h.hexdigest()


class Ledger:
    """The files already consumed, in ``path`` (JSON: {"consumed": [{name, uri, size, hash, cycle, ...}], and
    "pending": the cycle under way, while there is one}): a local file, or an s3:// object reached with ``storage``
    (one PUT replaces it whole), so that a worker pod that restarts, or another worker, sees what was consumed."""

    def __init__(self, path: str | Path, storage: StorageConfig | None = None):
        self.location = str(path)
        self.store = S3Client(storage) if is_s3_uri(self.location) else None
        self.path = None if self.store else Path(path)

    def _read(self) -> str | None:
        if self.store is not None:
            from grpoflow.tasks.storage.s3 import S3NoSuchBucketError, S3NotFoundError

            try:
                return self.store.get_bytes(self.location).decode()
            except S3NoSuchBucketError:
                raise
            except S3NotFoundError:
                return None
        return self.path.read_text() if self.path.is_file() else None

    def _doc(self) -> dict:
        """The whole ledger: {"consumed": [...], "pending": the cycle under way or None}."""
        text = self._read()
        if text is None:
            return {"consumed": [], "pending": None}
        try:
            doc = json.loads(text)
            return {"consumed": list(doc["consumed"]), "pending": doc.get("pending")}
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"ledger {self.location}: not a grpoflow ledger ({type(e).__name__}: {e})") from e

    def entries(self) -> list[dict]:
        return self._doc()["consumed"]

    def pending(self) -> dict | None:
        """The cycle that started training and has not recorded its files (killed, or failed):
        {"cycle", "files": [DataFile.key trained], "champion": registry version or None}; None when there is none."""
        return self._doc()["pending"]

    def begin(self, cycle: str, files: list[DataFile], champion: str | None) -> None:
        """Say that cycle ``cycle`` trains ``files`` from ``champion`` (a registry version, or None): until
        :meth:`record` ends it, a later cycle that would train the same files from the same champion continues it
        (flows/continuous.py) instead of training them again from the start."""
        doc = self._doc()
        self._write({**doc, "pending": {"cycle": cycle, "files": [f.key for f in files], "champion": champion}})

    def keys(self) -> set[str]:
        """The identities of every file seen: consumed, or quarantined (not retried until it changes)."""
        return {f"{e['name']}|{e['size']}|{e['hash']}" for e in self.entries()}

    def quarantined(self) -> list[dict]:
        """The quarantined entries no later entry of the same name supersedes (a fixed file landed again under
        its name is consumed, or quarantined anew): each with its ``error``."""
        latest: dict[str, dict] = {}
        for e in self.entries():
            latest[e["name"]] = e
        return [e for e in latest.values() if e.get("quarantined")]

    def quarantine(self, bad: list[tuple[DataFile, str]], *, end_pending: bool = False, **info) -> None:
        """Record files that cannot train, each with its error: skipped by :meth:`new_files` until their content
        changes, listed by :meth:`quarantined` (`grpoflow continuous-status`); ``end_pending`` in the same write."""
        self._add([{**asdict(f), "quarantined": True, "error": error, **info} for f, error in bad], end_pending)

    def set_aside(self, error: str, listed: list[DataFile] = ()) -> dict | None:
        """End the pending cycle without training its files, for a cycle that fails on every run: each of its files
        is quarantined with ``error`` (skipped until its content changes, as a bad file is), in one write. ``listed``:
        the source's files, for their URIs (a file no longer listed keeps its name, size and hash). The pending
        cycle as it was; None, and nothing written, when there is none."""
        pending = self.pending()
        if pending is None:
            return None
        by_key = {f.key: f for f in listed}
        files = [by_key.get(k) or DataFile.from_key(k) for k in pending["files"]]
        self.quarantine([(f, error) for f in files], end_pending=True, cycle=pending["cycle"])
        return pending

    def contents(self) -> dict[tuple[str, int, str], dict]:
        """{(name, size, sha256): the latest entry} of the entries that recorded their bytes' sha256 (consumed, or
        quarantined): a listed file with a new key but one of these contents is a copy already seen (an S3 object
        uploaded again, its ETag another). Entries of older grpoflow recorded no sha256 and are not here."""
        out = {}
        for e in self.entries():
            if e.get("sha256"):
                out[(e["name"], int(e["size"]), e["sha256"])] = e
        return out

    def same_content(self, files: list[tuple[DataFile, dict]], **info) -> None:
        """Record ``files`` (each with the earlier entry of the same content: :meth:`contents`) as that entry was,
        consumed or quarantined with its error, and naming it (``same_as``: its key and cycle), without training
        them; the pending cycle stays. So the next listing skips them by their own key."""
        entries = []
        for f, seen in files:
            was = {"quarantined": True, "error": seen.get("error")} if seen.get("quarantined") else {}
            same_as = {"key": f"{seen['name']}|{seen['size']}|{seen['hash']}", "cycle": seen.get("cycle")}
            entries.append({**asdict(f), **was, "same_as": same_as, **info})
        self._add(entries)

    def new_files(self, files: list[DataFile]) -> list[DataFile]:
        """The files of ``files`` not in the ledger yet (a rewritten file has another size or hash: new)."""
        seen = self.keys()
        return [f for f in files if f.key not in seen]

    def record(self, files: list[DataFile], **info) -> None:
        """Add ``files`` (with ``info``, e.g. the cycle name and MLflow run id) and end the pending cycle, in one
        write of the whole ledger: a cycle's files are recorded once, or it stays pending."""
        self._add([{**asdict(f), **info} for f in files], end_pending=True)

    def _add(self, new: list[dict], end_pending: bool = False) -> None:
        """Append ``new`` entries (stamped) and replace the ledger whole; the caller holds the state folder's lock
        (flows/continuous.py), so this read-modify-write has one writer."""
        at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        doc = self._doc()
        stamped = [{**e, "quarantined_at" if e.get("quarantined") else "consumed_at": at} for e in new]
        entries = doc["consumed"] + stamped
        self._write({"consumed": entries, "pending": None if end_pending else doc["pending"]})

    def _write(self, doc: dict) -> None:
        text = json.dumps(doc if doc.get("pending") else {"consumed": doc["consumed"]}, indent=2)
        from grpoflow.tasks.storage.store import fence, write_atomic

        if self.store is not None:
            fence(self.location)  # WorkspaceLost when the state folder's lease was taken over: never overwrite its
            self.store.put_bytes(text.encode(), self.location)  # new holder's newer ledger
            return

        write_atomic(self.path, text.encode())  # fsynced, renamed, folder fsynced: a power loss keeps a whole ledger


STATE_PREFIX = "_grpoflow-continuous"  # under an s3:// source: skipped by list_source (a name starting with "_")


def state_location(source: str, state_dir: str | None, output_dir: str) -> str:
    """Where the continuous flow keeps its ledger and cycle workspaces: ``state_dir`` when given; else
    <run.output_dir>/continuous when that is on S3 or the source is local; else, for an s3:// source with a local
    output_dir, <source>/_grpoflow-continuous, so that a worker pod that restarts with an empty disk does not
    retrain on every file of the source. A local location is returned absolute."""
    from grpoflow.tasks.storage.s3 import join_uri

    if state_dir:
        return state_dir if is_s3_uri(state_dir) else str(Path(state_dir).expanduser().resolve())
    if is_s3_uri(output_dir):
        return join_uri(output_dir, "continuous")
    if is_s3_uri(source):
        return join_uri(source, STATE_PREFIX)
    return str((Path(output_dir).expanduser() / "continuous").resolve())
