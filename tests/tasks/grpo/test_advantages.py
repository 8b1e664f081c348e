"""GRPO advantages against hand-computed values (TRL semantics; full TRL parity: test_trl_parity.py)."""

import math

import pytest
import torch

from grpoflow.tasks.grpo.advantages import combine_rewards, decoupled_advantages, group_advantages


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


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("value", [0.1, 2.7, 1 / 3])
def test_a_group_whose_rewards_are_all_equal_gets_advantage_exactly_zero(scale, value):
    """Not 1e4 times the rounding error of its mean (7.5e-5 at 0.1, 2.4e-3 at 2.7, one sign for the whole group, as
    TRL's mean and std give): exactly 0, so those rows also get no gradient (loss.rows_with_gradient). A group with
    NaN rows (rewards that did not apply) whose others are equal counts too; the other group is unchanged."""
    other = torch.tensor([0.1 * i for i in range(8)])
    rewards = torch.cat([torch.full((8,), value), other, torch.tensor([value, float("nan")] * 4)])
    adv, _ = group_advantages(rewards, 8, scale)
    assert (adv[:8] == 0).all() and (adv[16:] == 0).all(), adv
    mean = other.mean()
    want = other - mean
    if scale == "group":
        want = want / (other.std() + 1e-4)
    if scale != "batch":
        torch.testing.assert_close(adv[8:16], want)
    per_func = torch.stack([torch.cat([torch.full((8,), value), other]), torch.full((16,), value)], dim=1)
    gdpo, _ = decoupled_advantages(per_func, None, 8)
    assert (gdpo[:8] == gdpo[0]).all() and torch.isfinite(gdpo).all()
    # the second function is constant in every group: it adds exactly nothing, so the result is the first's alone
    alone, _ = decoupled_advantages(per_func[:, :1], None, 8)
    assert torch.equal(gdpo, alone)
