"""What counts as a grpoflow run folder (tasks/pipeline/run_folder.py): the config.yaml grpoflow wrote, of this or an
earlier version, or a stage record; a folder with another tool's config.yaml is not one, locally as on S3."""

import json
import uuid

import pytest
import yaml

from grpoflow.flows.stages import PIPELINE
from grpoflow.tasks.config import ConfigError, StorageConfig, load_config
from grpoflow.tasks.pipeline.run_folder import STAGES, config_problem, foreign_config, run_folder_problem
from grpoflow.tasks.storage.store import open_store
from tests.paths import MICRO

FOREIGN = b"model: resnet50\nepochs: 3\n"


def _written() -> dict:
    """A config.yaml as flows/pipeline.py writes it: every section of the resolved config."""
    return load_config(str(MICRO)).to_dict()


def test_the_stage_folders_are_the_pipelines():
    assert set(PIPELINE.names) <= set(STAGES)


@pytest.mark.parametrize(
    ("text", "why"),
    [
        (FOREIGN, "top-level keys that are no config section: epochs"),
        (b"", "not a mapping of config sections"),
        (b"- a\n- b\n", "not a mapping of config sections"),
        (b"model: [unclosed\n", "not valid YAML"),
        (b"a: \x80\n", "not valid YAML"),
        (b"model: {name: resnet}\ndata: {path: x}\n", "no run, sft, grpo sections"),
        (b"defaults: [a]\nhydra: {run: {dir: out}}\n", "top-level keys that are no config section: defaults, hydra"),
    ],
)
def test_another_tools_config_is_named_as_such(text, why):
    assert config_problem(text) == why


def test_grpoflow_configs_of_this_and_earlier_versions_are_recognised():
    assert config_problem(yaml.safe_dump(_written(), sort_keys=False).encode()) is None
    assert config_problem(MICRO.read_bytes()) is None  # a config a user wrote: it loads
    old = _written()  # the first version's: no storage or distributed section, a key since removed
    del old["storage"], old["distributed"]
    old["grpo"]["a_key_since_removed"] = 1
    assert config_problem(yaml.safe_dump(old).encode()) is None


def test_a_folder_with_a_foreign_config_is_refused_naming_the_file_on_s3_too(seaweedfs, monkeypatch, tmp_path):
    for k, v in seaweedfs.env().items():
        monkeypatch.setenv(k, v)
    location = f"s3://{seaweedfs.bucket}/runs/{uuid.uuid4().hex[:8]}"
    store = open_store(location, StorageConfig(cache_dir=str(tmp_path / "cache")))
    store.write("config.yaml", FOREIGN)
    store.write("data/notes.txt", b"mine")
    foreign = foreign_config(store)
    assert foreign.startswith(f"{location}/config.yaml is no config grpoflow wrote (") and "epochs" in foreign
    problem = run_folder_problem(store, store.read("config.yaml"))
    assert problem.startswith(foreign) and "empty its data/" in problem and "\n" not in problem
    store.write("grpo/manifest.json", json.dumps({"stage": "grpo"}).encode())  # a run's record: it is a run
    assert foreign_config(store) is None


@pytest.mark.parametrize(
    ("name", "record"),
    [
        ("grpo/manifest.json", {"stage": "grpo", "finished_at": 1.0}),  # every version's manifest names its stage
        ("data/attempt.json", {"key": "k", "started_at": 1.0}),
        ("run.json", {"mlflow_run_id": "abc", "tracking_uri": "sqlite:///x"}),
    ],
)
def test_a_stage_record_makes_it_a_run_whatever_its_config_yaml(name, record, tmp_path):
    """A run whose config.yaml no longer reads as grpoflow's (edited by hand) is still the run its records say."""
    store = open_store(tmp_path)
    store.write("config.yaml", FOREIGN)
    store.write(name, json.dumps(record).encode())
    assert foreign_config(store) is None and run_folder_problem(store, FOREIGN) is None


def test_records_of_another_shape_do_not(tmp_path):
    (tmp_path / "config.yaml").write_bytes(FOREIGN)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "manifest.json").write_text(json.dumps({"files": ["a.csv"]}))  # another tool's manifest
    (tmp_path / "run.json").write_text("[1, 2]")
    assert f"{tmp_path / 'config.yaml'} is no config grpoflow wrote" in foreign_config(open_store(tmp_path))


def test_an_empty_folder_a_missing_one_and_a_run_pass(tmp_path):
    assert run_folder_problem(open_store(tmp_path / "none"), None) is None
    assert run_folder_problem(open_store(tmp_path), None) is None
    (tmp_path / ".grpoflow.lock").write_text("")
    assert run_folder_problem(open_store(tmp_path), None) is None
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(_written()))
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text("{}\n")
    store = open_store(tmp_path)
    assert foreign_config(store) is None and run_folder_problem(store, store.read("config.yaml")) is None


def test_a_deployed_run_refuses_other_folders(tmp_path):
    """The deployed pipeline flow (flows/deployment.py) has no `grpoflow run` before it: it checks the same."""
    from grpoflow.flows.deployment import refuse_other_folders, workspace_of

    cfg = load_config(str(MICRO), [f"run.output_dir={tmp_path}", "run.name=proj"])
    (tmp_path / "proj").mkdir()
    (tmp_path / "proj" / "config.yaml").write_bytes(FOREIGN)
    with pytest.raises(ConfigError, match="config.yaml is no config grpoflow wrote"):
        refuse_other_folders(cfg, workspace_of(cfg))
    (tmp_path / "proj" / "config.yaml").unlink()
    (tmp_path / "proj" / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="holds files of no grpoflow run"):
        refuse_other_folders(cfg, workspace_of(cfg))
    assert [p.name for p in (tmp_path / "proj").iterdir()] == ["notes.txt"]


def test_the_pipeline_flow_refuses_it_before_writing(tmp_path):
    """The flow itself (a continuous cycle, a deployed run) checks too, before its lock and config.yaml."""
    from grpoflow.flows.pipeline import grpo_pipeline

    (tmp_path / "config.yaml").write_bytes(FOREIGN)
    with pytest.raises(ConfigError, match="config.yaml is no config grpoflow wrote"):
        grpo_pipeline.fn(config=load_config(str(MICRO)), workspace=str(tmp_path))
    assert [p.name for p in tmp_path.iterdir()] == ["config.yaml"] and (
        tmp_path / "config.yaml"
    ).read_bytes() == FOREIGN
