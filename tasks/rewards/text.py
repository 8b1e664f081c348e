"""The text rewards: the GSM8K reward set of the Unsloth / willccbb GRPO notebook (``correctness``, ``int``,
``strict_format``, ``soft_format``, ``xmlcount``) plus ``proximity``, a dense numeric reward, and the helpers
that read a completion (:func:`completion_text`, :func:`extract_xml_answer`, :func:`parse_number`).

The gold answer arrives as the ``answer`` column. ``completions`` may be plain strings or TRL's conversational
form (``[{"role": "assistant", "content": "..."}]`` per completion).

Where these differ from the notebook:
- ``correctness`` compares numbers as numbers, exactly ("72" == "72.0", "1,000" == "1000", but 9007199254740993 !=
  9007199254740992 and 1e400 != 1e401, which a float comparison would call equal), not only as strings.
- ``int`` accepts a leading '-' (the notebook used ``str.isdigit``).
- ``strict_format`` uses ``re.DOTALL`` and allows a missing final newline (the notebook's pattern failed on
  multi-line reasoning); ``soft_format`` uses ``re.search`` rather than ``re.match``.
- ``extract_xml_answer`` returns None unless the text holds a closed ``<answer>...</answer>``, so a truncated
  completion earns no correctness reward.
``xmlcount`` is the notebook's ``count_xml`` unchanged, quirks included (see its docstring).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from decimal import Decimal
from typing import Any

_NUMBER = re.compile(r"^[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?$")
_INTEGER = re.compile(r"^-?\d+$")
_STRICT_FORMAT = re.compile(r"^<reasoning>\n.*?\n</reasoning>\n<answer>\n.*?\n</answer>\n?$", re.DOTALL)
_SOFT_FORMAT = re.compile(r"<reasoning>.*?</reasoning>\s*<answer>.*?</answer>", re.DOTALL)


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------
def _message_text(message: Any) -> str:
    content = message.get("content") if isinstance(message, dict) else message
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # multimodal parts: [{"type": "text", "text": ...}, ...]
        return "".join(p.get("text") or "" for p in content if isinstance(p, dict))
    raise TypeError(f"cannot read text from message content of type {type(content).__name__}")


def completion_text(completion: str | Sequence[dict[str, Any]] | dict[str, Any]) -> str:
    """The text of one completion: a plain string, or the joined contents of TRL conversational messages."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        return _message_text(completion)
    if isinstance(completion, Sequence):
        return "".join(_message_text(m) for m in completion)
    raise TypeError(f"completion must be a string or a list of messages, got {type(completion).__name__}")


def extract_xml_answer(text: str) -> str | None:
    """The stripped text inside the last closed ``<answer>...</answer>``; None when there is none."""
    end = text.rfind("</answer>")
    if end < 0:
        return None
    start = text.rfind("<answer>", 0, end)
    if start < 0:
        return None
    return text[start + len("<answer>") : end].strip()


def _exact_number(s: str | None) -> Decimal | None:
    """The number ``s`` writes, exactly (a Decimal: '72.0' == '72', but 2**53 + 1 != 2**53 and 1e400 != 1e401,
    which floats would call equal); None for anything else."""
    if s is None:
        return None
    t = str(s).strip().replace(",", "").removeprefix("$").strip()
    return Decimal(t) if _NUMBER.match(t) else None


def parse_number(s: str | None) -> float | None:
    """'1,000' -> 1000.0, '$72' -> 72.0, '-3.5' -> -3.5; None for anything else (including 'nan', 'inf', and a
    number past float's range such as 1e400)."""
    d = _exact_number(s)
    if d is None:
        return None
    f = float(d)
    return f if math.isfinite(f) else None


def _answers_equal(pred: str, gold: str) -> bool:
    """Equal as numbers, exactly (:func:`_exact_number`) when both are numbers; else as stripped strings."""
    p, g = _exact_number(pred), _exact_number(gold)
    if p is not None and g is not None:
        return p == g
    return pred == gold.strip()


def gold_answers(kwargs: dict[str, Any], n: int, reward: str) -> list[str]:
    """The ``answer`` column as strings, one per completion; ValueError naming ``reward`` when it is missing or
    its length differs from the completions'."""
    if "answer" not in kwargs:
        raise ValueError(f"reward {reward!r} needs the gold answers as an 'answer' column")
    gold = kwargs["answer"]
    if len(gold) != n:
        raise ValueError(f"reward {reward!r}: {len(gold)} answers for {n} completions")
    return [str(a) for a in gold]


# --------------------------------------------------------------------------------------------
# built-in rewards
# --------------------------------------------------------------------------------------------
def correctness(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float | None]:
    """2.0 when the last <answer> equals the gold answer (numerically when both are numbers), else 0.0."""
    gold = gold_answers(kwargs, len(completions), "correctness")
    preds = [extract_xml_answer(completion_text(c)) for c in completions]
    return [2.0 if p is not None and _answers_equal(p, g) else 0.0 for p, g in zip(preds, gold, strict=True)]


def int_answer(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float | None]:
    """0.5 when the extracted answer is an integer string (optional leading '-'), else 0.0."""
    preds = [extract_xml_answer(completion_text(c)) for c in completions]
    return [0.5 if p is not None and _INTEGER.match(p) else 0.0 for p in preds]


def strict_format(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float | None]:
    """0.5 for exactly '<reasoning>\\n...\\n</reasoning>\\n<answer>\\n...\\n</answer>' (final newline optional)."""
    return [0.5 if _STRICT_FORMAT.match(completion_text(c)) else 0.0 for c in completions]


def soft_format(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float | None]:
    """0.5 when a <reasoning>...</reasoning> block is followed by an <answer>...</answer> block anywhere."""
    return [0.5 if _SOFT_FORMAT.search(completion_text(c)) else 0.0 for c in completions]


def count_xml(text: str) -> float:
    """The notebook's ``count_xml``: 0.125 per well-placed tag, minus 0.001 per character of trailing text.

    Kept as published, quirks included: the '\\n<answer>\\n' term subtracts 0.001 * len(text after the last
    '\\n</answer>\\n'), which is the whole text when the completion ends in '</answer>' with no newline; the
    '\\n</answer>' term subtracts 0.001 * (len(tail) - 1), a +0.001 bonus when nothing follows it.
    """
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


def xmlcount(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float | None]:
    """Partial credit for each XML tag of the format (see :func:`count_xml`)."""
    return [count_xml(completion_text(c)) for c in completions]


def proximity(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float | None]:
    """Dense numeric reward: max(0, 1 - |pred - gold| / max(1, |gold|)).

    1.0 for an exact match; 0.0 when the prediction is missing or not a number; None (does not apply) when the
    gold answer is not a number.
    """
    gold = gold_answers(kwargs, len(completions), "proximity")
    out: list[float | None] = []
    for c, g in zip(completions, gold, strict=True):
        gv = parse_number(g)
        if gv is None:
            out.append(None)
            continue
        pv = parse_number(extract_xml_answer(completion_text(c)))
        out.append(0.0 if pv is None else max(0.0, 1.0 - abs(pv - gv) / max(1.0, abs(gv))))
    return out
