"""The data stage: raw rows -> prompt / question / answer / reference datasets in the run workspace.

Sources (``data.source``): the built-in arithmetic task ("What is 37 + 58?" -> "95"), a local or s3://
.jsonl/.json/.parquet/.csv file (an S3 file is downloaded into storage.cache_dir first), or a Hugging Face
dataset id. Every row becomes

    prompt     TRL conversational prompt: [system (when data.system_prompt is set), user question]
    question   the question text
    answer     the gold final answer (what the rewards compare against)
    reference  "<reasoning>\\n...\\n</reasoning>\\n<answer>\\n<gold>\\n</answer>", the SFT target

Row formats (``data.format``): gsm8k (gold = text after the last '####', commas removed; reasoning = text
before it without the <<calculator>> annotations), qa (answer field as is, empty reasoning), arithmetic
("37 + 58 = 95"), auto (arithmetic for the built-in task, gsm8k when the answers carry '####', else qa).

The eval split is ``data.eval_source`` (a file, or a split name of the HF dataset) or a seeded held-out
slice of the source. Outputs: <ws>/data/train and <ws>/data/eval (``Dataset.save_to_disk``), samples.jsonl
(the first train rows, for humans); the stage shell then writes manifest.json. Everything here is plain Python except
:func:`data_task`, the thin Prefect task at the bottom.
"""

from __future__ import annotations

import json
import logging
import random
import shutil
from pathlib import Path
from typing import Any

from datasets import Dataset
from prefect import task
from prefect.cache_policies import NO_CACHE

from grpoflow.tasks.config import DataConfig, PipelineConfig, StorageConfig, resolve_eval_size
from grpoflow.tasks.dataio.rows import FEATURES, columns, detect_format, generate_arithmetic, map_rows
from grpoflow.tasks.dataio.sources import BUILTIN_SOURCE, HUMANEVAL_SOURCE, load_source, looks_like_file, row_locator
from grpoflow.tasks.dataio.splits import split_path
from grpoflow.tasks.pipeline.fingerprint import data_files
from grpoflow.tasks.pipeline.shell import run_stage
from grpoflow.tasks.pipeline.spec import Pipeline, StageSpec
from grpoflow.tasks.stages.common import DATA, prepared
from grpoflow.tasks.storage.workspace import Workspace
from grpoflow.tasks.tracking.dataset_inputs import split_digest
from grpoflow.tasks.tracking.run_meta import short_dataset
from grpoflow.tasks.tracking.tracker import RunLogger

log = logging.getLogger(__name__)

SAMPLE_ROWS = 5


# --------------------------------------------------------------------------------------------
# loading raw rows
# --------------------------------------------------------------------------------------------


# --------------------------------------------------------------------------------------------
# row mapping
# --------------------------------------------------------------------------------------------


# --------------------------------------------------------------------------------------------
# the stage
# --------------------------------------------------------------------------------------------
def _load_eval(src: str, d: DataConfig, storage: StorageConfig) -> tuple[Dataset, str]:
    """data.eval_source: a local or s3:// file, or (for a HF dataset id source) a split name of it."""
    if Path(src).expanduser().exists() or looks_like_file(src):
        return load_source(src, storage=storage), src
    if d.source == BUILTIN_SOURCE or Path(d.source).expanduser().exists() or looks_like_file(d.source):
        raise ValueError(
            f"data.eval_source {src!r} is not an existing file; a split name only applies when "
            f"data.source is a Hugging Face dataset id (data.source is {d.source!r})"
        )
    rows = load_source(d.source, split=src, subset=d.subset, storage=storage, revision=d.revision)
    return rows, f"{d.source} (split {src!r})"


def _held_out(examples: list[dict[str, Any]], eval_size: float, seed: int) -> tuple[list, list]:
    """(train, eval): a seeded shuffle's first data.eval_size rows are the eval split, the rest train."""
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    k = resolve_eval_size(eval_size, len(examples))
    return [examples[i] for i in order[k:]], [examples[i] for i in order[:k]]


def _save(rows: list[dict[str, Any]], path: Path) -> None:
    """Save ``rows`` as a Dataset of FEATURES at ``path``, replacing what a previous run left there."""
    if path.exists():
        shutil.rmtree(path)
    columns = {name: [r[name] for r in rows] for name in FEATURES}
    Dataset.from_dict(columns, features=FEATURES).save_to_disk(str(path))


