"""Reading back the prepared splits (<folder>/train, <folder>/eval) of the stage that prepares them: the stage shell
and the stages pass that stage's folder (tasks/stages/common.py ``prepared``), so nothing here names a stage."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import datasets
from datasets import Dataset


def split_path(folder: str | Path, split: str) -> Path:
    """Where a split is saved: <folder>/<split>, ``folder`` being the preparing stage's folder."""
    return Path(folder) / split


def load_split(folder: str | Path, split: str) -> Dataset:
    """The saved <folder>/<split> ('train' or 'eval')."""
    path = split_path(folder, split)
    if not path.is_dir():
        raise FileNotFoundError(f"no prepared {split!r} split at {path}: run the data stage first")
    ds = datasets.load_from_disk(str(path))
    if not isinstance(ds, Dataset):
        raise TypeError(f"{path} holds a {type(ds).__name__}, expected a Dataset")
    return ds


def corpus_text(ds: Dataset) -> Iterator[str]:
    """Every prompt message (role and content) and reference of a prepared dataset, row by row.

    Roles are part of the text the model reads (ChatML: <|im_start|>assistant), so a tokenizer trained
    on this gives "system", "user" and "assistant" one token each: prompts 13 tokens shorter."""
    for batch in ds.select_columns(["prompt", "reference"]).iter(batch_size=1000):
        for prompt, reference in zip(batch["prompt"], batch["reference"], strict=True):
            for message in prompt:
                yield message["role"]
                yield message["content"]
            yield "assistant"
            yield reference
