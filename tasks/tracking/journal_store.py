"""Which MLflow store a tracking journal was written for, and whether another store is the same one.

A journal's lines name runs by id: sent to another store (a shell without the run's $MLFLOW_TRACKING_URI sends to the
local SQLite default) every line fails, so ``grpoflow sync`` compares the store recorded in ``<name>.store.json``
with the one it would send to and refuses a different one unless told (``--force-store``). The recorded URI has its
credentials redacted: the journal is a plain file in the workspace, and may be copied or uploaded with it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from grpoflow.tasks.config.secrets import redact


def redact_uri(uri: str) -> str:
    """``uri`` without secrets (user info and secret query values as ``***``): the one redaction every URI the run
    writes gets (tasks/config/secrets.py)."""
    return redact(uri)


def store_key(uri: str) -> str:
    """What makes two URIs the same store: scheme and host in lower case, no user info, no trailing slash, a
    SQLite or file path resolved (``sqlite:///runs/../runs/mlflow.db`` is ``sqlite:///<abs>/runs/mlflow.db``)."""
    parts = urlsplit(redact_uri(uri))
    scheme = parts.scheme.lower()
    if scheme in ("sqlite", "file", ""):
        path = uri.split(":///", 1)[1] if ":///" in uri else parts.path
        return f"{scheme or 'file'}://{Path(path).resolve()}"
    host = parts.netloc.rsplit("@", 1)[-1].lower()
    return urlunsplit((scheme, host, parts.path.rstrip("/"), "", ""))


def store_record(uri: str, experiment: str | None) -> dict[str, Any]:
    """What a journal records about its store: the redacted tracking URI and the experiment."""
    return {"tracking_uri": redact_uri(uri), "experiment": experiment}


def recorded_store(journal_path: Path) -> dict[str, Any] | None:
    """The store record beside ``<name>.jsonl`` (``<name>.store.json``); None for a journal that has none (older)."""
    path = journal_path.with_name(journal_path.name.removesuffix(".jsonl") + ".store.json")
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def other_store(journal_path: Path, uri: str) -> dict[str, Any] | None:
    """The record of the store ``journal_path`` was written for when that is not ``uri``'s store; else None."""
    record = recorded_store(journal_path)
    if record is None or not record.get("tracking_uri"):
        return None
    return None if store_key(record["tracking_uri"]) == store_key(uri) else record


def describe(record: dict[str, Any]) -> str:
    exp = record.get("experiment")
    return f"{record['tracking_uri']}" + (f" (experiment {exp!r})" if exp else "")
