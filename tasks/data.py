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
(the first train rows, for humans) and, last, manifest.json. Everything here is plain Python except
:func:`data_task`, the thin Prefect task at the bottom.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import datasets
from datasets import Dataset, Features, List, Value
from prefect import task

from tasks import s3
from tasks.config import ArithmeticConfig, DataConfig, PipelineConfig, resolve_eval_size
from tasks.stage import run_stage
from tasks.tracking import RunLogger
from tasks.workspace import Workspace

log = logging.getLogger(__name__)

BUILTIN_SOURCE = "arithmetic"
FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
FEATURES = Features(
    {
        "prompt": List({"role": Value("string"), "content": Value("string")}),
        "question": Value("string"),
        "answer": Value("string"),
        "reference": Value("string"),
    }
)
AUTO_DETECT_ROWS = 100
SAMPLE_ROWS = 5

_HF_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")  # "name" or "owner/name"
_ANNOTATION = re.compile(r"<<.*?>>")  # GSM8K calculator annotations: <<48/2=24>>
_ARITHMETIC_QUESTION = re.compile(r"^What is (-?\d+) ([-+*]) (-?\d+)\?$")
_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


class InvalidRowError(ValueError):
    """A row without a usable question/answer; the message says what is wrong with it."""


# --------------------------------------------------------------------------------------------
# loading raw rows
# --------------------------------------------------------------------------------------------
def _looks_like_file(source: str) -> bool:
    """A data-file suffix, an explicit path ('./x', '~/x', '/x'), or slashes that no HF id ('owner/name') has."""
    if Path(source).suffix.lower() in FILE_BUILDERS:
        return True
    if source.startswith((".", "~")) or os.path.isabs(source):
        return True
    return os.sep in source and not _HF_ID.match(source)


def _builder(source: str, suffix: str) -> str:
    builder = FILE_BUILDERS.get(suffix.lower())
    if builder is None:
        raise ValueError(
            f"data file {source!r}: unsupported suffix {suffix!r}; expected one of {sorted(FILE_BUILDERS)}"
        )
    return builder


def _load_file(path: Path, source: str) -> Dataset:
    builder = _builder(source, path.suffix)
    try:
        return datasets.load_dataset(builder, data_files=str(path), split="train")
    except Exception as e:  # any parse failure: re-raised naming the file
        raise ValueError(f"data file {source!r}: cannot read it as {builder}: {type(e).__name__}: {e}") from e


def fetch_s3_file(uri: str) -> Path:
    """Download an s3:// data file into the local cache (<storage.cache_dir>/<bucket>/<key>); its local path."""
    _builder(uri, Path(s3.split_s3_uri(uri)[1]).suffix)  # an unsupported suffix fails before any download
    try:
        return s3.download_file(uri, s3.local_path(uri))
    except s3.S3NotFoundError as e:
        raise FileNotFoundError(f"data file not found: {uri!r} ({e})") from None


def load_source(source: str, split: str = "train", subset: str | None = None) -> Dataset:
    """Raw rows of a local or s3:// data file, or of ``split`` of a Hugging Face dataset id."""
    if s3.is_s3_uri(source):
        return _load_file(fetch_s3_file(source), source)
    path = Path(source).expanduser()
    if path.is_file():
        return _load_file(path, source)
    if _looks_like_file(source) and not path.exists():
        raise FileNotFoundError(f"data file not found: {source!r} (looked at {path.resolve()})")
    try:
        return datasets.load_dataset(source, subset, split=split)
    except Exception as e:  # hub, network and builder errors alike
        raise ValueError(
            f"data source {source!r} (split {split!r}) is neither a local "
            f"{'/'.join(sorted(FILE_BUILDERS))} file nor a reachable Hugging Face dataset id: "
            f"{type(e).__name__}: {e}"
        ) from e


