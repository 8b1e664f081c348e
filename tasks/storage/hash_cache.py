"""The sha256 of big local files, remembered per machine, so stage keys can name every file by its content.

Stage keys once named files over 64 MiB by size + mtime_ns, to spare a multi-GB hash on every ``grpoflow run``;
but a model folder copied to another machine, restored from a backup or checked out again by ``git lfs`` has new
mtimes, and `grpoflow resume` then reran (and emptied) finished stages over unchanged weights. Now every file is
hashed, and this cache makes that cheap after the first time: <storage.cache_dir>/.sha256-cache.json maps a
file's absolute path to the sha256 it had at a stat stamp (size, mtime_ns, ctime_ns, inode, device). An entry is
believed only while the file still has that exact stamp: any write changes mtime or ctime (ctime even when the
mtime is set back), and a replaced or copied file has another inode, so it is hashed again, never trusted on its
mtime alone. The file is rewritten atomically, merged with what another process wrote meanwhile; a missing,
corrupt or foreign cache file only costs a rehash. The name starts with a dot: no bucket mirror (<bucket>/...)
under the same folder can take it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from grpoflow.tasks.storage.store import write_atomic

log = logging.getLogger(__name__)

CACHE_FILE = ".sha256-cache.json"
CACHE_MIN = 64 * 2**20  # bytes: smaller files are hashed on every run (fast), and not cached
BLOCK = 8 * 2**20  # bytes read at a time
LOUD = 2**30  # files at least this large are logged when hashed: the first run on a machine reads them whole
VERSION = 1


def stamp(st: os.stat_result) -> list[int]:
    """What must be unchanged for a recorded hash to still hold."""
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


def sha256_of(path: Path, size: int) -> str:
    """The sha256 of a file, read in BLOCK-sized reads; a file of LOUD bytes or more is logged before and after."""
    loud = size >= LOUD
    if loud:
        log.info("hashing %s (%.1f GiB) for the stage keys; remembered for later runs", path, size / 2**30)
    started = time.monotonic()
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(BLOCK):
            h.update(block)
    if loud:
        log.info("hashed %s in %.0f s", path, time.monotonic() - started)
    return h.hexdigest()


def _read(file: Path) -> dict[str, dict[str, Any]]:
    """The entries of the cache file; {} when it is missing, unreadable or not one this module wrote."""
    try:
        data = json.loads(file.read_bytes())
    except (OSError, ValueError):
        return {}
    files = data.get("files") if isinstance(data, dict) and data.get("version") == VERSION else None
    if not isinstance(files, dict):
        return {}
    return {k: v for k, v in files.items() if isinstance(v, dict) and isinstance(v.get("sha256"), str)}


def _current(path: str, entry: dict[str, Any]) -> bool:
    """Whether the file at ``path`` still has the stamp ``entry`` was hashed at."""
    try:
        return entry.get("stamp") == stamp(os.stat(path))
    except OSError:
        return False


class HashCache:
    """The hash cache of one folder (None: no cache, every file hashed), loaded once, saved by :meth:`save`."""

    def __init__(self, folder: str | Path | None):
        self.file = Path(folder).expanduser() / CACHE_FILE if folder is not None else None
        self.entries = _read(self.file) if self.file else {}
        self.added: dict[str, dict[str, Any]] = {}

    def sha256(self, path: Path, st: os.stat_result) -> str:
        """The sha256 of ``path`` (stat ``st``): the recorded one while its stamp holds, else read and recorded."""
        if self.file is None or st.st_size < CACHE_MIN:
            return sha256_of(path, st.st_size)
        name = str(path.resolve())
        entry = self.entries.get(name)
        if entry is not None and entry.get("stamp") == stamp(st):
            return entry["sha256"]
        digest = sha256_of(path, st.st_size)
        self.added[name] = self.entries[name] = {"stamp": stamp(st), "sha256": digest}
        return digest

    def save(self) -> None:
        """Write the new entries, merged with the file as it is now (another process may have added some), and
        without the entries whose file is gone or changed. A failed write is logged: the next run rehashes."""
        if self.file is None or not self.added:
            return
        merged = {**_read(self.file), **self.added}
        kept = {k: v for k, v in sorted(merged.items()) if _current(k, v)}
        try:
            write_atomic(self.file, json.dumps({"version": VERSION, "files": kept}, indent=1).encode())
        except OSError as e:
            log.warning("could not write the hash cache %s (%s); big files will be hashed again", self.file, e)
        self.added = {}
