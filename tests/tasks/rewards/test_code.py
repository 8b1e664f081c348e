"""Tests for tasks/rewards/code.py: the code_tests reward: extraction, hostile programs scored 0 and counted,
HumanEval problems scored by their canonical solutions, the reward through score_completions, the refusal
without isolation, and the reward with the data stage, the trainer, evaluation and `grpoflow validate`. The
sandbox's own containment is tested in test_sandbox.py."""

from __future__ import annotations

import json

import pytest

from grpoflow.tasks.rewards import sandbox, unsafe_mode
from grpoflow.tasks.rewards.code import CodeTests, build_program, extract_program, question_helpers
from grpoflow.tasks.rewards.scoring import resolve_reward_funcs, reward_bound, score_completions
from tests.tasks.rewards.test_sandbox import FAST, HOSTILE, SHORT


def test_extract_program_takes_the_last_fence_then_answer_then_text() -> None:
    assert extract_program("x\n```python\na = 1\n```\ntext\n```py\nb = 2\n```") == "b = 2\n"
    assert extract_program("```\nc = 3\n```") == "c = 3\n"
    assert extract_program("```python\nd = 4\n") == "d = 4\n"  # unclosed: to the end
    assert extract_program("<reasoning>r</reasoning><answer>\ne = 5\n</answer>") == "e = 5"
    assert extract_program("f = 6") == "f = 6"


def test_build_program_prefixes_a_python_question_only() -> None:
    stub = 'def add(a, b):\n    """Sum."""\n'
    assert build_program(stub, "    return a + b") == stub + "    return a + b\n"
    assert build_program("Write add(a, b).", "def add(a, b): return a + b") == "def add(a, b): return a + b\n"


def test_question_helpers_are_what_a_question_with_a_stub_gives() -> None:
    q = 'import math\nK = 2\ndef helper(x):\n    return K * x\ndef f(x):\n    """Doc."""\n'
    assert question_helpers(q) == "import math\nK = 2\n\ndef helper(x):\n    return K * x\n"
    assert question_helpers("def f(x):\n    raise NotImplementedError('write me')\n") == ""
    assert question_helpers("def g(x):\n    return x - 1\n") == ""  # no stub: a function to fix, say
    assert question_helpers("Write f(x) returning x + 1.") == ""


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_program_is_contained_and_counted(name: str) -> None:
    program, statuses = HOSTILE[name]
    reward = CodeTests(SHORT if "timeout" in statuses else FAST)  # a busy machine must not turn a bomb into a timeout
    scores = reward(prompts=["p"], completions=[f"```python\n{program}\n```"], answer=["assert True"])
    assert scores == [0.0]
    assert sum(reward.reasons.values()) == 1
    assert set(reward.reasons) <= statuses, reward.reasons


def _humaneval(n: int) -> list[dict]:
    from grpoflow.tasks.dataio.sources import humaneval_rows

    return humaneval_rows()[:n]


def test_humaneval_canonical_solutions_pass_and_wrong_ones_fail() -> None:
    rows = _humaneval(3)
    reward = CodeTests(FAST)
    good = [f"```python\n{r['prompt']}{r['canonical_solution']}```" for r in rows]
    body_only = [r["canonical_solution"] for r in rows]  # continues the question's stub
    wrong = ["```python\n" + r["prompt"] + "    return None\n```" for r in rows]
    tests = [r["answer"] for r in rows]
    questions = [r["prompt"] for r in rows]
    scores = reward(["p"] * 9, good + body_only + wrong, answer=tests * 3, question=questions * 3)
    assert scores == [1.0] * 6 + [0.0] * 3
    assert reward.reasons == {"passed": 6, "failed": 3}


