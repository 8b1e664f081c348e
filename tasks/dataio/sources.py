"""Raw rows from a data source: the built-in task's name, a local or s3:// .jsonl/.json/.parquet/.csv file (an
S3 file is downloaded into storage.cache_dir first), or a Hugging Face dataset id."""

from __future__ import annotations

import csv
import os
import re
from collections.abc import Callable
from pathlib import Path

import datasets
from datasets import Dataset

from grpoflow.tasks.config.storage import StorageConfig
from grpoflow.tasks.runtime import s3

BUILTIN_SOURCE = "arithmetic"


FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


_HF_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")  # "name" or "owner/name"


def looks_like_file(source: str) -> bool:
    """A data-file suffix, an explicit path ('./x', '~/x', '/x'), or slashes that no HF id ('owner/name') has."""
    if Path(source).suffix.lower() in FILE_BUILDERS:
        return True
    if source.startswith((".", "~")) or os.path.isabs(source):
        return True
    return os.sep in source and not _HF_ID.match(source)


def _builder(source: str, suffix: str) -> str:
    builder = FILE_BUILDERS.get(suffix.lower())
    if builder is None:
        raise ValueError(
            f"data file {source!r}: unsupported suffix {suffix!r}; expected one of {sorted(FILE_BUILDERS)}"
        )
    return builder


def _load_file(path: Path, source: str) -> Dataset:
    builder = _builder(source, path.suffix)
    try:
        return datasets.load_dataset(builder, data_files=str(path), split="train")
    except Exception as e:  # any parse failure: re-raised naming the file
        raise ValueError(f"data file {source!r}: cannot read it as {builder}: {type(e).__name__}: {e}") from e


def fetch_s3_file(uri: str, storage: StorageConfig | None = None) -> Path:
    """Download an s3:// data file into the local cache (<storage.cache_dir>/<bucket>/<key>); its local path."""
    _builder(uri, Path(s3.split_s3_uri(uri)[1]).suffix)  # an unsupported suffix fails before any download
    store = s3.S3Store(storage)
    try:
        return store.download_file(uri, store.local_path(uri))
    except s3.S3NotFoundError as e:
        raise FileNotFoundError(f"data file not found: {uri!r} ({e})") from None


def load_source(
    source: str, split: str = "train", subset: str | None = None, storage: StorageConfig | None = None
) -> Dataset:
    """Raw rows of a local or s3:// data file (reached with ``storage``), or of ``split`` of a Hugging Face dataset
    id."""
    if s3.is_s3_uri(source):
        return _load_file(fetch_s3_file(source, storage), source)
    path = Path(source).expanduser()
    if path.is_file():
        return _load_file(path, source)
    if looks_like_file(source) and not path.exists():
        raise FileNotFoundError(f"data file not found: {source!r} (looked at {path.resolve()})")
    try:
        return datasets.load_dataset(source, subset, split=split)
    except Exception as e:  # hub, network and builder errors alike
        raise ValueError(
            f"data source {source!r} (split {split!r}) is neither a local "
            f"{'/'.join(sorted(FILE_BUILDERS))} file nor a reachable Hugging Face dataset id: "
            f"{type(e).__name__}: {e}"
        ) from e


def row_locator(source: str, storage: StorageConfig | None = None) -> Callable[[int], str]:
    """How to name row ``i`` (0-based, as loaded) of ``source`` to a user: for a .jsonl file (or a .json file of
    JSON lines) and a .csv file the line an editor shows (1-based; blank lines and the CSV header counted, a
    quoted CSV field over several lines starts its record's line), else the record's 1-based number."""
    path: Path | None = None
    if s3.is_s3_uri(source):
        local = s3.S3Store(storage).local_path(source)
        path = local if local.is_file() else None
    elif Path(source).expanduser().is_file():
        path = Path(source).expanduser()
    if path is None or path.suffix not in (".jsonl", ".json", ".csv"):
        return lambda i: f"row {i + 1}"
    if path.suffix == ".csv":
        lines = []
        with open(path, newline="", encoding="utf-8", errors="replace") as f:
            reader, start = csv.reader(f), 1
            for n, _ in enumerate(reader):
                if n:  # the header is not a row
                    lines.append(start)
                start = reader.line_num + 1
    else:
        with open(path, "rb") as f:
            head = f.read(4096).lstrip()
            if path.suffix == ".json" and head.startswith(b"["):
                return lambda i: f"record {i + 1}"
            f.seek(0)
            lines = [n for n, line in enumerate(f, 1) if line.strip()]
    return lambda i: f"line {lines[i]}" if i < len(lines) else f"row {i + 1}"
