"""Tests for tasks/rewards/text.py: reading a completion's text and answer, and the GSM8K reward set."""

from __future__ import annotations

import pytest

from grpoflow.tasks.rewards.text import (
    completion_text,
    correctness,
    count_xml,
    extract_xml_answer,
    int_answer,
    parse_number,
    proximity,
    soft_format,
    strict_format,
    xmlcount,
)

GOOD = "<reasoning>\n48 / 2 = 24\n48 + 24 = 72\n</reasoning>\n<answer>\n72\n</answer>\n"
WRONG = "<reasoning>\n48 + 48 = 96\n</reasoning>\n<answer>\n96\n</answer>\n"
NO_TAGS = "The answer is 72."
UNCLOSED = "<reasoning>\nthinking\n</reasoning>\n<answer>\n72"
SQUASHED = "<reasoning>48+24=72</reasoning> <answer>72</answer>"


def conv(text: str) -> list[dict[str, str]]:
    return [{"role": "assistant", "content": text}]


def call(fn, completions, answers=None):
    kwargs = {} if answers is None else {"answer": answers}
    return fn(prompts=[None] * len(completions), completions=completions, **kwargs)


# ---------------------------------------------------------------------------- helpers
def test_completion_text_forms():
    assert completion_text("abc") == "abc"
    assert completion_text(conv("abc")) == "abc"
    assert completion_text({"role": "assistant", "content": "abc"}) == "abc"
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert completion_text([{"role": "assistant", "content": parts}]) == "ab"
    with pytest.raises(TypeError):
        completion_text(42)  # type: ignore[arg-type]


def test_extract_xml_answer():
    assert extract_xml_answer(GOOD) == "72"
    assert extract_xml_answer(SQUASHED) == "72"
    assert extract_xml_answer("<answer>1</answer> then <answer> 2 </answer>") == "2"
    assert extract_xml_answer(NO_TAGS) is None
    assert extract_xml_answer(UNCLOSED) is None
    assert extract_xml_answer("</answer> only") is None


@pytest.mark.parametrize(
    "s, expected",
    [("72", 72.0), (" 72.0 ", 72.0), ("1,000", 1000.0), ("-3.5", -3.5), ("$18", 18.0), (".5", 0.5), ("1e3", 1000.0)],
)
def test_parse_number(s, expected):
    assert parse_number(s) == expected


@pytest.mark.parametrize("s", [None, "", "abc", "72 apples", "nan", "inf", "1/2", "--3", "1e400", "-1e400"])
def test_parse_number_rejects(s):
    assert parse_number(s) is None


# ---------------------------------------------------------------------------- built-ins
def test_correctness():
    completions = [GOOD, WRONG, NO_TAGS, UNCLOSED, SQUASHED]
    assert call(correctness, completions, ["72"] * 5) == [2.0, 0.0, 0.0, 0.0, 2.0]


def test_correctness_numeric_and_string_compare():
    comps = ["<answer>72.0</answer>", "<answer>1,000</answer>", "<answer>  Paris </answer>", "<answer>paris</answer>"]
    assert call(correctness, comps, ["72", "1000", "Paris", "Paris"]) == [2.0, 2.0, 2.0, 0.0]


def test_correctness_compares_numbers_exactly_not_as_floats():
    """Answers a float comparison calls equal (2**53 + 1 and 2**53; 1e400 and 1e401, both inf) are not the gold
    answer: a policy cannot earn correctness with a nearby huge number."""
    comps = ["<answer>9007199254740992</answer>", "<answer>1e401</answer>", "<answer>7.2e1</answer>"]
    assert call(correctness, comps, ["9007199254740993", "1e400", "72"]) == [0.0, 0.0, 2.0]
    assert call(proximity, ["<answer>1e400</answer>", "<answer>72</answer>"], ["72", "1e400"]) == [0.0, None]


def test_correctness_conversational():
    assert call(correctness, [conv(GOOD), conv(WRONG)], ["72", "72"]) == [2.0, 0.0]


def test_correctness_needs_answer_column():
    with pytest.raises(ValueError, match="'answer' column"):
        call(correctness, [GOOD])


def test_int_answer():
    comps = [GOOD, "<answer>-5</answer>", "<answer>7.5</answer>", "<answer>seven</answer>", NO_TAGS, conv(GOOD)]
    assert call(int_answer, comps) == [0.5, 0.5, 0.0, 0.0, 0.0, 0.5]


def test_strict_format():
    comps = [GOOD, GOOD.rstrip("\n"), WRONG, SQUASHED, NO_TAGS, "junk\n" + GOOD, GOOD + "trailing", conv(GOOD)]
    assert call(strict_format, comps) == [0.5, 0.5, 0.5, 0.0, 0.0, 0.0, 0.0, 0.5]


def test_soft_format():
    comps = [GOOD, SQUASHED, "preamble " + SQUASHED, NO_TAGS, UNCLOSED, "<answer>1</answer><reasoning>x</reasoning>"]
    assert call(soft_format, comps) == [0.5, 0.5, 0.5, 0.0, 0.0, 0.0]


def _notebook_count_xml(text: str) -> float:
    # Verbatim from the Unsloth / willccbb GSM8K GRPO notebook.
    count = 0.0
    if text.count("<reasoning>\n") == 1:
        count += 0.125
    if text.count("\n</reasoning>\n") == 1:
        count += 0.125
    if text.count("\n<answer>\n") == 1:
        count += 0.125
        count -= len(text.split("\n</answer>\n")[-1]) * 0.001
    if text.count("\n</answer>") == 1:
        count += 0.125
        count -= (len(text.split("\n</answer>")[-1]) - 1) * 0.001
    return count


def test_xmlcount_values():
    assert count_xml(GOOD) == pytest.approx(0.5)
    assert count_xml(GOOD + "abc") == pytest.approx(0.5 - 0.003 - 0.003)
    assert count_xml(NO_TAGS) == 0.0
    assert count_xml(SQUASHED) == 0.0
    assert count_xml("<reasoning>\nx\n</reasoning>\n") == pytest.approx(0.25)


@pytest.mark.parametrize("text", [GOOD, WRONG, NO_TAGS, UNCLOSED, SQUASHED, GOOD + "extra", GOOD.rstrip("\n"), ""])
def test_xmlcount_matches_notebook(text):
    assert call(xmlcount, [text, conv(text)]) == [pytest.approx(_notebook_count_xml(text))] * 2


def test_proximity():
    comps = ["<answer>100</answer>", "<answer>90</answer>", "<answer>250</answer>", "<answer>-</answer>", NO_TAGS]
    assert call(proximity, comps, ["100"] * 5) == [1.0, pytest.approx(0.9), 0.0, 0.0, 0.0]


def test_proximity_small_gold_and_non_numeric_gold():
    out = call(
        proximity,
        ["<answer>0.5</answer>", "<answer>Paris</answer>", conv("<answer>1,000</answer>")],
        ["0", "Paris", "1000"],
    )
    assert out == [pytest.approx(0.5), None, 1.0]