def generate_arithmetic(acfg: ArithmeticConfig, seed: int) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """The built-in task: (train rows, eval rows) of distinct 'What is a op b?' questions, none in both.

    Deterministic from ``seed``: every (a, op, b) is a code in [0, space), and ``random.sample`` draws
    train_size + eval_size distinct codes; the first eval_size are the eval split.
    """
    ops = list(dict.fromkeys(acfg.operations))
    span = acfg.max_operand - acfg.min_operand + 1
    space = span * span * len(ops)
    total = acfg.train_size + acfg.eval_size
    if total > space:
        raise ValueError(
            f"data.arithmetic: train_size + eval_size = {total} distinct questions, but operands "
            f"{acfg.min_operand}..{acfg.max_operand} with operations {ops} give only {space}; "
            "widen min_operand/max_operand or add operations"
        )
    rows = []
    for code in random.Random(seed).sample(range(space), total):
        code, op_i = divmod(code, len(ops))
        b_i, a_i = divmod(code, span)
        a, b, op = acfg.min_operand + a_i, acfg.min_operand + b_i, ops[op_i]
        rows.append({"question": f"What is {a} {op} {b}?", "answer": str(_OPS[op](a, b))})
    return rows[acfg.eval_size :], rows[: acfg.eval_size]


def _columns(rows: Dataset, question_field: str, answer_field: str, source_name: str) -> tuple[list, list]:
    """The question and answer columns as lists; a missing one fails listing the columns there are."""
    for key, field in (("data.question_field", question_field), ("data.answer_field", answer_field)):
        if field not in rows.column_names:
            raise ValueError(f"{source_name}: {key} {field!r} is not a column; available columns: {rows.column_names}")
    columns = rows.select_columns([question_field, answer_field]).to_dict()
    return columns[question_field], columns[answer_field]


# --------------------------------------------------------------------------------------------
# row mapping
# --------------------------------------------------------------------------------------------
def detect_format(answers: list[Any]) -> str:
    """'gsm8k' when every non-empty answer among the first 100 contains '####', else 'qa'."""
    head = [str(a) for a in answers[:AUTO_DETECT_ROWS] if a is not None and str(a).strip()]
    return "gsm8k" if head and all("####" in a for a in head) else "qa"


def arithmetic_reasoning(a: int, op: str, b: int, result: str, style: str, question: str) -> str:
    """The worked reasoning of 'a op b'. direct: "37 + 58 = 95"; steps (for + and - with b >= 10):
    "37 + 58 = 37 + 50 + 8 = 87 + 8 = 95"; mixed: steps or direct, chosen by a hash of the question."""
    if style == "mixed":
        style = "steps" if zlib.crc32(question.encode()) % 2 else "direct"
    tens, ones = divmod(b, 10)
    if style == "direct" or op not in "+-" or b < 10 or ones == 0:
        return f"{a} {op} {b} = {result}"
    partial = a + tens * 10 if op == "+" else a - tens * 10
    return f"{a} {op} {b} = {a} {op} {tens * 10} {op} {ones} = {partial} {op} {ones} = {result}"


def parse_row(question: Any, answer: Any, fmt: str, reasoning_style: str = "direct") -> tuple[str, str, str]:
    """(question, gold answer, reasoning) of one raw row; raises InvalidRowError saying what is wrong."""
    if question is None:
        raise InvalidRowError("question is missing")
    if not isinstance(question, str):
        raise InvalidRowError(f"question is not a string (got {type(question).__name__})")
    question = question.strip()
    if not question:
        raise InvalidRowError("question is empty")
    if answer is None or not str(answer).strip():
        raise InvalidRowError("answer is missing" if answer is None else "answer is empty")

    if fmt == "gsm8k":
        if not isinstance(answer, str):
            raise InvalidRowError(f"answer is not a string (got {type(answer).__name__})")
        if "####" not in answer:
            raise InvalidRowError("answer has no '####'")
        reasoning, _, gold = answer.rpartition("####")
        gold = gold.strip().replace(",", "")
        if not gold:
            raise InvalidRowError("answer has nothing after '####'")
        return question, gold, _ANNOTATION.sub("", reasoning).strip()
    gold = str(answer).strip()
    if fmt == "qa":
        return question, gold, ""
    if fmt == "arithmetic":
        m = _ARITHMETIC_QUESTION.match(question)
        if m is None:
            raise InvalidRowError("question is not of the form 'What is <a> <op> <b>?'")
        return question, gold, arithmetic_reasoning(int(m[1]), m[2], int(m[3]), gold, reasoning_style, question)
    raise ValueError(f"unknown data.format {fmt!r}")


