"""A hub model pinned to one commit for the whole run.

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
"""

from __future__ import annotations

import logging
import re

import yaml

from grpoflow.tasks.config import PipelineConfig
from grpoflow.tasks.pipeline.preflight import is_hub_model
from grpoflow.tasks.tracking.hub_base import hub_commit

log = logging.getLogger(__name__)

COMMIT = re.compile(r"[0-9a-f]{40}")


def recorded_unpinned(cfg: PipelineConfig, recorded: bytes | str | None) -> bool:
    """The workspace's config.yaml (``recorded``) asks for this model at this same unpinned revision: a run made
    before revisions were pinned, which keeps what it recorded."""
    if recorded is None:
        return False
    try:
        model = (yaml.safe_load(recorded) or {}).get("model") or {}
    except yaml.YAMLError:
        return False
    return model.get("name") == cfg.model.name and model.get("revision") == cfg.model.revision


def pin_revision(cfg: PipelineConfig, recorded: bytes | str | None = None) -> tuple[PipelineConfig, str | None]:
    """(``cfg`` with model.revision the commit its revision names now, a line saying so), or (``cfg``, None) when
    there is nothing to pin: no hub model, a commit already, a workspace recorded unpinned (``recorded``: its
    config.yaml), or a revision neither the hub nor the cache can resolve (warned; the stages then load it as
    before)."""
    m = cfg.model
    if not is_hub_model(m.name) or (m.revision and COMMIT.fullmatch(m.revision)) or recorded_unpinned(cfg, recorded):
        return cfg, None
    try:
        commit = hub_commit(m.name, m.revision)
    except FileNotFoundError as e:
        log.warning("model.revision: not pinned: %s", e)
        return cfg, None
    pinned = cfg.model_copy(update={"model": m.model_copy(update={"revision": commit})})
    asked = f"revision {m.revision!r}" if m.revision else "its default branch"
    return pinned, (
        f"model.revision: {m.name} pinned to commit {commit} ({asked} now); config.yaml records it, so every stage "
        "and a resume load these files whatever is pushed to the repo since"
    )
