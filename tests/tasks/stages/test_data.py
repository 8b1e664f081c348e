"""Tests for tasks/stages/data.py: sources, row formats, invalid rows, splits, the saved stage outputs."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pandas as pd
import pytest

from grpoflow.flows.stages import PIPELINE
from grpoflow.tasks.config import GSM8K_SYSTEM_PROMPT, config_from_dict
from grpoflow.tasks.dataio.rows import generate_arithmetic, parse_row
from grpoflow.tasks.dataio.sources import file_problem, load_source
from grpoflow.tasks.dataio.splits import corpus_text, load_split
from grpoflow.tasks.pipeline.errors import StageError
from grpoflow.tasks.pipeline.fingerprint import stage_keys
from grpoflow.tasks.rewards import correctness, strict_format
from grpoflow.tasks.stages.data import data_task, prepare_data
from grpoflow.tasks.storage.workspace import Workspace
from tests.paths import FIXTURES, REPO

GSM8K_SAMPLE = FIXTURES / "gsm8k_sample.jsonl"
GSM8K_FULL = REPO.parent / "shared/data/gsm8k"


def make_cfg(tmp_path: Path, **data):
    return config_from_dict({"run": {"output_dir": str(tmp_path), "seed": 7}, "data": data})


def run(tmp_path: Path, **data):
    ws = Workspace(tmp_path / "ws")
    return prepare_data(make_cfg(tmp_path, **data), ws), ws


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def write_rows(path: Path, rows: list[dict]) -> Path:
    """Write rows in the format the suffix says."""
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows))
    elif path.suffix == ".csv":
        pd.DataFrame(rows).to_csv(path, index=False)
    elif path.suffix == ".parquet":
        pd.DataFrame(rows).to_parquet(path)
    return path


QA_ROWS = [{"question": f"Capital number {i}?", "answer": f"City{i}"} for i in range(10)]


# ---------------------------------------------------------------------------- arithmetic
def test_arithmetic_is_deterministic_correct_and_disjoint():
    acfg = config_from_dict(
        {"data": {"arithmetic": {"train_size": 300, "eval_size": 50, "operations": ["+", "-", "*"]}}}
    )
    train, eval_ = generate_arithmetic(acfg.data.arithmetic, seed=3)
    assert (train, eval_) == generate_arithmetic(acfg.data.arithmetic, seed=3)
    assert train != generate_arithmetic(acfg.data.arithmetic, seed=4)[0]
    assert len(train) == 300 and len(eval_) == 50
    questions = [r["question"] for r in train + eval_]
    assert len(set(questions)) == 350  # distinct, so no question in both splits
    for row in train + eval_:
        expr = row["question"].removeprefix("What is ").removesuffix("?")
        assert int(row["answer"]) == eval(expr)  # our own generated "a op b"
        a, _, b = expr.split(" ")
        assert 0 <= int(a) <= 99 and 0 <= int(b) <= 99
    assert {r["question"].split(" ")[3] for r in train} == {"+", "-", "*"}


def test_arithmetic_small_space_uses_every_question():
    acfg = config_from_dict(
        {
            "data": {
                "arithmetic": {"train_size": 6, "eval_size": 3, "min_operand": 1, "max_operand": 3, "operations": ["+"]}
            }
        }
    ).data.arithmetic
    train, eval_ = generate_arithmetic(acfg, seed=0)
    assert sorted(r["question"] for r in train + eval_) == sorted(
        f"What is {a} + {b}?" for a in (1, 2, 3) for b in (1, 2, 3)
    )


def test_arithmetic_non_negative_subtraction():
    def rows(**arith):
        acfg = config_from_dict({"data": {"arithmetic": arith}}).data.arithmetic
        train, eval_ = generate_arithmetic(acfg, seed=5)
        return train + eval_

    mixed = rows(train_size=400, eval_size=100, non_negative_subtraction=True)
    assert mixed == rows(train_size=400, eval_size=100, non_negative_subtraction=True)  # deterministic
    assert len({r["question"] for r in mixed}) == 500
    minus = [r for r in mixed if " - " in r["question"]]
    assert len(minus) > 150 and all(int(r["answer"]) >= 0 for r in minus)
    assert any(" + " in r["question"] and int(r["answer"]) > 0 for r in mixed)  # addition untouched
    assert any(int(r["answer"]) < 0 for r in rows(train_size=400, eval_size=100))  # the default keeps them
    # a small space is used whole: the 6 pairs a >= b of 1..3
    small = rows(
        train_size=4, eval_size=2, min_operand=1, max_operand=3, operations=["-"], non_negative_subtraction=True
    )
    assert sorted(r["question"] for r in small) == sorted(
        f"What is {a} - {b}?" for a in (1, 2, 3) for b in (1, 2, 3) if a >= b
    )
    with pytest.raises(ValueError, match=r"subtraction without negative answers\) give only 6"):
        rows(train_size=6, eval_size=1, min_operand=1, max_operand=3, operations=["-"], non_negative_subtraction=True)


def test_arithmetic_space_too_small():
    acfg = config_from_dict(
        {
            "data": {
                "arithmetic": {"train_size": 9, "eval_size": 1, "min_operand": 1, "max_operand": 3, "operations": ["+"]}
            }
        }
    ).data.arithmetic
    with pytest.raises(ValueError, match="only 9"):
        generate_arithmetic(acfg, seed=0)


def test_prepare_arithmetic(tmp_path):
    summary, ws = run(tmp_path, arithmetic={"train_size": 40, "eval_size": 10})
    assert summary["format"] == "arithmetic"
    assert (summary["train_rows"], summary["eval_rows"], summary["skipped_rows"]) == (40, 10, 0)
    train, eval_ = load_split(ws.root / "data", "train"), load_split(ws.root / "data", "eval")
    assert train.column_names == ["prompt", "question", "answer", "reference"]
    assert not set(train["question"]) & set(eval_["question"])
    assert len(set(train["question"])) == 40
    row = train[0]
    a, op, b = row["question"].removeprefix("What is ").removesuffix("?").split(" ")
    assert (
        row["reference"]
        == f"<reasoning>\n{a} {op} {b} = {row['answer']}\n</reasoning>\n<answer>\n{row['answer']}\n</answer>"
    )
    assert row["prompt"] == [
        {"role": "system", "content": GSM8K_SYSTEM_PROMPT},
        {"role": "user", "content": row["question"]},
    ]


def test_arithmetic_rejects_gsm8k_format(tmp_path):
    with pytest.raises(ValueError, match="gsm8k"):
        run(tmp_path, format="gsm8k")


# ---------------------------------------------------------------------------- GSM8K
def test_gsm8k_fixture(tmp_path):
    summary, ws = run(tmp_path, source=str(GSM8K_SAMPLE), eval_size=0.25)
    assert summary["format"] == "gsm8k"
    assert (summary["train_rows"], summary["eval_rows"], summary["skipped_rows"]) == (30, 10, 0)

    raw = read_jsonl(GSM8K_SAMPLE)
    gold = {r["question"]: r["answer"].split("####")[-1].strip().replace(",", "") for r in raw}
    rows = list(load_split(ws.root / "data", "train")) + list(load_split(ws.root / "data", "eval"))
    assert sorted(r["question"] for r in rows) == sorted(gold)
    for r in rows:
        assert r["answer"] == gold[r["question"]]
        assert "<<" not in r["reference"] and "####" not in r["reference"]
        # the SFT targets earn the full format and correctness rewards
        assert correctness([r["prompt"]], [r["reference"]], answer=[r["answer"]]) == [2.0]
        assert strict_format([r["prompt"]], [r["reference"]]) == [0.5]

    natalia = next(r for r in rows if r["question"].startswith("Natalia"))
    assert natalia["answer"] == "72"
    assert natalia["reference"] == (
        "<reasoning>\nNatalia sold 48/2 = 24 clips in May.\n"
        "Natalia sold 48+24 = 72 clips altogether in April and May.\n</reasoning>\n<answer>\n72\n</answer>"
    )


def test_gsm8k_parse_row():
    q, gold, reasoning = parse_row(" Q? ", "a <<1+1=2>>2 then\nb\n#### 1,234 ", "gsm8k")
    assert (q, gold, reasoning) == ("Q?", "1234", "a 2 then\nb")


def test_held_out_split_is_seeded(tmp_path):
    a, ws_a = run(tmp_path / "a", source=str(GSM8K_SAMPLE), eval_size=5)
    _, ws_b = run(tmp_path / "b", source=str(GSM8K_SAMPLE), eval_size=5)
    assert a["eval_rows"] == 5
    assert list(load_split(ws_a.root / "data", "eval")["question"]) == list(
        load_split(ws_b.root / "data", "eval")["question"]
    )


def test_max_rows(tmp_path):
    summary, _ = run(tmp_path, source=str(GSM8K_SAMPLE), max_train_rows=7, max_eval_rows=2)
    assert (summary["train_rows"], summary["eval_rows"]) == (7, 2)


# ---------------------------------------------------------------------------- local files
@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".csv", ".parquet"])
def test_local_file_formats(tmp_path, suffix):
    path = write_rows(tmp_path / f"qa{suffix}", QA_ROWS)
    summary, ws = run(tmp_path, source=str(path), eval_size=2, system_prompt=None)
    assert summary["format"] == "qa"
    assert (summary["train_rows"], summary["eval_rows"]) == (8, 2)
    row = load_split(ws.root / "data", "train")[0]
    assert row["answer"] == "City" + row["question"].removeprefix("Capital number ").removesuffix("?")
    assert row["reference"] == f"<reasoning>\n\n</reasoning>\n<answer>\n{row['answer']}\n</answer>"
    assert row["prompt"] == [{"role": "user", "content": row["question"]}]


def test_custom_fields_and_numeric_answers(tmp_path):
    rows = [{"problem": f"What is {i} + 1?", "solution": i + 1} for i in range(6)]
    path = write_rows(tmp_path / "nums.csv", rows)
    summary, ws = run(tmp_path, source=str(path), question_field="problem", answer_field="solution", eval_size=1)
    assert summary["format"] == "qa"
    assert sorted(
        list(load_split(ws.root / "data", "train")["answer"]) + list(load_split(ws.root / "data", "eval")["answer"])
    ) == [
        "1",
        "2",
        "3",
        "4",
        "5",
        "6",
    ]


def test_arithmetic_format_on_a_file(tmp_path):
    path = write_rows(
        tmp_path / "arith.jsonl", [{"question": f"What is {a} * -4?", "answer": str(-4 * a)} for a in (3, 5, 7)]
    )
    _, ws = run(tmp_path, source=str(path), format="arithmetic", eval_size=1)
    train = {r["question"]: r["reference"] for r in load_split(ws.root / "data", "train")}
    assert any(f"{a} * -4 = {-4 * a}" in train.get(f"What is {a} * -4?", "") for a in (3, 5, 7))


def test_a_question_in_both_splits_is_kept_out_of_training_and_held_out_once(tmp_path, caplog):
    """A source that holds a question twice (or a data.eval_source repeating training questions) put a copy in
    each split: the model was scored on rows it trained on. Training keeps none of the held-out questions
    (whitespace aside), and each held-out question is scored once."""
    rows = [{"question": f"Capital number {i}?", "answer": f"City{i}"} for i in range(8)] * 2
    path = write_rows(tmp_path / "twice.jsonl", rows)
    with caplog.at_level(logging.WARNING):
        summary, ws = run(tmp_path / "a", source=str(path), eval_size=4, system_prompt=None)
    train, held = (list(load_split(ws.root / "data", s)["question"]) for s in ("train", "eval"))
    assert not set(train) & set(held) and len(held) == len(set(held)) == summary["eval_rows"]
    assert len(train) == 16 - 2 * len(held) and "held-out one too" in caplog.text
    extra = write_rows(tmp_path / "eval.jsonl", [{"question": " Capital  number 3? ", "answer": "City3"}] * 2)
    summary, ws = run(tmp_path / "b", source=str(path), eval_source=str(extra), system_prompt=None)
    assert (summary["train_rows"], summary["eval_rows"]) == (14, 1)
    assert "Capital number 3?" not in set(load_split(ws.root / "data", "train")["question"])


def test_eval_source_file(tmp_path):
    train = write_rows(tmp_path / "train.jsonl", QA_ROWS)
    eval_ = write_rows(tmp_path / "eval.jsonl", [{"question": "Held out?", "answer": "yes"}])
    summary, ws = run(tmp_path, source=str(train), eval_source=str(eval_))
    assert (summary["train_rows"], summary["eval_rows"]) == (10, 1)
    assert list(load_split(ws.root / "data", "eval")["question"]) == ["Held out?"]


def test_arithmetic_with_eval_source_file(tmp_path):
    acfg = make_cfg(tmp_path, arithmetic={"train_size": 30, "eval_size": 5}).data.arithmetic
    in_train = generate_arithmetic(acfg, seed=7)[0][0]  # run() uses seed 7
    path = write_rows(tmp_path / "arith_eval.jsonl", [in_train, {"question": "What is 500 + 1?", "answer": "501"}])
    summary, ws = run(tmp_path, arithmetic={"train_size": 30, "eval_size": 5}, eval_source=str(path))
    assert (summary["train_rows"], summary["eval_rows"]) == (29, 2)
    assert in_train["question"] not in set(load_split(ws.root / "data", "train")["question"])


def test_eval_source_split_name_needs_hf_source(tmp_path):
    train = write_rows(tmp_path / "train.jsonl", QA_ROWS)
    with pytest.raises(ValueError, match="split name only applies"):
        run(tmp_path, source=str(train), eval_source="test")


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        run(tmp_path, source=str(tmp_path / "nope.jsonl"))
    with pytest.raises(FileNotFoundError, match="data/dir/x"):
        load_source("data/dir/x")


def test_unsupported_suffix(tmp_path):
    (tmp_path / "rows.txt").write_text("hello\n")
    with pytest.raises(ValueError, match=r"rows.txt.*unsupported suffix '.txt'"):
        run(tmp_path, source=str(tmp_path / "rows.txt"))


def test_unreachable_hf_id(tmp_path, monkeypatch):
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ValueError, match=r"'no-such-owner/no-such-dataset'.*neither a local .*reachable Hugging Face"):
        run(tmp_path, source="no-such-owner/no-such-dataset")


def test_file_problem_reads_only_the_head_and_names_file_line_and_key(tmp_path):
    """The pre-stage check of a local data file: what the data stage would fail on later, found from the head."""
    q, a = "question", "answer"
    good = write_rows(tmp_path / "good.jsonl", read_jsonl(GSM8K_SAMPLE)[:8])
    assert file_problem(str(good), q, a) is None
    assert file_problem("arithmetic", q, a) is None and file_problem("openai/gsm8k", q, a) is None
    assert file_problem("s3://bucket/rows.jsonl", q, a) is None  # the data stage fetches and checks it
    assert file_problem(str(tmp_path / "nope.jsonl"), q, a).startswith(f"data file not found: '{tmp_path}/nope.jsonl'")
    (tmp_path / "rows.txt").write_text("x\n")
    assert "unsupported suffix '.txt'" in file_problem(str(tmp_path / "rows.txt"), q, a)
    assert file_problem(str(good), "prompt", a) == (
        f"data file '{good}': data.question_field 'prompt': no row has it; its rows have ['answer', 'question']"
    )
    # a first row without the field is an invalid row (the data stage skips or reports it by line), not a
    # missing column: the field is looked for in every row before the file is refused
    late = write_rows(tmp_path / "late.jsonl", [{"answer": "#### 5"}] * 7 + [{"question": "q", "answer": "#### 5"}])
    assert file_problem(str(late), q, a) is None
    broken = tmp_path / "broken.jsonl"
    broken.write_text(good.read_text().split("\n", 1)[0] + "\n\n{not json\n")
    assert file_problem(str(broken), q, a) == (
        f"data file '{broken}' line 3: not a JSON object "
        "(Expecting property name enclosed in double quotes at column 2)"
    )
    listed = tmp_path / "list.jsonl"
    listed.write_text("[1, 2]\n")
    assert "line 1: a JSON list, not an object of columns" in file_problem(str(listed), q, a)
    (tmp_path / "empty.jsonl").write_text("\n")
    assert file_problem(str(tmp_path / "empty.jsonl"), q, a).endswith("has no rows")
    csv_file = tmp_path / "rows.csv"
    csv_file.write_text("question,solution\nWhat is 1 + 1?,2\n")
    assert "(its header): data.answer_field 'answer' is not a column; it has ['question', 'solution']" in (
        file_problem(str(csv_file), q, a)
    )
    assert file_problem(str(csv_file), q, "solution") is None
    pd.DataFrame({"q": ["x"], "answer": ["1"]}).to_parquet(tmp_path / "rows.parquet")
    assert "(its schema): data.question_field 'question'" in file_problem(str(tmp_path / "rows.parquet"), q, a)
    (tmp_path / "fake.parquet").write_text("not parquet")
    assert "is not a parquet file" in file_problem(str(tmp_path / "fake.parquet"), q, a)


# ---------------------------------------------------------------------------- invalid rows
def _bad_gsm8k(tmp_path: Path) -> Path:
    rows = read_jsonl(GSM8K_SAMPLE)[:20]
    rows[3]["answer"] = rows[3]["answer"].replace("####", "answer:")
    rows[11]["question"] = ""
    rows[17]["answer"] = None
    return write_rows(tmp_path / "bad_gsm8k.jsonl", rows)


def test_invalid_row_errors_with_its_line(tmp_path):
    path = _bad_gsm8k(tmp_path)
    with pytest.raises(ValueError, match=r"bad_gsm8k.jsonl line 4: answer has no '####'"):
        run(tmp_path, source=str(path), format="gsm8k")


def test_invalid_rows_skipped_and_counted(tmp_path, caplog):
    path = _bad_gsm8k(tmp_path)
    with caplog.at_level(logging.WARNING, logger="grpoflow.tasks.dataio.rows"):
        summary, ws = run(tmp_path, source=str(path), format="gsm8k", on_invalid_row="skip", eval_size=2)
    assert summary["skipped_rows"] == 3
    assert (summary["train_rows"], summary["eval_rows"]) == (15, 2)
    assert "skipped 3 invalid rows" in caplog.text and "line 4: answer has no '####'" in caplog.text
    assert "line 12: question is empty" in caplog.text and "line 18: answer is missing" in caplog.text
    assert summary["skipped_row_indices"] == {str(path): [3, 11, 17]}


def test_non_string_question(tmp_path):
    path = write_rows(tmp_path / "q.json", [{"question": 5, "answer": "x"}, {"question": "ok?", "answer": "y"}])
    with pytest.raises(ValueError, match="q.json record 1: question is not a string"):
        run(tmp_path, source=str(path))


@pytest.mark.parametrize("suffix", [".jsonl", ".csv", ".parquet"])
def test_invalid_row_is_named_by_the_line_an_editor_shows(tmp_path, suffix):
    """1-based lines: blank lines of a .jsonl and the CSV header count, a quoted CSV field over several lines
    moves the next records down; a parquet file has no lines: its 1-based row."""
    good = {"question": "What is 1 + 2?", "answer": "3"}
    rows = [good, {"question": "What is\n2 + 2?", "answer": "4"}, good, {"question": "", "answer": "5"}]
    path = write_rows(tmp_path / f"rows{suffix}", rows)
    if suffix == ".jsonl":
        path.write_text(path.read_text().replace("\n", "\n\n", 1))  # a blank line after the first row
    want = {".jsonl": "line 5", ".csv": "line 6", ".parquet": "row 4"}[suffix]
    with pytest.raises(ValueError, match=rf"rows{suffix} {want}: question is (empty|missing)"):  # CSV: empty is NaN
        run(tmp_path, source=str(path), format="qa")


def test_missing_column_lists_columns(tmp_path):
    path = write_rows(tmp_path / "cols.jsonl", [{"prompt_text": "q", "answer": "a"}])
    with pytest.raises(ValueError, match=r"data.question_field 'question'.*\['prompt_text', 'answer'\]"):
        run(tmp_path, source=str(path))


# ---------------------------------------------------------------------------- outputs
def test_summary_outputs_and_round_trip(tmp_path):
    summary, ws = run(tmp_path, source=str(GSM8K_SAMPLE), eval_size=4)
    assert ws.read_manifest("data") is None  # the stage shell writes it (test_data_task_writes_the_manifest_once)
    assert summary["source"] == str(GSM8K_SAMPLE) and summary["format"] == "gsm8k"
    assert Path(summary["train_path"]) == ws.root / "data" / "train"
    assert Path(summary["samples_path"]) == ws.root / "data" / "samples.jsonl"

    train = load_split(ws.root / "data", "train")
    samples = read_jsonl(ws.root / "data" / "samples.jsonl")
    assert len(samples) == 5 and samples == list(train.select(range(5)))

    texts = list(corpus_text(train))
    assert len(texts) == 6 * len(train)
    first = ["system", GSM8K_SYSTEM_PROMPT, "user", train[0]["question"], "assistant", train[0]["reference"]]
    assert texts[:6] == first


def test_rerun_overwrites(tmp_path):
    _, ws = run(tmp_path, source=str(GSM8K_SAMPLE), eval_size=4)
    summary, ws = run(tmp_path, source=str(GSM8K_SAMPLE), eval_size=4, max_train_rows=3)
    assert len(load_split(ws.root / "data", "train")) == 3 == summary["train_rows"]


def test_failed_rerun_leaves_no_manifest(tmp_path):
    where = str(tmp_path / "ws")
    data_task.fn(PIPELINE, make_cfg(tmp_path, source=str(GSM8K_SAMPLE), eval_size=4), where)
    assert Workspace(where).read_manifest("data") is not None
    with pytest.raises(StageError, match="missing.jsonl"):
        data_task.fn(PIPELINE, make_cfg(tmp_path, source=str(tmp_path / "missing.jsonl")), where)
    assert Workspace(where).read_manifest("data") is None


def test_load_split_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="run the data stage"):
        load_split(tmp_path, "train")


def test_data_task_fn(tmp_path):
    cfg = make_cfg(tmp_path, arithmetic={"train_size": 8, "eval_size": 2})
    summary = data_task.fn(PIPELINE, cfg, str(tmp_path / "ws"))
    assert (summary["train_rows"], summary["eval_rows"], summary["format"]) == (8, 2, "arithmetic")
    manifest = Workspace(tmp_path / "ws").read_manifest("data")  # written once, by the stage shell
    assert manifest["summary"] == summary and manifest["key"] == stage_keys(PIPELINE, cfg)["data"]
    assert manifest["fingerprint"]["config"]["run.seed"] == cfg.run.seed  # what `grpoflow resume` compares


@pytest.mark.skipif(not (GSM8K_FULL / "train.jsonl").is_file(), reason="full GSM8K not present (../shared/data)")
def test_full_gsm8k_train_parses(tmp_path):
    summary, _ = run(tmp_path, source=str(GSM8K_FULL / "train.jsonl"), eval_size=0.1)
    assert summary["format"] == "gsm8k" and summary["skipped_rows"] == 0
    assert summary["train_rows"] + summary["eval_rows"] == 7473


def test_arithmetic_reasoning_styles():
    from grpoflow.tasks.dataio.rows import arithmetic_reasoning

    assert arithmetic_reasoning(37, "+", 58, "95", "direct", "q") == "37 + 58 = 95"
    assert arithmetic_reasoning(37, "+", 58, "95", "steps", "q") == "37 + 58 = 37 + 50 + 8 = 87 + 8 = 95"
    assert arithmetic_reasoning(3, "-", 19, "-16", "steps", "q") == "3 - 19 = 3 - 10 - 9 = -7 - 9 = -16"
    assert arithmetic_reasoning(7, "+", 5, "12", "steps", "q") == "7 + 5 = 12"  # one step is enough
    styles = {arithmetic_reasoning(12, "+", 15, "27", "mixed", f"What is {i}?") for i in range(20)}
    assert styles == {"12 + 15 = 27", "12 + 15 = 12 + 10 + 5 = 22 + 5 = 27"}


def test_a_row_missing_the_question_field_is_an_invalid_row_not_a_missing_column(tmp_path):
    """Issue 27: the first row lacks 'question', two rows have it. Under skip the two are kept and line 1 is
    counted; under error line 1 is named; a file where every row lacks it lists the invalid rows by line."""
    rows = [{"answer": "#### 5"}, {"question": "What is 2 + 3?", "answer": "#### 5"}]
    path = write_rows(tmp_path / "partial.jsonl", [*rows, {"question": "What is 1 + 5?", "answer": "#### 6"}])
    summary, _ = run(tmp_path, source=str(path), format="gsm8k", on_invalid_row="skip", eval_size=1)
    assert (summary["train_rows"], summary["eval_rows"], summary["skipped_rows"]) == (1, 1, 1)
    with pytest.raises(ValueError, match=r"partial.jsonl line 1: question is missing \(set data.on_invalid_row"):
        run(tmp_path, source=str(path), format="gsm8k")
    none = write_rows(tmp_path / "none.jsonl", [{"question": None, "answer": "#### 5"}] * 3 + [{"answer": "#### 1"}])
    with pytest.raises(
        ValueError,
        match=r"no usable training rows: 4 invalid rows skipped \(line 1: question is missing, line 2: question "
        r"is missing, line 3: question is missing, \.\.\.\)",
    ):
        run(tmp_path, source=str(none), format="gsm8k", on_invalid_row="skip", eval_size=1)
    absent = write_rows(tmp_path / "absent.jsonl", [{"answer": "#### 5"}] * 3)
    with pytest.raises(ValueError, match=r"data.question_field 'question': no row has it; the rows have \['answer'\]"):
        run(tmp_path, source=str(absent), format="gsm8k", on_invalid_row="skip")


def test_no_held_out_row_stops_the_data_stage_while_eval_is_on(tmp_path):
    """A one-row file leaves the held-out slice empty: the data stage stops, naming data.source, rather than the
    eval stage failing with a raw IndexError after SFT and GRPO trained. With eval off it only warns."""
    path = write_rows(tmp_path / "one.jsonl", [{"question": "What is 1 + 1?", "answer": "2"}])
    with pytest.raises(ValueError, match=r"data.source '.*one.jsonl': no held-out row to evaluate on \(1 training"):
        prepare_data(make_cfg(tmp_path / "a", source=str(path)), Workspace(tmp_path / "a" / "ws"))
    cfg = make_cfg(tmp_path / "b", source=str(path))
    off = cfg.model_copy(update={"eval": cfg.eval.model_copy(update={"enabled": False})})
    assert prepare_data(off, Workspace(tmp_path / "b" / "ws"))["eval_rows"] == 0


def test_code_tests_on_rows_that_are_no_code_is_refused(tmp_path):
    """code_tests on the arithmetic task or a qa file scored 0 on every row: a run that trained nothing, rc 0."""
    cfg = make_cfg(tmp_path)
    cfg = cfg.model_copy(update={"grpo": cfg.grpo.model_copy(update={"reward_funcs": ["code_tests"]})})
    with pytest.raises(ValueError, match="code_tests runs each row's answer as Python tests.*format 'arithmetic'"):
        prepare_data(cfg, Workspace(tmp_path / "ws"))
