"""Raw rows -> examples: the row formats (gsm8k, qa, arithmetic), the built-in arithmetic task, and the
columns of a prepared row:

    prompt     TRL conversational prompt: [system (when data.system_prompt is set), user question]
    question   the question text
    answer     the gold final answer (what the rewards compare against)
    reference  "<reasoning>\\n...\\n</reasoning>\\n<answer>\\n<gold>\\n</answer>", the SFT target
"""

from __future__ import annotations

import logging
import random
import re
import zlib
from collections.abc import Callable
from typing import Any

from datasets import Dataset, Features, List, Value

from grpoflow.tasks.config import ArithmeticConfig, DataConfig

log = logging.getLogger(__name__)


FEATURES = Features(
    {
        "prompt": List({"role": Value("string"), "content": Value("string")}),
        "question": Value("string"),
        "answer": Value("string"),
        "reference": Value("string"),
    }
)


AUTO_DETECT_ROWS = 100


_ANNOTATION = re.compile(r"<<.*?>>")  # GSM8K calculator annotations: <<48/2=24>>


_ARITHMETIC_QUESTION = re.compile(r"^What is (-?\d+) ([-+*]) (-?\d+)\?$")


_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


class InvalidRowError(ValueError):
    """A row without a usable question/answer; the message says what is wrong with it."""


def generate_arithmetic(acfg: ArithmeticConfig, seed: int) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """The built-in task: (train rows, eval rows) of distinct 'What is a op b?' questions, none in both.

    Deterministic from ``seed``: every (a, op, b) is a code in [0, space), and ``random.sample`` draws
    train_size + eval_size distinct codes; the first eval_size are the eval split. With
    ``non_negative_subtraction`` the codes of 'a - b' with a < b are skipped (drawn one at a time instead).
    """
    ops = list(dict.fromkeys(acfg.operations))
    span = acfg.max_operand - acfg.min_operand + 1
    space = span * span * len(ops)
    skip_negative = acfg.non_negative_subtraction and "-" in ops
    valid = space - (span * (span - 1) // 2 if skip_negative else 0)
    total = acfg.train_size + acfg.eval_size
    if total > valid:
        raise ValueError(
            f"data.arithmetic: train_size + eval_size = {total} distinct questions, but operands "
            f"{acfg.min_operand}..{acfg.max_operand} with operations {ops}"
            f"{' (subtraction without negative answers)' if skip_negative else ''} give only {valid}; "
            "widen min_operand/max_operand or add operations"
        )

    def question(code: int) -> tuple[int, str, int]:
        code, op_i = divmod(code, len(ops))
        b_i, a_i = divmod(code, span)
        return acfg.min_operand + a_i, ops[op_i], acfg.min_operand + b_i

    rng = random.Random(seed)
    if skip_negative:
        drawn: dict[int, None] = {}  # insertion-ordered: the draw order decides the split
        while len(drawn) < total:
            code = rng.randrange(space)
            a, op, b = question(code)
            if not (op == "-" and a < b):
                drawn[code] = None
        codes = list(drawn)
    else:
        codes = rng.sample(range(space), total)
    rows = []
    for a, op, b in map(question, codes):
        rows.append({"question": f"What is {a} {op} {b}?", "answer": str(_OPS[op](a, b))})
    return rows[acfg.eval_size :], rows[: acfg.eval_size]


def columns(rows: Dataset, question_field: str, answer_field: str, source_name: str) -> tuple[list, list]:
    """The question and answer columns as lists; a missing one fails listing the columns there are."""
    for key, field in (("data.question_field", question_field), ("data.answer_field", answer_field)):
        if field not in rows.column_names:  # a column any row has exists (None where a row lacks it)
            raise ValueError(f"{source_name}: {key} {field!r}: no row has it; the rows have {rows.column_names}")
    columns = rows.select_columns([question_field, answer_field]).to_dict()
    return columns[question_field], columns[answer_field]


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
    if fmt == "code":  # the answer is the tests: Python that raises when the program is wrong
        try:
            compile(gold, "tests", "exec")
        except SyntaxError as e:
            raise InvalidRowError(f"answer (the tests) is not valid Python: {e.msg} at line {e.lineno}") from None
        return question, gold, ""
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
    questions: list[Any],
    answers: list[Any],
    fmt: str,
    d: DataConfig,
    source_name: str,
    where: Callable[[int], str] | None = None,
) -> tuple[list[dict[str, Any]], list[tuple[int, str]]]:
    """Rows -> examples, and the (0-based row index, problem) of each skipped row.

    With data.on_invalid_row = "error" the first invalid row raises, naming the source and where the row is:
    ``where(i)`` (dataio.sources.row_locator: "line 7" of a .jsonl or .csv file), else "row i+1" (1-based).
    """
    where = where or (lambda i: f"row {i + 1}")
    examples: list[dict[str, Any]] = []
    skipped: list[tuple[int, str]] = []
    for i, (q, a) in enumerate(zip(questions, answers, strict=True)):
        try:
            question, gold, reasoning = parse_row(q, a, fmt, d.arithmetic.reasoning)
        except InvalidRowError as e:
            if d.on_invalid_row == "error":
                raise ValueError(
                    f"{source_name} {where(i)}: {e} (set data.on_invalid_row=skip to skip such rows)"
                ) from None
            skipped.append((i, str(e)))
            continue
        examples.append(make_example(question, gold, reasoning, d.system_prompt))
    if skipped:
        first = "; ".join(f"{where(i)}: {problem}" for i, problem in skipped[:5])
        log.warning(
            "%s: skipped %d invalid rows (data.on_invalid_row=skip); first: %s", source_name, len(skipped), first
        )
    return examples, skipped
