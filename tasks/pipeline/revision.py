"""A hub model, and a hub dataset, pinned to one commit for the whole run.

``model.revision: null`` (the repo's default branch) or a branch or tag name names whatever was pushed last. A
run that loaded ``main`` on Monday and is resumed on Friday, after the model's authors fixed its chat template or
re-uploaded its weights, would train its last steps, evaluate and export on other weights and another tokenizer
than its first steps, with nothing to say so: a LoRA adapter continued on a base it was not trained on.

So when a run starts, :func:`pin_revision` resolves such a revision to the commit it names then (asked of the
hub, or read from the hub cache's ``refs/`` offline) and the run's config records that commit: config.yaml,
every stage key, the MLflow params, and the registered adapter's base reference. A resume loads exactly those
files; a later `grpoflow run` of the same run.name after a push is refused, naming ``model.revision <old> ->
<new>``, as any changed setting is. A commit given by the user is kept as it is. A workspace recorded before
pinning existed (its config.yaml asks for the same model and revision, unpinned) keeps its unpinned revision, so
an upgrade reruns nothing.

A hub dataset id as ``data.source`` is pinned the same way (``data.revision``): the data stage's prepared splits
already keep a run's rows, but a rerun of that stage, or a new run of the same config, read the dataset's newest
commit. Its rows load at the commit (tasks/dataio/sources.py ``load_hub_dataset``), from the hub cache's snapshot
when ``datasets`` cannot reach the hub.
"""

from __future__ import annotations

import logging
import re

import yaml

from grpoflow.tasks.config import PipelineConfig
from grpoflow.tasks.dataio.sources import is_hub_dataset
from grpoflow.tasks.pipeline.preflight import is_hub_model
from grpoflow.tasks.tracking.hub_base import hub_commit

log = logging.getLogger(__name__)

COMMIT = re.compile(r"[0-9a-f]{40}")


def recorded_unpinned(cfg: PipelineConfig, recorded: bytes | str | None, section: str = "model") -> bool:
    """The workspace's config.yaml (``recorded``) asks for this model (``section`` model) or hub dataset (data) at
    this same unpinned revision: a run made before revisions were pinned, which keeps what it recorded."""
    if recorded is None:
        return False
    try:
        old = (yaml.safe_load(recorded) or {}).get(section) or {}
    except yaml.YAMLError:
        return False
    now = getattr(cfg, section)
    name = "name" if section == "model" else "source"
    return old.get(name) == getattr(now, name) and old.get("revision") == now.revision


def pin_revision(cfg: PipelineConfig, recorded: bytes | str | None = None) -> tuple[PipelineConfig, str | None]:
    """(``cfg`` with model.revision, and data.revision for a hub dataset, the commits their revisions name now,
    the lines saying so), or (``cfg``, None) when there is nothing to pin: no hub model or dataset, commits
    already, a workspace recorded unpinned (``recorded``: its config.yaml), or a revision neither the hub nor the
    cache can resolve (warned; the stages then load it as before)."""
    said = []
    m = cfg.model
    if is_hub_model(m.name) and not _pinned(m.revision) and not recorded_unpinned(cfg, recorded):
        if commit := _commit("model.revision", m.name, m.revision, "model"):
            cfg = cfg.model_copy(update={"model": m.model_copy(update={"revision": commit})})
            said.append(_line("model.revision", m.name, commit, m.revision))
    d = cfg.data
    if is_hub_dataset(d.source) and not _pinned(d.revision) and not recorded_unpinned(cfg, recorded, "data"):
        if commit := _commit("data.revision", d.source, d.revision, "dataset"):
            cfg = cfg.model_copy(update={"data": d.model_copy(update={"revision": commit})})
            said.append(_line("data.revision", d.source, commit, d.revision))
    return cfg, "\n".join(said) or None


def _pinned(revision: str | None) -> bool:
    return bool(revision and COMMIT.fullmatch(revision))


def _commit(key: str, repo_id: str, revision: str | None, repo_type: str) -> str | None:
    try:
        return hub_commit(repo_id, revision, repo_type)
    except FileNotFoundError as e:
        log.warning("%s: not pinned: %s", key, e)
        return None


def _line(key: str, repo_id: str, commit: str, revision: str | None) -> str:
    asked = f"revision {revision!r}" if revision else "its default branch"
    return (
        f"{key}: {repo_id} pinned to commit {commit} ({asked} now); config.yaml records it, so every stage and a "
        "resume load these files whatever is pushed to the repo since"
    )
