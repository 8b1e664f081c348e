"""Resolving and running the rewards: built-in names and ``package.module:function`` specs become
[(name, function)] (:func:`resolve_reward_funcs`, which checks TRL's signature ``fn(prompts, completions,
**columns) -> list[float | None]``), and :func:`score_completions` runs them on a batch.

A reward may return None for a sample it does not apply to; :func:`score_completions` turns that into NaN,
which the advantage computation ignores (as TRL does). A reward that raises, runs past its bound or returns
what cannot be a reward is a :class:`RewardError` naming it and the sample.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import math
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from grpoflow.tasks.config import CodeRewardConfig
from grpoflow.tasks.config.reward_names import reward_name
from grpoflow.tasks.rewards.code import CodeTests, code_tests
from grpoflow.tasks.rewards.text import (
    completion_text,
    correctness,
    int_answer,
    proximity,
    soft_format,
    strict_format,
    xmlcount,
)

log = logging.getLogger(__name__)

RewardFunc = Callable[..., list[float | None]]

BUILTIN_REWARDS: dict[str, RewardFunc] = {
    "code_tests": code_tests,
    "correctness": correctness,
    "int": int_answer,
    "strict_format": strict_format,
    "soft_format": soft_format,
    "xmlcount": xmlcount,
    "proximity": proximity,
}


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
    return reward_name(path), obj


# what a reward is called with: prompts, completions, and the prepared split's columns but the prompt
# (tasks/dataio/rows.py FEATURES; tests/tasks/rewards/test_scoring.py checks the two agree)
PASSED = ("prompts", "completions", "question", "answer", "reference")


def check_signature(spec: str, fn: Callable) -> None:
    """A reward is called as fn(prompts=..., completions=..., **dataset_columns) (TRL's convention): it must
    take keyword arguments it does not name (``**kwargs``), no positional-only parameter without a default, and
    no parameter without a default that the call does not pass (:data:`PASSED`): ``def exact(completions,
    solution, **kw)`` failed with a TypeError in GRPO, after SFT."""
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
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.default is p.empty and p.name not in PASSED:
            raise ValueError(
                f"reward {spec!r}: parameter {p.name!r} of {sig} has no default and is never passed: rewards get "
                f"{', '.join(PASSED)} (the prepared rows' columns); read it from one of those, or give it a default"
            )


def resolve_reward_funcs(names: list[str], code: CodeRewardConfig | None = None) -> list[tuple[str, RewardFunc]]:
    """Built-in names or 'package.module:function' import paths -> [(name, function)], in order.

    The name of an imported function is its spec's attribute name, made safe for MLflow (tasks/config/reward_names.py:
    a lambda bound to ``mod:bonus`` is "bonus"); it becomes the metric name (rewards/<name>/mean).
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
    programs (code_tests) already do so in their own sandboxed subprocesses (rewards/sandbox.py)."""
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


def reward_bound(fn: RewardFunc, timeout: float | None, n: int) -> float | None:
    """The bound of one call of ``fn`` on ``n`` completions: ``timeout`` (grpo.reward_timeout_s; None or 0: none),
    raised to the reward's own worst case when it states one (``worst_case_s(n)``: code_tests, whose programs are
    each killed at their timeout), so a round of completions that all run to their limit is scored, not failed."""
    worst = getattr(fn, "worst_case_s", None)
    if not timeout or worst is None:
        return timeout
    return max(timeout, worst(n))


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
            call = partial(fn, prompts=prompts, completions=completions, **columns)
            out = call_with_timeout(name, call, reward_bound(fn, timeout, len(completions)))
        except RewardError:
            raise
        except Exception as e:
            raise RewardError(f"reward {name!r} raised {type(e).__name__}: {e}") from e
        scores[name] = reward_values(name, out, completions)
    return scores