def make_reference(reasoning: str, gold: str) -> str:
    return f"<reasoning>\n{reasoning}\n</reasoning>\n<answer>\n{gold}\n</answer>"


def make_example(question: str, gold: str, reasoning: str, system_prompt: str | None) -> dict[str, Any]:
    prompt = [{"role": "system", "content": system_prompt}] if system_prompt else []
    prompt.append({"role": "user", "content": question})
    return {"prompt": prompt, "question": question, "answer": gold, "reference": make_reference(reasoning, gold)}


def map_rows(
    questions: list[Any], answers: list[Any], fmt: str, d: DataConfig, source_name: str
) -> tuple[list[dict[str, Any]], list[tuple[int, str]]]:
    """Rows -> examples, and the (0-based row index, problem) of each skipped row.

    With data.on_invalid_row = "error" the first invalid row raises, naming the source and the row.
    """
    examples: list[dict[str, Any]] = []
    skipped: list[tuple[int, str]] = []
    for i, (q, a) in enumerate(zip(questions, answers, strict=True)):
        try:
            question, gold, reasoning = parse_row(q, a, fmt, d.arithmetic.reasoning)
        except InvalidRowError as e:
            if d.on_invalid_row == "error":
                raise ValueError(
                    f"{source_name} row {i}: {e} (set data.on_invalid_row=skip to skip such rows)"
                ) from None
            skipped.append((i, str(e)))
            continue
        examples.append(make_example(question, gold, reasoning, d.system_prompt))
    if skipped:
        first = "; ".join(f"row {i}: {problem}" for i, problem in skipped[:5])
        log.warning(
            "%s: skipped %d invalid rows (data.on_invalid_row=skip); first: %s", source_name, len(skipped), first
        )
    return examples, skipped


# --------------------------------------------------------------------------------------------
# the stage
# --------------------------------------------------------------------------------------------
def _load_eval(src: str, d: DataConfig) -> tuple[Dataset, str]:
    """data.eval_source: a local file, or (for a HF dataset id source) a split name of it."""
    if Path(src).expanduser().exists() or _looks_like_file(src):
        return load_source(src), src
    if d.source == BUILTIN_SOURCE or Path(d.source).expanduser().exists() or _looks_like_file(d.source):
        raise ValueError(
            f"data.eval_source {src!r} is not an existing file; a split name only applies when "
            f"data.source is a Hugging Face dataset id (data.source is {d.source!r})"
        )
    return load_source(d.source, split=src, subset=d.subset), f"{d.source} (split {src!r})"


def _held_out(examples: list[dict[str, Any]], eval_size: float, seed: int) -> tuple[list, list]:
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    k = resolve_eval_size(eval_size, len(examples))
    return [examples[i] for i in order[k:]], [examples[i] for i in order[:k]]


def _save(rows: list[dict[str, Any]], path: Path) -> None:
    if path.exists():
        shutil.rmtree(path)
    columns = {name: [r[name] for r in rows] for name in FEATURES}
    Dataset.from_dict(columns, features=FEATURES).save_to_disk(str(path))