def prepare_data(cfg: PipelineConfig, ws: Workspace) -> dict[str, Any]:
    """Build and save the train/eval datasets of cfg.data; returns a small summary (paths and counts)."""
    d = cfg.data
    skipped: dict[str, list[tuple[int, str]]] = {}  # per source name: (row index, why) of each invalid row
    train_rows, eval_rows, fmt = _split_rows(cfg, skipped)
    train_rows = train_rows[: d.max_train_rows]
    eval_rows = eval_rows[: d.max_eval_rows]
    n_skipped = sum(len(s) for s in skipped.values())
    if not train_rows:
        raise _no_training_rows(d, skipped, n_skipped, cfg.storage)
    if not eval_rows and cfg.eval.enabled:  # found now, not in the eval stage after SFT and GRPO trained
        where = f"data.eval_source {d.eval_source!r}" if d.eval_source else f"data.source {d.source!r}"
        raise ValueError(
            f"{where}: no held-out row to evaluate on ({len(train_rows)} training rows"
            + (f"; {n_skipped} invalid rows skipped" if n_skipped else "")
            + "); give a data.eval_source file, more rows, or set eval.enabled=false"
        )
    if not eval_rows:
        log.warning("data.source %r: the eval split is empty", d.source)
    train_path, eval_path, samples_path = _write_splits(ws, train_rows, eval_rows)
    return {
        "train_path": str(train_path),
        "eval_path": str(eval_path),
        "samples_path": str(samples_path),
        "train_rows": len(train_rows),
        "eval_rows": len(eval_rows),
        "skipped_rows": n_skipped,
        "skipped_row_indices": {name: [i for i, _ in s[:20]] for name, s in skipped.items() if s},
        "format": fmt,
        "source": d.source,
        "split": d.split,
        "eval_source": d.eval_source,
    }


def _split_rows(cfg: PipelineConfig, skipped: dict) -> tuple[list[dict], list[dict], str]:
    """The train and eval rows of cfg.data (before max_train_rows / max_eval_rows) and their row format; the
    invalid rows of each source go into ``skipped`` under its name."""
    d = cfg.data
    if d.source == BUILTIN_SOURCE:
        train_rows, eval_rows, fmt = _arithmetic_rows(d, cfg.run.seed)
    else:
        train_rows, eval_rows, fmt = _source_rows(cfg, skipped)
    if d.eval_source is not None:
        eval_ds, eval_name = _load_eval(d.eval_source, d, cfg.storage)
        eval_q, eval_a = columns(eval_ds, d.question_field, d.answer_field, eval_name)
        eval_where = row_locator(d.eval_source, cfg.storage)
        eval_rows, skipped[eval_name] = map_rows(eval_q, eval_a, fmt, d, eval_name, eval_where)
    if "code_tests" in cfg.grpo.reward_funcs and fmt != "code":  # it would score 0 on every row, and train nothing
        raise ValueError(
            f"grpo.reward_funcs: code_tests runs each row's answer as Python tests, but data.source {d.source!r} "
            f"gives rows of format {fmt!r}; set data.format=code for a file of code rows, or drop code_tests"
        )
    return (*_held_apart(train_rows, eval_rows), fmt)


def _question_key(row: dict[str, Any]) -> str:
    return " ".join(str(row["question"]).split())  # the question with its whitespace collapsed


def _held_apart(train_rows: list[dict], eval_rows: list[dict]) -> tuple[list[dict], list[dict]]:
    """(train rows without any whose question is a held-out one, held-out rows with each question once). A source
    that holds a question twice put one copy in each split, and a separate data.eval_source could repeat training
    questions: the model was then scored on rows it trained on (and the promotion test counted them twice)."""
    held: dict[str, dict] = {}
    for r in eval_rows:
        held.setdefault(_question_key(r), r)
    train = [r for r in train_rows if _question_key(r) not in held]
    if len(train) < len(train_rows) or len(held) < len(eval_rows):
        log.warning(
            "data: %d training rows dropped, their question being a held-out one too; %d repeated held-out rows "
            "dropped (held-out rows are scored unseen, each once)",
            len(train_rows) - len(train),
            len(eval_rows) - len(held),
        )
    return train, list(held.values())


def _arithmetic_rows(d: DataConfig, seed: int) -> tuple[list[dict], list[dict], str]:
    """The built-in arithmetic task's seeded train and eval rows, and their format."""
    if d.format == "gsm8k":
        raise ValueError("data.format 'gsm8k' does not apply to the built-in arithmetic source")
    fmt = "arithmetic" if d.format == "auto" else d.format
    train_raw, eval_raw = generate_arithmetic(d.arithmetic, seed)
    train_rows, _ = map_rows([r["question"] for r in train_raw], [r["answer"] for r in train_raw], fmt, d, d.source)
    eval_rows, _ = map_rows([r["question"] for r in eval_raw], [r["answer"] for r in eval_raw], fmt, d, d.source)
    return train_rows, eval_rows, fmt


