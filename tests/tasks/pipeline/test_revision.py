"""A hub model's revision is pinned to a commit when a run starts (tasks/pipeline/revision.py): resolved from a
hub cache written here with the hub offline, as huggingface_hub resolves it; a commit, a local model, and a
workspace recorded unpinned are left as they are."""

from pathlib import Path

import pytest
import yaml

from grpoflow.tasks.config import load_config
from grpoflow.tasks.pipeline.revision import pin_revision
from grpoflow.tasks.tracking.hub_base import hub_commit
from tests.hub_cache import offline_hub, write_hub_cache
from tests.paths import MICRO

REPO = "grpoflow-test/pinned"


def _files(folder: Path, text: str) -> Path:
    folder.mkdir()
    (folder / "config.json").write_text(text)
    return folder


@pytest.fixture
def hub(tmp_path, monkeypatch) -> dict:
    cache = tmp_path / "hf" / "hub"
    first = write_hub_cache(cache, REPO, _files(tmp_path / "v1", '{"model_type": "llama"}'))
    offline_hub(monkeypatch, cache)
    return {"cache": cache, "first": first, "tmp": tmp_path}


def test_the_default_branch_or_a_tag_is_pinned_to_the_commit_it_names_now(hub):
    cfg = load_config(str(MICRO), [f"model.name={REPO}"])
    pinned, said = pin_revision(cfg)
    assert pinned.model.revision == hub["first"] and cfg.model.revision is None
    assert said.startswith(f"model.revision: {REPO} pinned to commit {hub['first']} (its default branch now)")
    # a push moves main: a new run pins the new commit; a tag pins the commit it names
    second = write_hub_cache(hub["cache"], REPO, _files(hub["tmp"] / "v2", '{"model_type": "qwen2"}'))
    assert pin_revision(cfg)[0].model.revision == second != hub["first"]
    tag = write_hub_cache(hub["cache"], REPO, _files(hub["tmp"] / "tagged", '{"model_type": "gpt2"}'), ref="v1")
    tagged = load_config(str(MICRO), [f"model.name={REPO}", "model.revision=v1"])
    assert pin_revision(tagged)[0].model.revision == tag == hub_commit(REPO, "v1") != second
    # what the run's config.yaml then holds, and a resume reads back
    assert yaml.safe_load(yaml.safe_dump(pin_revision(cfg)[0].to_dict()))["model"]["revision"] == second


def test_a_commit_a_local_model_and_a_workspace_recorded_unpinned_keep_their_revision(hub, tmp_path):
    commit = "0123456789abcdef0123456789abcdef01234567"  # not even in the cache: nothing is asked of the hub
    given = load_config(str(MICRO), [f"model.name={REPO}", f"model.revision={commit}"])
    assert pin_revision(given) == (given, None)
    for name in ("tiny", str(_files(tmp_path / "local", "{}"))):
        cfg = load_config(str(MICRO), [f"model.name={name}"])
        assert pin_revision(cfg) == (cfg, None)
    unpinned = load_config(str(MICRO), [f"model.name={REPO}"])
    recorded = yaml.safe_dump(unpinned.to_dict())  # a run made before pinning: it keeps loading its branch
    assert pin_revision(unpinned, recorded) == (unpinned, None)
    other = yaml.safe_dump(load_config(str(MICRO), [f"model.name={REPO}", "model.revision=v9"]).to_dict())
    assert pin_revision(unpinned, other)[0].model.revision == hub["first"]  # it asked for another revision


def test_a_revision_neither_the_hub_nor_the_cache_knows_is_left_unpinned_with_a_warning(hub, caplog):
    cfg = load_config(str(MICRO), ["model.name=grpoflow-test/not-cached"])
    assert pin_revision(cfg) == (cfg, None)
    assert "model.revision: not pinned: base model grpoflow-test/not-cached is neither a local folder" in caplog.text