# HumanEval's tests that call a helper the question gives (not the function to write): find_zero's test checks
# poly(coeffs, solution), decode_cyclic's and decode_shift's decode what encode_cyclic and encode_shift made
HELPER_CHEATS = {
    32: "def poly(xs, x):\n    return 0\ndef find_zero(xs):\n    return 0.0\n",
    38: "def encode_cyclic(s):\n    return s\ndef decode_cyclic(s):\n    return s\n",
    50: "def encode_shift(s):\n    return s\ndef decode_shift(s):\n    return s\n",
}


def test_a_program_cannot_redefine_a_helper_of_the_question_that_the_tests_call() -> None:
    """The tests run the question's own helpers (in the judge), not the program's redefinitions of them; the
    canonical solutions, whole or body only, still pass."""
    rows = [r for i, r in enumerate(_humaneval(51)) if i in HELPER_CHEATS]
    cheats = [f"```python\n{HELPER_CHEATS[int(r['task_id'].split('/')[1])]}```" for r in rows]
    good = [f"```python\n{r['prompt']}{r['canonical_solution']}```" for r in rows]
    body_only = [r["canonical_solution"] for r in rows]
    reward = CodeTests(FAST)
    scores = reward(
        ["p"] * 9,
        cheats + good + body_only,
        answer=[r["answer"] for r in rows] * 3,
        question=[r["prompt"].strip() for r in rows] * 3,
    )
    assert scores == [0.0] * 3 + [1.0] * 6, reward.reasons


def test_a_function_named_like_a_builtin_is_tested_as_the_programs_not_pythons() -> None:
    """A question asking for ``def sum(xs)`` or ``def max(a, b)``: the tests call the program's function. Before,
    the judge never asked the program for a builtin's name, so the tests checked Python's ``sum`` and a program
    returning 42, or writing nothing at all, passed."""
    question = 'def sum(xs):\n    """Add the numbers."""\n'
    tests = "def check(candidate):\n    assert candidate([1, 2]) == 3\n\ncheck(sum)\n"
    other = 'def max(a, b):\n    """The larger."""\n'
    completions = [
        "```python\ndef sum(xs):\n    return 42\n```",
        "pass",
        "```python\ndef sum(xs):\n    t = 0\n    for x in xs:\n        t += x\n    return t\n```",
        "```python\ndef max(a, b):\n    return None\n```",
    ]
    reward = CodeTests(FAST)
    scores = reward(
        ["p"] * 4, completions, answer=[tests] * 3 + ["assert max(3, 5) == 5"], question=[question] * 3 + [other]
    )
    assert scores == [0.0, 0.0, 1.0, 0.0], reward.reasons


def test_code_tests_through_score_completions() -> None:
    funcs = resolve_reward_funcs(["code_tests", "soft_format"], FAST)
    completions = [
        [{"role": "assistant", "content": "```python\ndef f(x):\n    return x + 1\n```"}],
        [{"role": "assistant", "content": "```python\nwhile True:\n    pass\n```"}],
        [{"role": "assistant", "content": "```python\nimport os\nos.kill(os.getppid(), 9)\n```"}],
    ]
    columns = {"answer": ["assert f(1) == 2"] * 3, "question": ["Write f."] * 3}
    scores = score_completions(funcs, ["p"] * 3, completions, columns, timeout=30)
    assert scores["code_tests"] == [1.0, 0.0, 0.0]
    assert scores["soft_format"] == [0.0, 0.0, 0.0]
    assert sum(funcs[0][1].reasons.values()) == 3


