"""Prepared splits as MLflow dataset inputs (a real `mlflow server`): Hugging Face datasets whose source is the
rows' origin (a data file, a hub dataset's split), named and tagged per split, with a digest of the split's
rows that any changed row changes."""

import json
from pathlib import Path

import pytest
from datasets import Dataset
from mlflow.tracking import MlflowClient

from grpoflow.tasks.config import DataConfig
from grpoflow.tasks.dataio.sources import split_origins
from grpoflow.tasks.tracking.dataset_inputs import log_datasets, split_dataset, split_digest

ROWS = [{"prompt": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(50)]


def saved(rows: list[dict], path: Path) -> str:
    Dataset.from_list(rows).save_to_disk(str(path))
    return str(path)


def inputs_by_split(client: MlflowClient, run_id: str) -> dict:
    return {
        {t.key: t.value for t in d.tags}["split"]: (d.dataset, {t.key: t.value for t in d.tags})
        for d in client.get_run(run_id).inputs.dataset_inputs
    }


def test_splits_of_a_data_file_are_logged_with_the_file_as_their_hugging_face_source(mlflow_server, tmp_path):
    data_file = tmp_path / "rows.jsonl"
    data_file.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    origins = split_origins(DataConfig(source=str(data_file)))
    train, ev = saved(ROWS[:40], tmp_path / "train"), saved(ROWS[40:], tmp_path / "eval")
    client = MlflowClient(mlflow_server)
    run = client.create_run(client.create_experiment("dataset-inputs-file")).info.run_id
    splits = {"train": split_dataset(train, "rows-train", origins["train"])}
    splits["eval"] = split_dataset(ev, "rows-eval", origins["eval"])
    log_datasets(client, run, splits)

    logged = inputs_by_split(client, run)
    assert sorted(logged) == ["eval", "train"]
    for split, folder, rows, context in (("train", train, 40, "training"), ("eval", ev, 10, "evaluation")):
        dataset, tags = logged[split]
        assert dataset.name == f"rows-{split}" and tags["mlflow.data.context"] == context
        assert dataset.source_type == "hugging_face"
        source = json.loads(dataset.source)
        assert (source["path"], source["data_files"]) == ("json", str(data_file.resolve()))
        assert dataset.digest == split_digest(folder)
        assert json.loads(dataset.profile)["num_rows"] == rows
        assert "prompt" in dataset.schema
    assert logged["train"][0].digest != logged["eval"][0].digest


def test_a_hub_dataset_split_is_the_source_and_the_digest_follows_the_rows(mlflow_server, tmp_path):
    origins = split_origins(DataConfig(source="openai/gsm8k", subset="main", eval_source="test"))
    assert origins["train"] == {"path": "openai/gsm8k", "config_name": "main", "split": "train"}
    assert origins["eval"] == {"path": "openai/gsm8k", "config_name": "main", "split": "test"}
    client = MlflowClient(mlflow_server)
    exp = client.create_experiment("dataset-inputs-hub")
    same = saved(ROWS, tmp_path / "a"), saved(ROWS, tmp_path / "b")  # the same rows saved twice
    changed = saved([*ROWS[:-1], {"prompt": "What is 49 + 1?", "answer": "51"}], tmp_path / "c")  # one answer
    digests = []
    for folder in (*same, changed):
        run = client.create_run(exp).info.run_id
        log_datasets(client, run, {"train": split_dataset(folder, "gsm8k-train", origins["train"])})
        dataset, tags = inputs_by_split(client, run)["train"]
        assert dataset.source_type == "hugging_face" and tags["mlflow.data.context"] == "training"
        source = json.loads(dataset.source)
        assert (source["path"], source["config_name"], source["split"]) == ("openai/gsm8k", "main", "train")
        digests.append(dataset.digest)
    assert digests[0] == digests[1] != digests[2]


def test_generated_sources_have_no_origin_and_an_empty_folder_is_refused(tmp_path):
    assert split_origins(DataConfig(source="arithmetic")) == {"train": None, "eval": None}
    folder = saved(ROWS, tmp_path / "train")
    assert split_dataset(folder, "arithmetic-train").source.to_dict()["uri"].endswith("train")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=f"no .arrow files in the split folder {tmp_path / 'empty'}"):
        split_digest(tmp_path / "empty")
