"""Reward functions for GRPO, with TRL's signature ``fn(prompts, completions, **columns) -> list[float | None]``.

- :mod:`.text`: the GSM8K reward set (``correctness``, ``int``, ``strict_format``, ``soft_format``, ``xmlcount``,
  ``proximity``) and the helpers that read a completion's text and answer.
- :mod:`.code`: the ``code_tests`` reward, which runs the completion's program and the row's tests.
- :mod:`.sandbox`: the confined process those programs run in.
- :mod:`.scoring`: built-in names and ``package.module:function`` specs resolved to functions, and the batch
  scoring that checks what they return.

The names the rest of grpoflow imports are re-exported here.
"""

from grpoflow.tasks.rewards.code import CodeTests, build_program, code_tests, extract_program
from grpoflow.tasks.rewards.scoring import (
    BUILTIN_REWARDS,
    RewardError,
    RewardFunc,
    UnscoredRounds,
    call_with_timeout,
    check_signature,
    resolve_reward_funcs,
    reward_values,
    score_completions,
)
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

__all__ = [
    "BUILTIN_REWARDS",
    "CodeTests",
    "RewardError",
    "RewardFunc",
    "UnscoredRounds",
    "build_program",
    "call_with_timeout",
    "check_signature",
    "code_tests",
    "completion_text",
    "correctness",
    "count_xml",
    "extract_program",
    "extract_xml_answer",
    "int_answer",
    "parse_number",
    "proximity",
    "resolve_reward_funcs",
    "reward_values",
    "score_completions",
    "soft_format",
    "strict_format",
    "xmlcount",
]