def _source_rows(cfg: PipelineConfig, skipped: dict) -> tuple[list[dict], list[dict], str]:
    """The rows of data.source (a file or HF dataset) and their format (data.format, or detected): the train rows
    and a seeded held-out eval slice, or all of them and no eval rows when data.eval_source is set."""
    d = cfg.data
    source_name = d.source if looks_like_file(d.source) else f"{d.source} (split {d.split!r})"
    questions, answers = columns(
        load_source(d.source, d.split, d.subset, cfg.storage, d.revision), d.question_field, d.answer_field, source_name
    )
    fmt = d.format if d.format != "auto" else "code" if d.source == HUMANEVAL_SOURCE else detect_format(answers)

    where = row_locator(d.source, cfg.storage)
    examples, skipped[source_name] = map_rows(questions, answers, fmt, d, source_name, where)
    if d.eval_source is None:
        train_rows, eval_rows = _held_out(examples, d.eval_size, cfg.run.seed)
        return train_rows, eval_rows, fmt
    return examples, [], fmt


def _no_training_rows(d: DataConfig, skipped: dict, n_skipped: int, storage: StorageConfig) -> ValueError:
    """The error of a source without a usable training row, naming the first three invalid rows by line."""
    first: list[str] = []
    for name, rows in skipped.items():  # the first three, each named by line as the file shows it
        if rows and len(first) < 3:
            where = row_locator(name, storage)
            first += [f"{where(i)}: {why}" for i, why in rows[: 3 - len(first)]]
    if not n_skipped:  # none invalid: every one was a held-out question (the warning above counts them)
        return ValueError(
            f"data.source {d.source!r}: no training rows left: every question is a held-out one too "
            f"(data.eval_source {d.eval_source!r} repeats data.source?)"
        )
    return ValueError(
        f"data.source {d.source!r}: no usable training rows: {n_skipped} invalid rows skipped"
        + (f" ({', '.join(first)}{', ...' if n_skipped > len(first) else ''})" if first else "")
    )


def _write_splits(ws: Workspace, train_rows: list[dict], eval_rows: list[dict]) -> tuple[Path, Path, Path]:
    """Save data/train, data/eval and data/samples.jsonl (the first train rows, for humans); their paths."""
    out = ws.stage_dir("data")
    train_path, eval_path, samples_path = out / "train", out / "eval", out / "samples.jsonl"
    _save(train_rows, train_path)
    _save(eval_rows, eval_path)
    with samples_path.open("w") as f:
        for row in train_rows[:SAMPLE_ROWS]:
            f.write(json.dumps(row) + "\n")
    return train_path, eval_path, samples_path


# --------------------------------------------------------------------------------------------
# reading back
# --------------------------------------------------------------------------------------------


def _data_stage(cfg: PipelineConfig, ws: Workspace, tracker: RunLogger) -> dict[str, Any]:
    summary = prepare_data(cfg, ws)
    tracker.log_artifact(ws.stage_dir("data") / "samples.jsonl")
    return summary


def _result(s: dict[str, Any]) -> str:
    if "train_rows" not in s:
        return ""
    return f"{s['train_rows']} train rows, {s['eval_rows']} eval rows ({s.get('skipped_rows', 0)} skipped)."


def _log_digest(tracker: RunLogger, cfg: PipelineConfig, ws: Workspace, summary: dict[str, Any]) -> None:
    """The prepared train split's digest as the run's dataset_digest param (the later stages log it up front)."""
    path = split_path(prepared(ws), "train")
    digest = split_digest(path) if path.is_dir() else None
    tracker.log_params({"dataset_digest": digest})


SPEC = StageSpec(
    name=DATA,
    keys=("run.seed", "data", "model.name"),
    prepares_splits=True,  # not the tokenizer: this stage does not tokenize
    reads=(data_files,),
    description="Prepared the train and eval splits from {dataset}.",
    param_sections=("data",),
    name_parts=lambda cfg: (short_dataset(cfg.data.source),),
    result=_result,
    after=_log_digest,
)


# no Prefect cache: the pipeline's stage keys decide what reruns (tasks/pipeline/fingerprint.py); hashing the
# inputs (the stage table, the config) would only cost time
@task(name="prepare-data", cache_policy=NO_CACHE)
def data_task(stages: Pipeline, cfg: PipelineConfig, workspace_root: str, parent_run_id: str | None = None) -> dict:
    return run_stage(stages, SPEC, _data_stage, cfg, workspace_root, parent_run_id)
