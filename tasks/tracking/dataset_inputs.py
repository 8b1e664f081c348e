"""The prepared splits a stage reads, as MLflow dataset inputs of its run: Hugging Face datasets, by run id.

Each split (a ``Dataset.save_to_disk`` folder) is opened with ``datasets.load_from_disk`` (memory-mapped Arrow, no
copy) and described with ``mlflow.data.from_huggingface``:

source   where its rows came from, when the data stage knows (tasks/dataio/sources.py ``split_origins``): a hub
         dataset as ``HuggingFaceDatasetSource(path=id, config_name, split)``, a data file as ``path=<builder>,
         data_files=<file>`` (what ``datasets.load_dataset`` reloads it with: source type ``hugging_face``);
         the generated sources (arithmetic, humaneval) have no origin, so the split's folder is the source
digest    :func:`split_digest`: md5 of the split's Arrow files, so any changed row changes it (MLflow's own
         digest hashes a pandas copy of the first 10,000 rows only); also the stages' ``dataset_digest`` param
name     ``<dataset>-<split>``; the ``mlflow.data.context`` input tag says training / evaluation

Whole splits are never converted to pandas (the old ``from_pandas`` logging held each split twice in memory);
MLflow's schema inference reads a pandas copy of the first 10,000 rows. Logged with ``MlflowClient.log_inputs``
by run id: ``mlflow.log_input`` would start an unrelated run when no run is active.
"""

from __future__ import annotations

import hashlib
import warnings
from pathlib import Path
from typing import Any

from mlflow.tracking import MlflowClient

CONTEXTS = {"train": "training", "eval": "evaluation"}


def split_digest(path: str | Path) -> str:
    """8 hex characters (MLflow's digest length) of the md5 of the split folder's Arrow files, in name order,
    read in 1 MiB chunks. Raises FileNotFoundError naming the folder when it holds no Arrow file."""
    files = sorted(Path(path).glob("*.arrow"))
    if not files:
        raise FileNotFoundError(f"no .arrow files in the split folder {path}")
    md5 = hashlib.md5()
    for f in files:
        with f.open("rb") as fh:
            while chunk := fh.read(1 << 20):
                md5.update(chunk)
    return md5.hexdigest()[:8]


def split_dataset(path: str, name: str, origin: dict[str, Any] | None = None):
    """The saved split at ``path`` as an MLflow HuggingFaceDataset named ``name``; ``origin``: the
    ``datasets.load_dataset`` arguments its rows came from (None: the folder is its source)."""
    import datasets
    import mlflow.data
    from mlflow.data.huggingface_dataset_source import HuggingFaceDatasetSource

    ds = datasets.load_from_disk(path)
    source = HuggingFaceDatasetSource(**origin) if origin else str(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the source resolver's notes about which source type it chose
        return mlflow.data.from_huggingface(ds, source=source, name=name, digest=split_digest(path))


def log_datasets(client: MlflowClient, run_id: str, splits: dict[str, Any]) -> None:
    """Log {split: MLflow dataset} as inputs of ``run_id``, each with its context tag and its split's name."""
    from mlflow.entities import DatasetInput, InputTag

    inputs = [
        DatasetInput(
            dataset=ds._to_mlflow_entity(),
            tags=[InputTag("mlflow.data.context", CONTEXTS.get(split, split)), InputTag("split", split)],
        )
        for split, ds in splits.items()
    ]
    if inputs:
        client.log_inputs(run_id, datasets=inputs)