def test_a_round_of_looping_programs_past_the_reward_bound_is_scored_not_failed() -> None:
    """grpo.reward_timeout_s (here 1 s) fails the stage for a reward that does not return; code_tests always does,
    its programs each killed at timeout_s, but a round of loops on few workers takes longer than a small bound: 3
    loops on 1 worker at 1.5 s. Its bound is raised to its worst case, 3 * (1.5 + 1) s, and they score 0."""
    one = SHORT.model_copy(update={"workers": 1})
    funcs = resolve_reward_funcs(["code_tests"], one)
    assert funcs[0][1].worst_case_s(3) == 3 * (1.5 + 1.0)
    assert reward_bound(funcs[0][1], 1.0, 3) == 7.5 and reward_bound(funcs[0][1], 0, 3) == 0
    loop = [{"role": "assistant", "content": "```python\nwhile True:\n    pass\n```"}]
    columns = {"answer": ["assert f(1) == 2"] * 3, "question": ["Write f."] * 3}
    scores = score_completions(funcs, ["p"] * 3, [loop] * 3, columns, timeout=1.0)
    assert scores["code_tests"] == [0.0, 0.0, 0.0]
    assert sum(funcs[0][1].reasons.values()) == 3 and set(funcs[0][1].reasons) <= {"timeout", "cpu_limit"}
    assert reward_bound(lambda **_: [0.0], 1.0, 3) == 1.0  # a reward without a worst case keeps the bound


def test_refuses_without_isolation_unless_unsafe(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sandbox, "bwrap_binary", lambda: None)  # a machine without bwrap
    sandbox.isolation.cache_clear()
    try:
        with pytest.raises(ValueError, match="allow_unsafe"):
            resolve_reward_funcs(["code_tests"], FAST.model_copy(update={"allow_unsafe": False}))
        funcs = resolve_reward_funcs(["code_tests"], FAST)
        assert funcs[0][1](["p"], ["x = 1"], answer=["assert x == 1"]) == [1.0]
    finally:
        sandbox.isolation.cache_clear()


# ---------------------------------------------------------------------------- data and the trainer
def _prepare(tmp_path, **data):
    from grpoflow.tasks.config import config_from_dict
    from grpoflow.tasks.stages.data import prepare_data
    from grpoflow.tasks.storage.workspace import Workspace

    cfg = config_from_dict({"run": {"output_dir": str(tmp_path), "seed": 7}, "sft": {"enabled": False}, "data": data})
    ws = Workspace(tmp_path / "ws")
    return prepare_data(cfg, ws), ws


def test_humaneval_source_prepares_code_rows_the_reward_scores(tmp_path) -> None:
    from datasets import load_from_disk

    summary, _ = _prepare(tmp_path, source="humaneval", eval_size=4)
    assert summary["format"] == "code" and (summary["train_rows"], summary["eval_rows"]) == (160, 4)
    rows = list(load_from_disk(summary["eval_path"]))
    by_prompt = {r["prompt"].strip(): r for r in _humaneval(164)}  # questions are stripped
    solutions = [f"```python\n{r['question']}\n{by_prompt[r['question']]['canonical_solution']}```" for r in rows]
    assert all(r["answer"].rstrip().endswith(f"check({by_prompt[r['question']]['entry_point']})") for r in rows)
    scores = CodeTests(FAST)(
        [r["prompt"] for r in rows],
        solutions,
        answer=[r["answer"] for r in rows],
        question=[r["question"] for r in rows],
    )
    assert scores == [1.0] * 4


def test_code_format_file_and_its_errors(tmp_path) -> None:
    path = tmp_path / "code.jsonl"
    good = [{"question": f"Write f(x) returning x + {i}.", "answer": f"assert f(1) == {1 + i}"} for i in range(5)]
    path.write_text("\n".join(json.dumps(r) for r in [*good, {"question": "q", "answer": "assert ("}]) + "\n")
    with pytest.raises(ValueError, match=r"line 6: answer \(the tests\) is not valid Python"):
        _prepare(tmp_path, source=str(path), format="code")
    summary, _ = _prepare(tmp_path, source=str(path), format="code", on_invalid_row="skip", eval_size=1)
    assert (summary["format"], summary["train_rows"], summary["skipped_rows"]) == ("code", 4, 1)
    from grpoflow.tasks.config import config_from_dict

    with pytest.raises(ValueError, match="sft.enabled: code rows"):
        config_from_dict({"data": {"source": "humaneval"}})


