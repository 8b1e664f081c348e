"""Checks `grpoflow run` and `grpoflow resume` make before any stage, each returning why the run cannot start (a
line naming the config key) or None. Nothing here retries: a server or hub that does not answer in a few
seconds is reported now, not after the data stage and minutes of a client's own retries.

- :func:`output_dir_problem`: run.output_dir under an existing file, or in a folder this process cannot write (a
  read-only mount, another user's folder): no workspace can be made there.
- :func:`tracking_problem` (tasks/tracking/reach.py): an http(s) MLflow tracking URI that does not answer. One GET
  with a short timeout; any HTTP answer (even 404 behind a proxy) counts as reachable.
- :func:`hub_problem`: a Hugging Face model or dataset id that is not in the local cache while the hub cannot
  be reached (HF_HUB_OFFLINE set, or its endpoint, $HF_ENDPOINT or https://huggingface.co, not answering), or
  answers that the id is gated or private (401/403: HF_TOKEN named) or does not exist (404).
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

from grpoflow.tasks.tracking.reach import PROBE_TIMEOUT_S, probe, tracking_problem, unreachable

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")  # "name" or "owner/name"
_TRUE = ("1", "on", "yes", "true")


def output_dir_problem(output_dir: str) -> str | None:
    """run.output_dir (a local path) whose nearest existing ancestor, or itself, is not a folder."""
    if "://" in output_dir:
        return None
    path = Path(output_dir).expanduser().absolute()
    for p in (path, *path.parents):
        if p.exists():
            if p.is_dir():
                return _unwritable(output_dir, path, p)
            what = "is a file" if p == path else f"lies under {p}, which is a file"
            return f"run.output_dir: {output_dir} {what}; a run workspace needs a folder there"
    return None


def _unwritable(output_dir: str, path: Path, folder: Path) -> str | None:
    """``folder`` (run.output_dir or its nearest existing ancestor) refusing a new entry: a real try (a probe folder
    made and removed), since permission bits say nothing of a read-only mount and nothing to root."""
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".grpoflow-write-probe-", dir=folder))
    except OSError as e:
        where = "" if folder == path else f" (it would be made inside {folder})"
        why = e.strerror or type(e).__name__
        return (
            f"run.output_dir: {output_dir} is not writable{where}: {why}; choose a folder this user can write "
            "(run.output_dir=...) or fix its permissions"
        )
    return None


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in _TRUE


def is_hub_id(name: str) -> bool:
    """'owner/name' (or 'name') that is no existing local path."""
    return bool(_HUB_ID.match(name)) and not Path(name).expanduser().exists()


def is_hub_model(name: str) -> bool:
    """model.name names a hub repo (not tiny, a fetched alias, a .gguf file or an existing local folder)."""
    from grpoflow.tasks.model.sources import ALIASES, is_gguf

    return name != "tiny" and name not in ALIASES and not is_gguf(name) and is_hub_id(name)


def hub_cache() -> Path:
    from huggingface_hub import constants

    return Path(os.environ.get("HF_HUB_CACHE") or constants.HF_HUB_CACHE)


def _hub_endpoint() -> str:
    from huggingface_hub import constants

    return (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


def model_cached(repo_id: str, revision: str | None) -> bool:
    """The model's config.json is in the hub cache (what from_pretrained reads first)."""
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(repo_id, "config.json", cache_dir=hub_cache(), revision=revision)
    return isinstance(found, str)


def dataset_cached(repo_id: str) -> list[Path]:
    """Where a dataset id has files on this machine: its hub-cache snapshots, or a `datasets` cache folder."""
    import datasets.config

    places = [
        hub_cache() / f"datasets--{repo_id.replace('/', '--')}" / "snapshots",
        Path(datasets.config.HF_DATASETS_CACHE) / repo_id.replace("/", "___"),
    ]
    return [p for p in places if p.is_dir() and any(p.iterdir())]


def _hub_token() -> str | None:
    """The token huggingface_hub would send: $HF_TOKEN, else the one `hf auth login` saved."""
    from huggingface_hub import get_token

    return get_token()


def _hub_refusal(key: str, repo_id: str, kind: str, endpoint: str, status: int, has_token: bool) -> str | None:
    """The hub answered about ``repo_id``: None when it may be downloaded (2xx, or a status that says nothing
    about the repo, such as a 5xx the download retries), else why not, naming ``key`` and HF_TOKEN."""
    page = f"{endpoint}/{'datasets/' if kind == 'dataset' else ''}{repo_id}"
    if status in (401, 403):
        if has_token:
            return (
                f"{key}: the hub {endpoint} refuses {repo_id!r} with the token it was sent (HTTP {status}): a gated "
                f"{kind} whose terms this account has not accepted (open {page}), or a token without read access "
                "to it; fix HF_TOKEN, or accept the terms"
            )
        return (
            f"{key}: the hub {endpoint} refuses {repo_id!r} without a login (HTTP {status}): a gated or private "
            f"{kind}, or none by that name; set HF_TOKEN to a read token of an account with access (accept the "
            f"terms at {page}), or check the id"
        )
    if status == 404:
        return f"{key}: no {kind} {repo_id!r} on the hub {endpoint} (HTTP 404); check the id (owner/name)"
    return None


def hub_problem(key: str, repo_id: str, kind: str, revision: str | None = None) -> str | None:
    """``repo_id`` (a model or dataset id, the value of config key ``key``) that is not cached here while the hub
    cannot be reached: the message names the key, the cache folder looked in and the ways out."""
    cached = model_cached(repo_id, revision) if kind == "model" else bool(dataset_cached(repo_id))
    if cached:
        return None
    if _env_true("HF_HUB_OFFLINE") or (kind == "dataset" and _env_true("HF_DATASETS_OFFLINE")):
        why = "HF_HUB_OFFLINE is set" if _env_true("HF_HUB_OFFLINE") else "HF_DATASETS_OFFLINE is set"
    else:
        endpoint = _hub_endpoint()
        token = _hub_token()
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        status, reason = probe(f"{endpoint}/api/{kind}s/{repo_id}", PROBE_TIMEOUT_S, headers)
        if status is not None:
            return _hub_refusal(key, repo_id, kind, endpoint, status, bool(token))
        why = f"the hub {endpoint} does not answer ({reason})"
    local = "a local model folder" if kind == "model" else "a local .jsonl/.json/.parquet/.csv file"
    download = f"hf download {repo_id}" + (" --repo-type dataset" if kind == "dataset" else "")
    return (
        f"{key}: {repo_id!r} is a Hugging Face {kind} id not in the local cache (looked in {hub_cache()}) and {why}; "
        f"set {key} to {local}, pre-fill the cache (`{download}` "
        "where the hub is reachable, then copy the cache or point HF_HOME at it), or, once cached, set "
        "HF_HUB_OFFLINE=1"
    )


__all__ = ["PROBE_TIMEOUT_S", "hub_problem", "output_dir_problem", "tracking_problem", "unreachable"]
