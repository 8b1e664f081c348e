"""Reward functions for GRPO, with TRL's signature ``fn(prompts, completions, **columns) -> list[float | None]``.

The built-ins are the GSM8K reward set of the Unsloth / willccbb GRPO notebook (``correctness``, ``int``,
``strict_format``, ``soft_format``, ``xmlcount``) plus ``proximity``, a dense numeric reward. The gold answer
arrives as the ``answer`` column. ``completions`` may be plain strings or TRL's conversational form
(``[{"role": "assistant", "content": "..."}]`` per completion).

Where these differ from the notebook:
- ``correctness`` compares numbers as numbers ("72" == "72.0", "1,000" == "1000"), not only as strings.
- ``int`` accepts a leading '-' (the notebook used ``str.isdigit``).
- ``strict_format`` uses ``re.DOTALL`` and allows a missing final newline (the notebook's pattern failed on
  multi-line reasoning); ``soft_format`` uses ``re.search`` rather than ``re.match``.
- ``extract_xml_answer`` returns None unless the text holds a closed ``<answer>...</answer>``, so a truncated
  completion earns no correctness reward.
``xmlcount`` is the notebook's ``count_xml`` unchanged, quirks included (see its docstring).

A reward may return None for a sample it does not apply to; :func:`score_completions` turns that into NaN,
which the advantage computation ignores (as TRL does).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import logging
import math
import re
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

from grpoflow.tasks.config import CodeRewardConfig
from grpoflow.tasks.rewards import sandbox

log = logging.getLogger(__name__)

RewardFunc = Callable[..., list[float | None]]

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


def parse_number(s: str | None) -> float | None:
    """'1,000' -> 1000.0, '$72' -> 72.0, '-3.5' -> -3.5; None for anything else (including 'nan', 'inf')."""
    if s is None:
        return None
    t = str(s).strip().replace(",", "").removeprefix("$").strip()
    if not _NUMBER.match(t):
        return None
    return float(t)


def _answers_equal(pred: str, gold: str) -> bool:
    p, g = parse_number(pred), parse_number(gold)
    if p is not None and g is not None:
        return p == g
    return pred == gold.strip()


def _gold(kwargs: dict[str, Any], n: int, reward: str) -> list[str]:
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
    gold = _gold(kwargs, len(completions), "correctness")
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
    gold = _gold(kwargs, len(completions), "proximity")
    out: list[float | None] = []
    for c, g in zip(completions, gold, strict=True):
        gv = parse_number(g)
        if gv is None:
            out.append(None)
            continue
        pv = parse_number(extract_xml_answer(completion_text(c)))
        out.append(0.0 if pv is None else max(0.0, 1.0 - abs(pv - gv) / max(1.0, abs(gv))))
    return out


_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL | re.IGNORECASE)


def extract_program(text: str) -> str:
    """The code of a completion: the last fenced block (```python, ```py or a bare ```; an unclosed last fence
    runs to the end), else the inside of the last <answer>...</answer>, else the whole text."""
    blocks = _FENCE.findall(text)
    if blocks:
        return blocks[-1]
    answer = extract_xml_answer(text)
    return answer if answer is not None else text


def _is_code(text: str) -> bool:
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return False
    return any(isinstance(n, (ast.FunctionDef, ast.ClassDef, ast.Import, ast.ImportFrom)) for n in tree.body)


def build_program(question: str | None, code: str, tests: str) -> str:
    """What the sandbox runs: [the question, when it is Python source (HumanEval's signature + docstring, so a
    completion that is only the body still runs)] + the completion's code + the row's tests. A completion that
    writes the whole function redefines it after the question's stub."""
    head = question if question and _is_code(question) else ""
    if head and not head.endswith("\n"):
        head += "\n"
    return f"{head}{code}\n\n{tests}\n"


class CodeTests:
    """The ``code_tests`` reward: 1.0 when the completion's program passes the row's tests (the ``answer``
    column: Python that raises on a failure) in the sandbox (:mod:`grpoflow.tasks.rewards.sandbox`), 0.0 when it
    fails, raises, or hits a limit, None when the sandbox itself could not start. ``reasons`` counts the outcome
    of every program run (passed, failed, timeout, cpu_limit, memory, output_limit, killed, sandbox_error)."""

    __name__ = "code_tests"

    def __init__(self, cfg: CodeRewardConfig | None = None) -> None:
        self.cfg = cfg or CodeRewardConfig()
        c = self.cfg
        self.limits = sandbox.Limits(c.timeout_s, c.cpu_s, c.memory_mb, c.max_processes, c.max_output_bytes, c.tmpfs_mb)
        self.reasons: Counter[str] = Counter()
        self._unreported: Counter[str] = Counter()

    def take_counts(self) -> dict[str, float]:
        """The outcomes counted since the last call (the trainer logs them per step as rewards/<name>/<outcome>)."""
        counts = {k: float(v) for k, v in sorted(self._unreported.items())}
        self._unreported.clear()
        return counts

    def check_isolation(self) -> str:
        """The isolation in force; ValueError when it is rlimits only and code_reward.allow_unsafe is off."""
        mode = sandbox.isolation()
        if mode != "bwrap" and not self.cfg.allow_unsafe:
            raise ValueError(
                "reward 'code_tests': bwrap cannot isolate programs on this machine (see the log); set "
                "grpo.code_reward.allow_unsafe=true to run them with rlimits only (no network or PID isolation)"
            )
        return mode

    def __call__(self, prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float | None]:
        tests = _gold(kwargs, len(completions), "code_tests")
        questions = kwargs.get("question") or [None] * len(completions)
        mode = self.check_isolation()
        programs = [
            build_program(q, extract_program(completion_text(c)), t)
            for q, c, t in zip(questions, completions, tests, strict=True)
        ]
        with ThreadPoolExecutor(max_workers=self.cfg.workers, thread_name_prefix="code-sandbox") as pool:
            results = list(pool.map(lambda p: sandbox.run_python(p, self.limits, mode), programs))
        batch = Counter(r.status for r in results)
        self.reasons.update(batch)
        self._unreported.update(batch)
        log.info("code_tests: %d programs (%s isolation): %s", len(results), mode, dict(sorted(batch.items())))
        return [None if r.status == "sandbox_error" else float(r.passed) for r in results]


def code_tests(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float | None]:
    """:class:`CodeTests` with the default grpo.code_reward settings."""
    return CodeTests()(prompts, completions, **kwargs)


BUILTIN_REWARDS: dict[str, RewardFunc] = {
    "code_tests": code_tests,
    "correctness": correctness,
    "int": int_answer,
    "strict_format": strict_format,
    "soft_format": soft_format,
    "xmlcount": xmlcount,
    "proximity": proximity,
}


# --------------------------------------------------------------------------------------------
# resolution and scoring
# --------------------------------------------------------------------------------------------
def _import_reward(path: str) -> tuple[str, RewardFunc]:
    module_name, _, attr_path = path.partition(":")
    if not module_name or not attr_path:
        raise ValueError(f"reward {path!r}: expected 'package.module:function'")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:  # includes ModuleNotFoundError
        raise ValueError(f"reward {path!r}: cannot import module {module_name!r}: {e}") from e
    except Exception as e:  # the module itself fails on import: its error, named, not a raw traceback
        raise ValueError(f"reward {path!r}: importing {module_name!r} raised {type(e).__name__}: {e}") from e
    for attr in attr_path.split("."):
        try:
            obj = getattr(obj, attr)
        except AttributeError as e:
            raise ValueError(f"reward {path!r}: {e}") from e
    if not callable(obj):
        # ValueError, like every other bad reward spec, so that callers catch one type.
        raise ValueError(f"reward {path!r} is not callable (got {type(obj).__name__})")  # noqa: TRY004
    check_signature(path, obj)
    return getattr(obj, "__name__", attr_path.rsplit(".", 1)[-1]), obj


def check_signature(spec: str, fn: Callable) -> None:
    """A reward is called as fn(prompts=..., completions=..., **dataset_columns) (TRL's convention): it must
    take keyword arguments it does not name (``**kwargs``) and no positional-only parameter without a default."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or C callable without a signature: let the call decide
        return
    call = "rewards are called as fn(prompts=..., completions=..., **dataset_columns)"
    if not any(p.kind == p.VAR_KEYWORD for p in sig.parameters.values()):
        raise ValueError(f"reward {spec!r}: its signature {sig} takes no **kwargs; {call}")
    for p in sig.parameters.values():
        if p.kind == p.POSITIONAL_ONLY and p.default is p.empty:
            raise ValueError(f"reward {spec!r}: parameter {p.name!r} of {sig} is positional-only; {call}")


def resolve_reward_funcs(names: list[str], code: CodeRewardConfig | None = None) -> list[tuple[str, RewardFunc]]:
    """Built-in names or 'package.module:function' import paths -> [(name, function)], in order.

    The name of an imported function is its ``__name__``; it becomes the metric name (rewards/<name>/mean).
    ``code_tests`` is built with ``code`` (grpo.code_reward) and checks its sandbox can isolate here.
    """
    resolved: list[tuple[str, RewardFunc]] = []
    for name in names:
        if name == "code_tests":
            reward = CodeTests(code)
            reward.check_isolation()
            resolved.append((name, reward))
        elif name in BUILTIN_REWARDS:
            resolved.append((name, BUILTIN_REWARDS[name]))
        elif ":" in name:
            resolved.append(_import_reward(name))
        else:
            raise ValueError(
                f"unknown reward {name!r}: expected one of {sorted(BUILTIN_REWARDS)} or 'package.module:function'"
            )
    seen: set[str] = set()
    for (name, _), spec in zip(resolved, names, strict=True):
        if name in seen:
            raise ValueError(f"reward {spec!r}: a second reward is named {name!r}; reward names must be unique")
        seen.add(name)
    return resolved


class RewardError(ValueError):
    """A reward function failed or returned what cannot be a reward; the message names it and the sample."""


def reward_values(name: str, out: Any, completions: list[Any]) -> list[float]:
    """What reward ``name`` returned for ``completions``, as floats, by these rules:

    a list or tuple, a numpy array or a torch tensor (1-D), one value per completion; each value a number, a
    bool (1.0 / 0.0), a 0-d array or tensor, or None (TRL's "not scored": NaN, left out of the means). NaN is
    taken as "not scored" too. inf, -inf, strings and anything else are refused, naming the first offending
    completion."""
    n = len(completions)
    if hasattr(out, "tolist") and not isinstance(out, (list, tuple)):  # numpy arrays, torch tensors
        out = out.tolist()
    if not isinstance(out, (list, tuple)):
        raise RewardError(f"reward {name!r} returned {type(out).__name__}, expected a list of {n} floats")
    if len(out) != n:
        raise RewardError(f"reward {name!r} returned {len(out)} values for {n} completions")
    values: list[float] = []
    for i, v in enumerate(out):
        if hasattr(v, "item") and not isinstance(v, (str, bytes)):
            v = v.item()
        if v is None:
            values.append(math.nan)
            continue
        if isinstance(v, (str, bytes)) or not isinstance(v, (int, float)):
            raise RewardError(f"reward {name!r} returned a non-numeric value {v!r} for {_sample(completions, i)}")
        if math.isinf(v):
            raise RewardError(
                f"reward {name!r} returned {v} for {_sample(completions, i)}: a reward must be finite "
                "(None or NaN mark a sample the function does not score)"
            )
        values.append(float(v))
    return values


class UnscoredRounds:
    """Rounds in which a reward scored no completion at all (every value None or NaN): such a reward teaches
    nothing, usually because it cannot find a column it needs. Warns naming the reward on its first such round
    (and every 100th after), and counts them as the metric rewards/<name>/unscored_rounds, logged from a reward's
    first such round on (a chart that stays 0 would only clutter the run)."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()

    def update(self, names: Sequence[str], columns: Sequence[Sequence[float]]) -> dict[str, float]:
        """``columns``: each reward's values over the whole round, in the order of ``names``."""
        for name, values in zip(names, columns, strict=True):
            if values and all(v is None or v != v for v in values):
                self.counts[name] += 1
                if self.counts[name] % 100 == 1:
                    log.warning(
                        "reward %r scored no completion of this round (%d values, all None or NaN; %d such "
                        "rounds so far): it adds nothing to the advantages; check the columns it reads",
                        name,
                        len(values),
                        self.counts[name],
                    )
        return {f"rewards/{name}/unscored_rounds": float(self.counts[name]) for name in names if self.counts[name]}


def _sample(completions: list[Any], i: int) -> str:
    text = completion_text(completions[i])
    return f"completion {i} ({text[:80]!r}{'...' if len(text) > 80 else ''})"


def call_with_timeout(name: str, fn: Callable[[], Any], timeout: float | None) -> Any:
    """fn() bounded by ``timeout`` seconds (None or 0: unbounded). Over time, a RewardError names the function
    and the bound, and the stage fails.

    A Python function cannot be stopped from outside its thread, so the call runs in a daemon thread that is
    abandoned when the bound passes: it holds no lock of ours, and it ends with the process (the CLI exits
    after a failed stage; a daemon thread is not joined at exit, where a ThreadPoolExecutor's worker would be,
    keeping a `time.sleep(3600)` alive for its hour). Not a subprocess: a reward may be a closure or hold a
    loaded judge model, neither of which pickles or starts in milliseconds; the rewards that run untrusted
    programs (code_tests) already do so in their own sandboxed subprocesses (runtime/sandbox.py)."""
    if not timeout:
        return fn()
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # handed to the caller's thread, raised there
            box["error"] = e

    worker = threading.Thread(target=target, name=f"reward-{name}", daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        raise RewardError(
            f"reward {name!r} did not return within grpo.reward_timeout_s={timeout:g} s (stopped waiting; raise "
            "the bound, or 0 for none, if the function is slow rather than stuck)"
        )
    if "error" in box:
        raise box["error"]
    return box.get("value")


def score_completions(
    funcs: list[tuple[str, RewardFunc]],
    prompts: list[Any],
    completions: list[Any],
    columns: dict[str, list[Any]],
    timeout: float | None = None,
) -> dict[str, list[float]]:
    """Run every reward function on one batch: {name: [reward per completion]}, None mapped to NaN
    (:func:`reward_values`); a function that raises, or runs past ``timeout`` seconds, is named in the
    RewardError."""
    scores: dict[str, list[float]] = {}
    for name, fn in funcs:
        if name in scores:
            raise ValueError(f"two reward functions are named {name!r}; reward names must be unique")
        try:
            out = call_with_timeout(name, partial(fn, prompts=prompts, completions=completions, **columns), timeout)
        except RewardError:
            raise
        except Exception as e:
            raise RewardError(f"reward {name!r} raised {type(e).__name__}: {e}") from e
        scores[name] = reward_values(name, out, completions)
    return scores