def test_a_grpo_step_with_hostile_programs_goes_on(tmp_path) -> None:
    """A real GRPOTrainer step whose reward runs hostile programs (the tiny model cannot write them, so the reward
    substitutes one per completion): every one is contained, scored 0 and counted, and training continues."""
    from grpoflow.tasks.config import GRPOConfig
    from tests.tasks.grpo.test_trainer import length, make, make_trainer

    good = "def f(x):\n    return x + 1"
    rounds = iter([HOSTILE[k][0], good] * 2 for k in ("infinite_loop", "memory_bomb", "huge_output", "exit_early"))
    code = CodeTests(FAST)

    def hostile_code(prompts, completions, **columns):
        programs = next(rounds)[: len(completions)]
        return code(prompts, programs, answer=["assert f(1) == 2"] * len(programs))

    tok, model = make()
    cfg = GRPOConfig(
        max_steps=2, per_device_train_batch_size=4, num_generations=4, max_completion_length=4, save_steps=10
    )
    hostile_code.take_counts = code.take_counts  # the outcomes become the step's metrics
    trainer = make_trainer(cfg, tok, model, tmp_path / "ckpt", funcs=[("length", length), ("code", hostile_code)])
    assert trainer.train()["steps"] == 2
    assert sum(code.reasons.values()) == 8 and code.reasons["passed"] == 4, code.reasons
    assert [h["rewards/code/mean"] for h in trainer.history] == [0.5, 0.5]
    for h, bad in zip(trainer.history, ["infinite_loop", "memory_bomb"]):  # one round a step: 2 hostile, 2 good
        counts = {k[len("rewards/code/") :]: v for k, v in h.items() if k.startswith("rewards/code/")}
        counts = {k: v for k, v in counts.items() if k not in ("mean", "std")}
        assert counts.pop("passed") == 2 and sum(counts.values()) == 2, h  # per step, not cumulative
        assert set(counts) <= HOSTILE[bad][1], counts


def test_eval_accuracy_and_pass_at_k_count_passing_programs() -> None:
    from grpoflow.tasks.stages.evaluate import eval_reward_funcs, greedy_metrics, pass_at_k, sampled_metrics

    funcs = eval_reward_funcs(resolve_reward_funcs(["code_tests"], FAST))
    good, bad = "```python\ndef f(x):\n    return x + 1\n```", "```python\ndef f(x):\n    return x\n```"
    rows = [{"prompt": "p", "question": "Write f.", "answer": "assert f(1) == 2"}] * 2
    metrics, scores = greedy_metrics(funcs, rows, [good, bad], [10, 10])
    assert scores["code_tests"] == [1.0, 0.0] and metrics["accuracy"] == 0.5
    metrics, correct = sampled_metrics(funcs, rows, [good, bad, bad, bad], [10] * 4, 2, [1, 2])
    assert correct == [1, 0] and metrics["pass_at_2"] == pytest.approx(pass_at_k(2, 1, 2) / 2)


def test_cli_validate_resolves_code_tests_and_checks_its_keys(tmp_path) -> None:
    import subprocess
    import sys

    def validate(*overrides: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "grpoflow.flows.cli", "validate", "default", *overrides]
        return subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120)

    res = validate("grpo.reward_funcs=[code_tests]", "grpo.code_reward.allow_unsafe=true")
    assert res.returncode == 0, res.stderr[-2000:]
    res = validate("grpo.reward_funcs=[code_tests]", "grpo.code_reward.timeout_s=0")
    assert res.returncode == 2 and "grpo.code_reward.timeout_s" in res.stderr, res.stderr[-2000:]


def test_check_isolation_refuses_unsafe_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sandbox, "isolation", lambda: "rlimits")
    monkeypatch.setattr(unsafe_mode, "unsafe_refusal", lambda: "credential files a program of this uid could read: x")
    with pytest.raises(ValueError, match="allow_unsafe refused: not root.*credential files"):
        CodeTests(FAST).check_isolation()
