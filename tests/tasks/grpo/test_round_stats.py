"""The round's stats (tasks/grpo/round_stats.py) on hand-made rounds of one process: the values a run logs."""

import logging
import math

import pytest
import torch

from grpoflow.tasks.config import GRPOConfig
from grpoflow.tasks.grpo.batch import build_round
from grpoflow.tasks.grpo.round_stats import completion_stats, reward_stats, round_advantages
from grpoflow.tasks.launch.dist import Comm
from grpoflow.tasks.rewards import UnscoredRounds

NAN = float("nan")


def test_completion_stats_count_terminated_ones_apart_and_every_token():
    completions = [[5, 6, 7], [5], [5, 6, 7, 8, 9], [5, 6]]
    batch = build_round([[1, 2], [1, 2], [3], [3]], completions, [[0.0] * len(c) for c in completions],
                        ["stop", "stop", "length", "stop"], pad_id=0, mask_truncated=False)  # fmt: skip
    stats, tokens = completion_stats(completions, batch, Comm())
    assert stats["completions/mean_length"] == pytest.approx(11 / 4)
    assert (stats["completions/min_length"], stats["completions/max_length"]) == (1, 5)
    assert stats["completions/clipped_ratio"] == 0.25  # the one cut at the limit
    assert stats["completions/mean_terminated_length"] == pytest.approx(2.0)  # 3, 1, 2
    assert stats["completions/max_terminated_length"] == 3
    assert tokens == 2 + 2 + 1 + 1 + 11  # prompt tokens (no padding) and completion tokens


def test_reward_stats_are_nan_aware_and_tally_a_reward_that_scored_nothing():
    per_func = torch.tensor([[1.0, NAN], [3.0, NAN], [NAN, NAN], [2.0, NAN]])
    total, unscored, _, _ = round_advantages(per_func, None, ["a", "b"], GRPOConfig(num_generations=2))
    tally = UnscoredRounds()
    stats = reward_stats(per_func, unscored, [("a", None), ("b", None)], ["a", "b"], tally)
    assert stats["rewards/a/mean"] == pytest.approx(2.0) and stats["rewards/a/std"] == pytest.approx(1.0)
    assert math.isnan(stats["rewards/b/mean"]) and stats["rewards/b/std"] == 0.0
    assert stats["frac_unscored"] == 0.25 and stats["rewards/b/unscored_rounds"] == 1.0
    assert "rewards/a/unscored_rounds" not in stats


def test_a_round_no_function_scored_has_zero_advantages_and_a_warning(caplog):
    per_func = torch.full((4, 1), NAN)
    with caplog.at_level(logging.WARNING, "grpoflow.tasks.grpo.round_stats"):
        _, unscored, adv, _ = round_advantages(per_func, None, ["correctness"], GRPOConfig(num_generations=2))
    assert bool(unscored.all()) and torch.equal(adv, torch.zeros(4))
    assert "no reward function scored any completion of this round" in caplog.text and "(correctness)" in caplog.text
