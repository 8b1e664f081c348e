"""A hub base model of an adapter-only MLflow model: its commit, its cached folder, and the reference MLflow loads.

mlflow 3.17's transformers flavour references a PEFT model's hub base by repo and commit (``source_model_name``,
``source_model_revision``) and loads the base and the tokenizer from the hub at that commit. Left to itself it
cannot save one here:

- it asks the hub for the repo's *latest* commit (``HfApi().model_info(repo).sha``, in
  ``mlflow.utils.huggingface_utils.get_latest_commit_for_repo``): a network call, refused offline
  (``HF_HUB_OFFLINE``), and the hub's newest commit rather than the one whose weights the adapter was applied to;
- it asks the same for the tokenizer's source, which for the exported tokenizer is the adapter folder (not a repo
  id): refused by the hub client even online.

So grpoflow resolves the commit itself (:func:`hub_commit`: from the hub, or from the local cache offline), loads
the base at that commit, saves with MLflow's ``base_model_path`` option pointed at the cached snapshot
(:func:`hub_snapshot`; MLflow then calls no hub API and writes no base weights), and rewrites the saved flavour to
the hub reference (:func:`reference_hub_base`). The tokenizer then loads from the hub at the same commit too: mlflow
3.17 loads every component of a hub-referenced model from the hub, so :func:`check_same_tokenizer` refuses an
exported tokenizer whose vocabulary differs from the base's.
"""

from __future__ import annotations

import shutil
from pathlib import Path

FLAVOR = "transformers"


def hub_commit(repo_id: str, revision: str | None = None, repo_type: str = "model") -> str:
    """The commit ``revision`` of ``repo_id`` (a ``repo_type`` repo: model or dataset) names (a branch, tag or
    commit; None: the default branch): asked of the hub, or read from the local hub cache (``refs/<revision>``)
    when the hub cannot be reached or ``HF_HUB_OFFLINE`` is set. A commit is returned as it is once the cache or
    the hub knows it."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import RevisionResolutionError

    try:
        return str(HfApi().resolve_revision(repo_id, repo_type=repo_type, revision=revision).resolved)
    except RevisionResolutionError as e:
        ref = revision or "main"
        what = "base model" if repo_type == "model" else repo_type
        raise FileNotFoundError(
            f"{what} {repo_id} is neither a local folder nor a hub repo whose revision {ref!r} can be resolved "
            f"(the hub cannot be reached and the hub cache has no refs/{ref} for it): {e}"
        ) from e


def hub_snapshot(repo_id: str, commit: str) -> Path:
    """The hub cache folder of ``repo_id`` at ``commit`` (the one holding its config.json)."""
    from huggingface_hub import try_to_load_from_cache

    config = try_to_load_from_cache(repo_id, "config.json", revision=commit)
    if not isinstance(config, str):
        raise FileNotFoundError(f"registry: no config.json of {repo_id} at commit {commit} in the hub cache")
    return Path(config).parent


def check_same_tokenizer(tokenizer, repo_id: str, commit: str, source: str) -> None:
    """Refuse the exported tokenizer (from ``source``) if its vocabulary is not the base's at ``commit``: the
    registered model loads the base's tokenizer from the hub, not the exported one."""
    from transformers import AutoTokenizer

    base = AutoTokenizer.from_pretrained(repo_id, revision=commit)
    if base.get_vocab() != tokenizer.get_vocab():
        raise ValueError(
            f"registry: the tokenizer in {source} has a vocabulary other than {repo_id}@{commit}'s; an adapter on a "
            "hub base is registered with the base's tokenizer, so this export cannot be"
        )


def reference_hub_base(path: Path, repo_id: str, commit: str) -> None:
    """Turn the model saved at ``path`` with ``base_model_path`` (a local-base reference) into a reference to
    ``repo_id`` at ``commit`` for the base model and its tokenizer, as mlflow writes for a hub base: the saved model
    keeps the adapter (``peft/``) and no base weights or tokenizer files."""
    from mlflow.models import Model
    from mlflow.transformers.flavor_config import FlavorKey  # imports transformers: here, not when grpoflow loads

    mlmodel = Model.load(str(path / "MLmodel"))
    conf = mlmodel.flavors[FLAVOR]
    if FlavorKey.MODEL_LOCAL_BASE not in conf or FlavorKey.PEFT not in conf:
        raise ValueError(f"registry: {path / 'MLmodel'} is not a PEFT model saved with a local base path")
    del conf[FlavorKey.MODEL_LOCAL_BASE]
    conf[FlavorKey.MODEL_NAME] = repo_id
    conf[FlavorKey.MODEL_REVISION] = commit
    for component in conf.get(FlavorKey.COMPONENTS, []):
        conf[FlavorKey.COMPONENT_NAME.format(component)] = repo_id
        conf[FlavorKey.COMPONENT_REVISION.format(component)] = commit
    shutil.rmtree(path / "components", ignore_errors=True)  # loaded from the hub, as the flavour now says
    mlmodel.model_size_bytes = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    mlmodel.save(str(path / "MLmodel"))
