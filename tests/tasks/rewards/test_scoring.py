"""Tests for tasks/rewards/scoring.py: the built-in names, import-path resolution and its signature checks,
scoring a batch, misbehaving rewards refused by name, the reward timeout and unscored rounds."""

from __future__ import annotations

import math
import textwrap

import pytest

from grpoflow.tasks.rewards.scoring import (
    BUILTIN_REWARDS,
    RewardError,
    UnscoredRounds,
    resolve_reward_funcs,
    score_completions,
)
from grpoflow.tasks.rewards.text import correctness
from tests.tasks.rewards.test_text import GOOD, WRONG, conv


def test_builtin_registry_names():
    assert set(BUILTIN_REWARDS) == {
        "correctness",
        "int",
        "strict_format",
        "soft_format",
        "xmlcount",
        "proximity",
        "code_tests",
    }


# ---------------------------------------------------------------------------- resolution
@pytest.fixture
def plugin(tmp_path, monkeypatch):
    (tmp_path / "my_rewards_plugin.py").write_text(
        textwrap.dedent(
            """
            def length_penalty(prompts, completions, **kwargs):
                return [-len(c) / 100 for c in completions]

            def bad_length(prompts, completions, **kwargs):
                return [0.0]

            def not_a_list(prompts, completions, **kwargs):
                return 1.0

            def half_none(prompts, completions, **kwargs):
                return [None if i % 2 else 1.0 for i in range(len(completions))]

            class Holder:
                @staticmethod
                def nested(prompts, completions, **kwargs):
                    return [0.0] * len(completions)

            NOT_CALLABLE = 3
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_rewards_plugin"


def test_resolve_builtins_in_order():
    resolved = resolve_reward_funcs(["xmlcount", "correctness", "int"])
    assert [n for n, _ in resolved] == ["xmlcount", "correctness", "int"]
    assert resolved[1][1] is correctness


def test_resolve_import_path(plugin):
    (name, fn), (name2, _) = resolve_reward_funcs([f"{plugin}:length_penalty", f"{plugin}:Holder.nested"])
    assert name == "length_penalty" and name2 == "nested"
    assert fn(prompts=["p"], completions=["abcd"]) == [-0.04]


def test_resolve_unknown_name_lists_builtins():
    with pytest.raises(ValueError, match=r"unknown reward 'corectness'.*correctness.*xmlcount"):
        resolve_reward_funcs(["corectness"])


def test_resolve_bad_module():
    with pytest.raises(ValueError, match=r"no_such_module_xyz:f.*No module named 'no_such_module_xyz'"):
        resolve_reward_funcs(["no_such_module_xyz:f"])


def test_resolve_missing_attribute(plugin):
    with pytest.raises(ValueError, match=rf"{plugin}:missing.*has no attribute 'missing'"):
        resolve_reward_funcs([f"{plugin}:missing"])


def test_resolve_not_callable(plugin):
    with pytest.raises(ValueError, match="not callable"):
        resolve_reward_funcs([f"{plugin}:NOT_CALLABLE"])


def test_resolve_malformed_path():
    with pytest.raises(ValueError, match="package.module:function"):
        resolve_reward_funcs(["grpoflow.tasks.rewards:"])


def test_resolve_duplicate_names(plugin):
    with pytest.raises(ValueError, match="unique"):
        resolve_reward_funcs(["correctness", "grpoflow.tasks.rewards:correctness"])


# ---------------------------------------------------------------------------- scoring
def test_score_completions(plugin):
    funcs = resolve_reward_funcs(["correctness", "proximity", f"{plugin}:half_none"])
    comps = [conv(GOOD), conv(WRONG)]
    scores = score_completions(funcs, [["p"], ["p"]], comps, {"answer": ["72", "Paris"]})
    assert list(scores) == ["correctness", "proximity", "half_none"]
    assert scores["correctness"] == [2.0, 0.0]
    assert scores["proximity"][0] == 1.0 and math.isnan(scores["proximity"][1])
    assert scores["half_none"][0] == 1.0 and math.isnan(scores["half_none"][1])


@pytest.mark.parametrize("fn, match", [("bad_length", "returned 1 values for 2"), ("not_a_list", "returned float")])
def test_score_completions_checks_output(plugin, fn, match):
    funcs = resolve_reward_funcs([f"{plugin}:{fn}"])
    with pytest.raises(ValueError, match=rf"'{fn}'.*{match}"):
        score_completions(funcs, ["p", "p"], ["a", "b"], {})


# ---------------------------------------------------------------------------- misbehaving rewards
@pytest.fixture
def bad_plugin(tmp_path, monkeypatch):
    (tmp_path / "bad_rewards_plugin.py").write_text(
        textwrap.dedent(
            """
            import numpy as np
            import torch

            def infinite(prompts, completions, **kwargs):
                return [1.0, float("inf")]

            def minus_infinite(prompts, completions, **kwargs):
                return [float("-inf"), 0.0]

            def text(prompts, completions, **kwargs):
                return [1.0, "high"]

            def as_numpy(prompts, completions, **kwargs):
                return np.array([0.5, np.nan])

            def as_tensor(prompts, completions, **kwargs):
                return torch.tensor([1.0, 2.0])

            def as_bools(prompts, completions, **kwargs):
                return [True, np.bool_(False)]

            def raises(prompts, completions, **kwargs):
                raise KeyError("answer")

            def no_kwargs(prompts, completions):
                return [0.0] * len(completions)

            def positional_only(prompts, /, completions, **kwargs):
                return [0.0] * len(completions)

            def needs_solution(completions, solution, **kwargs):
                return [0.0] * len(completions)

            def reads_a_column(completions, answer, question, *, reference=None, bonus=1.0, **kwargs):
                return [bonus] * len(completions)
            """
        )
    )
    (tmp_path / "broken_on_import.py").write_text("raise RuntimeError('needs an API key')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return "bad_rewards_plugin"


@pytest.mark.parametrize(
    "fn, match",
    [
        ("infinite", r"'infinite' returned inf for completion 1 \('wrong'\): a reward must be finite"),
        ("minus_infinite", r"returned -inf for completion 0 \('right'\)"),
        ("text", r"non-numeric value 'high' for completion 1"),
        ("raises", r"reward 'raises' raised KeyError: 'answer'"),
    ],
)
def test_misbehaving_rewards_are_refused_naming_function_and_sample(bad_plugin, fn, match):
    funcs = resolve_reward_funcs([f"{bad_plugin}:{fn}"])
    with pytest.raises(RewardError, match=match):
        score_completions(funcs, ["p", "p"], ["right", "wrong"], {})


def test_arrays_tensors_bools_and_nan_are_converted(bad_plugin):
    names = ["as_numpy", "as_tensor", "as_bools"]
    scores = score_completions(resolve_reward_funcs([f"{bad_plugin}:{n}" for n in names]), ["p", "p"], ["a", "b"], {})
    assert scores["as_numpy"][0] == 0.5 and math.isnan(scores["as_numpy"][1])  # NaN: not scored, as TRL
    assert scores["as_tensor"] == [1.0, 2.0] and scores["as_bools"] == [1.0, 0.0]
    assert all(type(v) is float for vals in scores.values() for v in vals)


@pytest.mark.parametrize(
    "spec, match",
    [
        ("bad_rewards_plugin:no_kwargs", r"takes no \*\*kwargs"),
        ("bad_rewards_plugin:positional_only", r"'prompts' .* is positional-only"),
        ("broken_on_import:f", r"importing 'broken_on_import' raised RuntimeError: needs an API key"),
        ("bad_rewards_plugin:needs_solution", r"parameter 'solution' .* has no default and is never passed"),
    ],
)
def test_bad_reward_specs_fail_at_resolution(bad_plugin, spec, match):
    with pytest.raises(ValueError, match=match):
        resolve_reward_funcs([spec])


def test_a_reward_may_name_the_columns_it_is_passed(bad_plugin):
    """Required parameters among prompts, completions and the prepared columns are fine; PASSED is what the
    trainer passes: prompts, completions and every column of the prepared rows but the prompt."""
    from grpoflow.tasks.dataio.rows import FEATURES
    from grpoflow.tasks.rewards.scoring import PASSED

    assert set(PASSED) == {"prompts", "completions"} | (set(FEATURES) - {"prompt"})
    ((name, fn),) = resolve_reward_funcs(["bad_rewards_plugin:reads_a_column"])
    columns = {"question": ["q"], "answer": ["a"], "reference": ["r"]}
    assert score_completions([(name, fn)], ["p"], ["c"], columns)[name] == [1.0]


def test_cli_validate_checks_rewards_and_non_finite_numbers(bad_plugin, tmp_path):
    """`grpoflow validate` imports the rewards and rejects inf/nan, exit 2 naming the key, in seconds."""
    import subprocess
    import sys

    env = {**__import__("os").environ, "PYTHONPATH": str(tmp_path)}
    for override, match in [
        ("grpo.reward_funcs=[correctness,nope_module:fn]", "grpo.reward_funcs: reward 'nope_module:fn'"),
        ("grpo.reward_funcs=[broken_on_import:f]", "raised RuntimeError: needs an API key"),
        ("grpo.reward_funcs=[bad_rewards_plugin:no_kwargs]", "takes no **kwargs"),
        ("grpo.learning_rate=.inf", "grpo.learning_rate: Input should be a finite number"),
    ]:
        res = subprocess.run(
            [sys.executable, "-m", "grpoflow.flows.cli", "validate", "default", override],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert res.returncode == 2 and match in res.stderr, (override, res.stderr[-2000:])
        assert "Traceback" not in res.stderr


def test_reward_timeout_names_the_function(tmp_path, monkeypatch):
    import time

    def sleepy(prompts, completions, **kwargs):
        time.sleep(5)
        return [1.0] * len(completions)

    t0 = time.perf_counter()
    with pytest.raises(RewardError, match=r"reward 'sleepy' did not return within grpo.reward_timeout_s=0.2 s"):
        score_completions([("sleepy", sleepy)], ["p"], ["a"], {}, timeout=0.2)
    assert time.perf_counter() - t0 < 2
    # the abandoned call runs on in a daemon thread, which the interpreter does not wait for at exit
    import threading

    assert [t.daemon for t in threading.enumerate() if t.name == "reward-sleepy"] == [True]
    assert score_completions([("quick", lambda prompts, completions, **kw: [0.5])], ["p"], ["a"], {}, 1.0) == {
        "quick": [0.5]
    }
    here = []

    def where(prompts, completions, **kwargs):
        here.append(threading.current_thread())
        return [1.0]

    for unbounded in (None, 0):  # no bound: called in this thread
        score_completions([("where", where)], ["p"], ["a"], {}, unbounded)
    assert here == [threading.main_thread()] * 2

    def raising(prompts, completions, **kwargs):
        raise KeyError("score")

    with pytest.raises(RewardError, match=r"reward 'raising' raised KeyError: 'score'"):  # raised in its thread
        score_completions([("raising", raising)], ["p"], ["a"], {}, timeout=5)


def test_unscored_rounds_warn_naming_the_reward_and_count(caplog):
    u = UnscoredRounds()
    nan = float("nan")
    with caplog.at_level("WARNING", logger="grpoflow.tasks.rewards.scoring"):
        first = u.update(["nothing", "fine"], [[nan, nan], [1.0, nan]])
        second = u.update(["nothing", "fine"], [[nan, nan], [nan, nan]])
    assert first == {"rewards/nothing/unscored_rounds": 1.0}  # a reward that scored is not charted
    assert second == {"rewards/nothing/unscored_rounds": 2.0, "rewards/fine/unscored_rounds": 1.0}
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 2  # once per reward, not once per round
    assert warned[0].startswith("reward 'nothing' scored no completion of this round") and "'fine'" in warned[1]


def test_reward_timeout_key_default_alias_and_zero():
    from grpoflow.tasks.config import ConfigError, config_from_dict

    assert config_from_dict({}).grpo.reward_timeout_s == 120
    assert config_from_dict({"grpo": {"reward_timeout": 7}}).grpo.reward_timeout_s == 7
    assert config_from_dict({"grpo": {"reward_timeout_s": 0}}).grpo.reward_timeout_s == 0
    with pytest.raises(ConfigError, match="reward_timeout"):
        config_from_dict({"grpo": {"reward_timeout": -1}})
    from grpoflow.flows.stages import PIPELINE
    from grpoflow.tasks.pipeline.fingerprint import stage_keys

    # raising the bound on resume keeps the GRPO stage's key (and so its checkpoints)
    keys = [stage_keys(PIPELINE, config_from_dict({"grpo": {"reward_timeout": t}}))["grpo"] for t in (5, 500)]
    assert keys[0] == keys[1]


def test_a_lambda_reward_logs_under_its_attribute_name(tmp_path, monkeypatch):
    (tmp_path / "lambda_rewards.py").write_text("bonus = lambda prompts, completions, **kw: [1.0] * len(completions)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    [(name, fn)] = resolve_reward_funcs(["lambda_rewards:bonus"])
    assert fn.__name__ == "<lambda>" and name == "bonus"  # rewards/bonus/mean: a key MLflow stores


def test_reward_names_are_safe_and_two_that_collide_are_refused_at_config_load():
    from grpoflow.tasks.config import ConfigError, config_from_dict
    from grpoflow.tasks.config.reward_names import reward_name

    assert [reward_name(s) for s in ("correctness", "m:Holder.score", "<lambda>", "m:a<b>c")] == [
        "correctness",
        "score",
        "lambda",
        "a_b_c",
    ]
    with pytest.raises(
        (ConfigError, ValueError), match=r"'a\.x:score' and 'b\.y:score' would both log as rewards/score"
    ):
        config_from_dict({"grpo": {"reward_funcs": ["correctness", "a.x:score", "b.y:score"]}})
