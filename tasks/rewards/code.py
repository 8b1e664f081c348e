"""The ``code_tests`` reward: the completion's program (:func:`extract_program`), prefixed with the question when
that is Python source (:func:`build_program`), runs in the sandbox (:mod:`grpoflow.tasks.rewards.sandbox`) and
the row's tests run against it from outside its process, with the helpers the question gives
(:func:`question_helpers`); it scores 1.0 when the tests pass."""

from __future__ import annotations

import ast
import logging
import re
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from typing import Any

from grpoflow.tasks.config import CodeRewardConfig
from grpoflow.tasks.rewards import sandbox, unsafe_mode
from grpoflow.tasks.rewards.text import completion_text, extract_xml_answer, gold_answers

log = logging.getLogger(__name__)

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


def build_program(question: str | None, code: str) -> str:
    """The program the sandbox runs: [the question, when it is Python source (HumanEval's signature + docstring,
    so a completion that is only the body still runs)] + the completion's code. A completion that writes the
    whole function redefines it after the question's stub. The row's tests run apart, in the sandbox's judge."""
    head = question if question and _is_code(question) else ""
    if head and not head.endswith("\n"):
        head += "\n"
    return f"{head}{code}\n"


def _is_stub(node: ast.stmt) -> bool:
    """A function the completion is to write: its body (past a docstring) is empty, ``pass``, ``...`` or
    ``raise NotImplementedError``."""
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return False
    body = node.body[1:] if ast.get_docstring(node, clean=False) is not None else node.body
    for s in body:
        exc = s.exc if isinstance(s, ast.Raise) else None
        exc = exc.func if isinstance(exc, ast.Call) else exc
        ellipsis = isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant) and s.value.value is Ellipsis
        if not (isinstance(s, ast.Pass) or ellipsis or (isinstance(exc, ast.Name) and exc.id == "NotImplementedError")):
            return False
    return True


@lru_cache(maxsize=1024)
def question_helpers(question: str | None) -> str:
    """What a Python question gives that its tests may call (HumanEval's ``poly``, ``encode_cyclic``): its
    imports, assignments and functions with a body, when it also has a stub to write (:func:`_is_stub`); '' else.
    They run in the judge ahead of the tests, so a program that redefines a helper (``encode_cyclic`` returning
    its input, beside a ``decode_cyclic`` that does too) does not change what the tests call."""
    if not question or not _is_code(question):
        return ""
    body = ast.parse(question).body
    if not any(_is_stub(n) for n in body):
        return ""
    given = (ast.Import, ast.ImportFrom, ast.Assign, ast.AnnAssign, ast.FunctionDef, ast.AsyncFunctionDef)
    kept = [n for n in body if isinstance(n, given) and not _is_stub(n)]
    return ast.unparse(ast.Module(body=kept, type_ignores=[])) + "\n" if kept else ""


@lru_cache(maxsize=1024)
def question_stubs(question: str | None) -> tuple[str, ...]:
    """The names of the functions a Python question asks the program to write (its stubs, :func:`_is_stub`). The
    tests take these from the program even where a builtin has the name: without that, tests of ``def sum(xs)``
    called Python's ``sum`` and any program, even ``pass``, passed them."""
    if not question or not _is_code(question):
        return ()
    return tuple(n.name for n in ast.parse(question).body if _is_stub(n))


SANDBOX_START_S = 1.0  # seconds a sandbox run takes beyond its timeout: bwrap, python -I -S, the reap


class CodeTests:
    """The ``code_tests`` reward: 1.0 when the completion's program passes the row's tests (the ``answer``
    column: Python that raises on a failure) in the sandbox (:mod:`grpoflow.tasks.rewards.sandbox`), 0.0 when it
    fails, raises, or hits a limit, None when the sandbox itself could not start. ``reasons`` counts the outcome
    of every program run (passed, failed, timeout, cpu_limit, memory, output_limit, killed, sandbox_error)."""

    __name__ = "code_tests"

    def __init__(self, cfg: CodeRewardConfig | None = None) -> None:
        self.cfg = cfg or CodeRewardConfig()
        c = self.cfg
        self.limits = sandbox.Limits(
            c.timeout_s, c.cpu_s, c.memory_mb, c.max_processes, c.max_output_bytes, c.tmpfs_mb, c.cpus
        )
        self.reasons: Counter[str] = Counter()
        self._unreported: Counter[str] = Counter()

    def worst_case_s(self, n: int) -> float:
        """The longest one call on ``n`` completions can take: ceil(n / workers) waves of programs, each killed at
        ``timeout_s`` (plus SANDBOX_START_S to start and reap). grpo.reward_timeout_s is raised to it for this
        reward (scoring.reward_bound): a policy writing infinite loops scores 0 for them, it does not fail the run."""
        return -(-n // self.cfg.workers) * (self.cfg.timeout_s + SANDBOX_START_S)

    def take_counts(self) -> dict[str, float]:
        """The outcomes counted since the last call (the trainer logs them per step as rewards/<name>/<outcome>)."""
        counts = {k: float(v) for k, v in sorted(self._unreported.items())}
        self._unreported.clear()
        return counts

    def check_isolation(self) -> str:
        """The isolation in force; ValueError when it is rlimits only and code_reward.allow_unsafe is off, or on
        but refused (:func:`unsafe_mode.unsafe_refusal`: not root and credentials this uid could read)."""
        mode = sandbox.isolation()
        if mode != "bwrap" and not self.cfg.allow_unsafe:
            raise ValueError(
                "reward 'code_tests': bwrap cannot isolate programs on this machine (see the log); set "
                "grpo.code_reward.allow_unsafe=true to run them with rlimits only (no network or PID isolation)"
            )
        if mode != "bwrap":
            if reason := unsafe_mode.unsafe_refusal():
                raise ValueError(
                    "reward 'code_tests': grpo.code_reward.allow_unsafe refused: not root, so programs would run "
                    f"as this uid, and {reason} (docs/rewards.md, 'allow_unsafe')"
                )
            unsafe_mode.harden_for_unsafe()
        return mode

    def __call__(self, prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float | None]:
        tests = gold_answers(kwargs, len(completions), "code_tests")
        questions = kwargs.get("question") or [None] * len(completions)
        mode = self.check_isolation()
        programs = [
            build_program(q, extract_program(completion_text(c))) for q, c in zip(questions, completions, strict=True)
        ]
        tests = [question_helpers(q) + t for q, t in zip(questions, tests, strict=True)]
        asked = [question_stubs(q) for q in questions]

        def run(program: str, test: str, names: tuple[str, ...]) -> sandbox.RunResult:
            return sandbox.run_python(program, self.limits, mode, tests=test, asked=names)

        with ThreadPoolExecutor(max_workers=self.cfg.workers, thread_name_prefix="code-sandbox") as pool:
            results = list(pool.map(run, programs, tests, asked))
        batch = Counter(r.status for r in results)
        self.reasons.update(batch)
        self._unreported.update(batch)
        log.info("code_tests: %d programs (%s isolation): %s", len(results), mode, dict(sorted(batch.items())))
        return [None if r.status == "sandbox_error" else float(r.passed) for r in results]


def code_tests(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float | None]:
    """:class:`CodeTests` with the default grpo.code_reward settings."""
    return CodeTests()(prompts, completions, **kwargs)