def prepare_data(cfg: PipelineConfig, ws: Workspace) -> dict[str, Any]:
    """Build and save the train/eval datasets of cfg.data; returns a small summary (paths and counts)."""
    d, seed = cfg.data, cfg.run.seed
    ws.manifest_path("data").unlink(missing_ok=True)  # a rerun that fails must not look complete
    skipped: dict[str, list[tuple[int, str]]] = {}

    if d.source == BUILTIN_SOURCE:
        if d.format == "gsm8k":
            raise ValueError("data.format 'gsm8k' does not apply to the built-in arithmetic source")
        fmt = "arithmetic" if d.format == "auto" else d.format
        train_raw, eval_raw = generate_arithmetic(d.arithmetic, seed)
        train_rows, _ = map_rows([r["question"] for r in train_raw], [r["answer"] for r in train_raw], fmt, d, d.source)
        eval_rows, _ = map_rows([r["question"] for r in eval_raw], [r["answer"] for r in eval_raw], fmt, d, d.source)
    else:
        source_name = d.source if _looks_like_file(d.source) else f"{d.source} (split {d.split!r})"
        questions, answers = _columns(
            load_source(d.source, d.split, d.subset), d.question_field, d.answer_field, source_name
        )
        fmt = detect_format(answers) if d.format == "auto" else d.format
        examples, skipped[source_name] = map_rows(questions, answers, fmt, d, source_name)
        if d.eval_source is None:
            train_rows, eval_rows = _held_out(examples, d.eval_size, seed)
        else:
            train_rows = examples
    if d.eval_source is not None:
        eval_ds, eval_name = _load_eval(d.eval_source, d)
        eval_q, eval_a = _columns(eval_ds, d.question_field, d.answer_field, eval_name)
        eval_rows, skipped[eval_name] = map_rows(eval_q, eval_a, fmt, d, eval_name)
        if d.source == BUILTIN_SOURCE:  # keep eval questions out of the generated train split
            held = {r["question"] for r in eval_rows}
            train_rows = [r for r in train_rows if r["question"] not in held]

    train_rows = train_rows[: d.max_train_rows]
    eval_rows = eval_rows[: d.max_eval_rows]
    n_skipped = sum(len(s) for s in skipped.values())
    if not train_rows:
        raise ValueError(f"data.source {d.source!r}: no usable training rows ({n_skipped} invalid rows skipped)")
    if not eval_rows:
        log.warning("data.source %r: the eval split is empty", d.source)

    out = ws.stage_dir("data")
    train_path, eval_path, samples_path = out / "train", out / "eval", out / "samples.jsonl"
    _save(train_rows, train_path)
    _save(eval_rows, eval_path)
    with samples_path.open("w") as f:
        for row in train_rows[:SAMPLE_ROWS]:
            f.write(json.dumps(row) + "\n")

    summary = {
        "train_path": str(train_path),
        "eval_path": str(eval_path),
        "train_rows": len(train_rows),
        "eval_rows": len(eval_rows),
        "skipped_rows": n_skipped,
        "format": fmt,
    }
    ws.write_manifest(
        "data",
        {
            **summary,
            "source": d.source,
            "split": d.split,
            "eval_source": d.eval_source,
            "seed": seed,
            "samples_path": str(samples_path),
            "skipped_row_indices": {name: [i for i, _ in s[:20]] for name, s in skipped.items() if s},
        },
    )
    return summary


# --------------------------------------------------------------------------------------------
# reading back
# --------------------------------------------------------------------------------------------
def load_split(ws_or_path: Workspace | str | Path, split: str) -> Dataset:
    """The saved <workspace>/data/<split> ('train' or 'eval')."""
    root = ws_or_path.root if isinstance(ws_or_path, Workspace) else Path(ws_or_path)
    path = root / "data" / split
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


def _data_stage(cfg: PipelineConfig, ws: Workspace, tracker: RunLogger) -> dict[str, Any]:
    summary = prepare_data(cfg, ws)
    tracker.log_artifact(ws.stage_dir("data") / "samples.jsonl")
    return summary


@task(name="prepare-data")
def data_task(cfg_dict: dict, workspace_root: str, parent_run_id: str | None = None) -> dict:
    return run_stage("data", _data_stage, cfg_dict, workspace_root, parent_run_id)
