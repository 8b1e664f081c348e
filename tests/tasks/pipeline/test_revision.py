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


DATASET = "grpoflow-test/sums"


def _rows(folder: Path, rows: list[dict]) -> Path:
    import json

    (folder / "data").mkdir(parents=True)
    (folder / "data" / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def test_a_hub_dataset_is_pinned_and_its_rows_load_at_that_commit_from_the_hub_cache(hub, tmp_path):
    """data.source a hub dataset id: pinned to the commit its default branch names when the run starts; after a
    push, rows load at the pinned commit. With the hub out of reach they load from the hub cache's snapshot, which
    `datasets` alone refuses (the way out the preflight's message names); a workspace recorded unpinned keeps
    its unpinned revision."""
    from grpoflow.tasks.dataio.sources import load_source

    v1 = [{"question": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(4)]
    first = write_hub_cache(hub["cache"], DATASET, _rows(tmp_path / "d1", v1), repo_type="dataset")
    cfg = load_config(str(MICRO), [f"data.source={DATASET}", "data.format=qa"])
    pinned, said = pin_revision(cfg)
    assert pinned.data.revision == first and cfg.data.revision is None
    from grpoflow.flows.stages import PIPELINE
    from grpoflow.tasks.pipeline.fingerprint import stage_keys

    assert stage_keys(PIPELINE, pinned)["data"] != stage_keys(PIPELINE, cfg)["data"]  # the commit is in the key
    assert said == (
        f"data.revision: {DATASET} pinned to commit {first} (its default branch now); config.yaml records it, so "
        "every stage and a resume load these files whatever is pushed to the repo since"
    )
    v2 = [{"question": "What is 9 + 9?", "answer": "18"}]
    second = write_hub_cache(hub["cache"], DATASET, _rows(tmp_path / "d2", v2), repo_type="dataset")
    assert [r["answer"] for r in load_source(DATASET, revision=first)] == ["1", "2", "3", "4"]
    assert [r["answer"] for r in load_source(DATASET, revision=second)] == ["18"]
    assert [r["answer"] for r in load_source(DATASET)] == ["18"]  # the branch: what was pushed last
    assert pin_revision(cfg)[0].data.revision == second
    recorded = yaml.safe_dump(cfg.to_dict())  # a run made before datasets were pinned keeps its branch
    assert pin_revision(cfg, recorded) == (cfg, None)
    with pytest.raises(ValueError, match=f"data source '{DATASET}' .*Hugging Face dataset id"):
        load_source(DATASET, revision="0" * 40)  # neither reachable nor cached
