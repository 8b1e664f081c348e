"""GRPO advantages against hand-computed values (TRL semantics; full TRL parity: test_trl_parity.py)."""

import math

import pytest
import torch

from grpoflow.tasks.grpo.advantages import combine_rewards, group_advantages


def test_combine_rewards_is_weighted_and_nan_aware():
    r = torch.tensor([[1.0, float("nan")], [float("nan"), float("nan")], [2.0, 3.0]])
    total = combine_rewards(r, torch.tensor([0.5, 2.0]))
    assert total[0] == 0.5 and math.isnan(total[1]) and total[2] == 7.0


def test_group_advantages_group_batch_none():
    r = torch.tensor([1.0, 3.0, 5.0, 5.0])  # two groups of 2
    adv, stats = group_advantages(r, 2, "group")
    std0 = torch.tensor([1.0, 3.0]).std().item()
    torch.testing.assert_close(adv, torch.tensor([-1 / (std0 + 1e-4), 1 / (std0 + 1e-4), 0.0, 0.0]))
    assert stats["frac_reward_zero_std"] == 0.5
    assert stats["reward"] == pytest.approx(3.5)
    adv_b, _ = group_advantages(r, 2, "batch")
    torch.testing.assert_close(adv_b, torch.tensor([-1.0, 1.0, 0.0, 0.0]) / (r.std() + 1e-4))
    adv_n, _ = group_advantages(r, 2, "none")
    torch.testing.assert_close(adv_n, torch.tensor([-1.0, 1.0, 0.0, 0.0]))


def test_nan_rewards_give_zero_advantage():
    r = torch.tensor([float("nan"), 1.0, 2.0, 4.0])
    adv, _ = group_advantages(r, 2, "none")
    assert adv[0] == 0.0 and adv[1] == 0.0  # group 0 has one value: its mean is 1, the NaN row -> 0
    torch.testing.assert_close(adv[2:], torch.tensor([-1.0, 1.0]))
