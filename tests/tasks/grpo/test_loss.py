"""The GRPO loss against hand-computed values (TRL semantics; full TRL parity: test_trl_parity.py)."""

import math

import pytest
import torch

from grpoflow.tasks.grpo.loss import LossSettings, grpo_loss


def _inputs():
    g = torch.Generator().manual_seed(0)
    logp = (torch.randn(3, 4, generator=g) - 2).requires_grad_()
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    adv = torch.tensor([1.0, -0.5, 2.0])
    return logp, mask, adv


def test_on_policy_dapo_loss_and_gradient():
    logp, mask, adv = _inputs()
    s = LossSettings(loss_type="dapo", gradient_accumulation_steps=2, steps_per_generation=2)
    n_round = 20.0
    loss, _ = grpo_loss(logp, None, adv, mask, s, num_items_in_round=n_round)
    # ratio == 1 on policy: loss = -sum(m * A) / (N * GA / spg)
    expected = -(mask * adv[:, None]).sum() / n_round
    torch.testing.assert_close(loss, expected.float())
    loss.backward()
    # d/dlogp of -A * exp(logp - sg(logp)) = -A, scaled by the normalizer
    torch.testing.assert_close(logp.grad, (-adv[:, None] * mask / n_round).float())


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo"])
def test_aggregations(loss_type):
    logp, mask, adv = _inputs()
    s = LossSettings(loss_type=loss_type, gradient_accumulation_steps=2, max_completion_length=8)
    loss, _ = grpo_loss(logp, None, adv, mask, s)
    per = -adv[:, None] * torch.ones_like(logp)
    m = mask.float()
    expected = {
        "grpo": ((per * m).sum(1) / m.sum(1)).mean() / 2,
        "bnpo": (per * m).sum() / m.sum() / 2,
        "dr_grpo": (per * m).sum() / (3 * 8) / 2,
    }[loss_type]
    torch.testing.assert_close(loss, expected)


def test_clipping_uses_epsilon_high_and_reports_ratios():
    logp = torch.log(torch.tensor([[1.5, 0.5]]))
    old = torch.zeros(1, 2)
    mask = torch.ones(1, 2)
    s = LossSettings(loss_type="bnpo", epsilon=0.2, epsilon_high=0.28)
    loss_pos, ex = grpo_loss(logp, old, torch.tensor([1.0]), mask, s)
    # A>0: min(w, clip(w)) -> token 0: min(1.5, 1.28) = 1.28; token 1: min(0.5, 0.8) = 0.5
    torch.testing.assert_close(loss_pos, -torch.tensor((1.28 + 0.5) / 2))
    assert ex["is_high_clipped"].tolist() == [[True, False]]
    loss_neg, ex = grpo_loss(logp, old, torch.tensor([-1.0]), mask, s)
    # A<0: -min(-w, -clip(w)) = max(w, clip) -> 1.5 and 0.8
    torch.testing.assert_close(loss_neg, torch.tensor((1.5 + 0.8) / 2))
    assert ex["is_low_clipped"].tolist() == [[False, True]]


def test_all_masked_batch_is_zero_not_nan():
    logp, _, adv = _inputs()
    mask = torch.zeros(3, 4)
    for lt in ("grpo", "bnpo", "dr_grpo", "dapo"):
        loss, _ = grpo_loss(logp, None, adv, mask, LossSettings(loss_type=lt), num_items_in_round=0.0)
        assert loss.item() == 0.0


def test_kl_k3_with_bias_correction():
    logp = torch.log(torch.tensor([[0.5]]))
    ref = torch.log(torch.tensor([[0.25]]))
    s = LossSettings(loss_type="bnpo", beta=0.1)
    loss, ex = grpo_loss(logp, None, torch.tensor([0.0]), torch.ones(1, 1), s, ref_logp=ref)
    d = math.log(0.25) - math.log(0.5)
    k3 = math.exp(d) - d - 1
    assert ex["kl"].item() == pytest.approx(k3)
    assert loss.item() == pytest.approx(0.1 * k3)
