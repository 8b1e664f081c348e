"""Rewards -> group-relative advantages (TRL GRPOTrainer semantics, docs/grpo.md).

    r[b]  = nansum_k w_k * r_k[b]          (a row where every function gave NaN stays NaN)
    A[b]  = r[b] - mean_group(r)           (NaN-aware over the G completions of one prompt)
    scale_rewards = group: A /= std_group(r) + 1e-4
                    batch: A /= std over the whole generation batch + 1e-4
                    none : no division
    NaN advantages -> 0.
    A group whose rewards are all equal gets A = 0 exactly (:func:`all_equal`). Computed as above, its mean of
    non-dyadic values (0.1, 2.7) is off by a rounding error that the division by std + 1e-4 (std 0 or of the same
    order) multiplies by up to 1e4: every row of the group would get the same small advantage of the same sign
    (7.5e-5 at rewards of 0.1, 2.4e-3 at 2.7), a bias toward or against all of its completions. TRL's mean and
    std give the same values. At exactly 0 the rows also get no gradient, which the trainer uses (loss.py
    rows_with_gradient).

multi_objective_aggregation = normalize_then_sum (GDPO; :func:`decoupled_advantages`): each function's rewards are
normalized within their group first, r~_k = (r_k - mean_group(r_k)) / (std_group(r_k) + 1e-4), then
r = nansum_k w_k r~_k and A = (r - mean_batch(r)) / (std_batch(r) + 1e-4).

Completions of one prompt are consecutive: rows [g*G, (g+1)*G) form group g. TRL uses the
unbiased (n-1) std from torch.std; so do we (nanstd with correction 1).
"""

from __future__ import annotations

import torch


def combine_rewards(per_func: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """[B, K] rewards (NaN = not applicable) -> [B] weighted NaN-aware sum; all-NaN rows stay NaN."""
    if weights is None:
        weights = torch.ones(per_func.shape[1], dtype=per_func.dtype)
    weighted = per_func * weights.to(per_func.dtype).unsqueeze(0)
    total = torch.nansum(weighted, dim=1)
    all_nan = torch.isnan(per_func).all(dim=1)
    return torch.where(all_nan, torch.full_like(total, float("nan")), total)


def nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Unbiased std ignoring NaNs (NaN when fewer than 2 values)."""
    mask = ~torch.isnan(x)
    n = mask.sum(dim) if dim is not None else mask.sum()
    mean = torch.nanmean(x, dim=dim, keepdim=dim is not None)
    sq = torch.where(mask, (x - mean) ** 2, torch.zeros_like(x))
    var = sq.sum(dim) if dim is not None else sq.sum()
    var = var / (n - 1).clamp(min=1)
    return torch.where(n > 1, var.sqrt(), torch.full_like(var, float("nan")))


def group_advantages(
    rewards: torch.Tensor, num_generations: int, scale_rewards: str = "group", eps: float = 1e-4
) -> tuple[torch.Tensor, dict[str, float]]:
    """[B] total rewards -> [B] advantages, plus the statistics TRL logs (reward, reward_std over the
    batch, frac_reward_zero_std over the std used: the group's, or the batch's for "batch")."""
    if rewards.numel() % num_generations:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {num_generations}")
    grouped = rewards.view(-1, num_generations)  # [P, G]
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(num_generations)  # [B]
    if scale_rewards in ("group", "none"):
        std = nanstd(grouped, dim=1).repeat_interleave(num_generations)  # [B]
    elif scale_rewards == "batch":
        std = nanstd(rewards).expand_as(rewards)
    else:
        raise ValueError(f"scale_rewards must be group, batch or none (got {scale_rewards!r})")
    adv = rewards - mean
    if scale_rewards != "none":
        adv = adv / (std + eps)
    adv = torch.nan_to_num(adv, nan=0.0).masked_fill(all_equal(grouped, 1).repeat_interleave(num_generations), 0.0)
    stats = {
        "reward": torch.nanmean(rewards).item(),
        "reward_std": nanstd(rewards).item(),
        "frac_reward_zero_std": torch.isclose(std, torch.zeros_like(std)).float().mean().item(),
    }
    return adv, stats


def decoupled_advantages(
    per_func: torch.Tensor, weights: torch.Tensor | None, num_generations: int, eps: float = 1e-4
) -> tuple[torch.Tensor, float]:
    """[B, K] rewards -> [B] advantages by normalize_then_sum (module docstring), and the fraction of rows whose
    (batch) std is 0; rows no function scored stay NaN through the sums and end with advantage 0."""
    b, k = per_func.shape
    if weights is None:
        weights = torch.ones(k, dtype=per_func.dtype)
    grouped = per_func.view(-1, num_generations, k)  # [P, G, K]
    mean_k = torch.nanmean(grouped, dim=1, keepdim=True)
    std_k = nanstd(grouped, dim=1).unsqueeze(1)
    normed = ((grouped - mean_k) / (std_k + eps)).masked_fill(all_equal(grouped, 1).unsqueeze(1), 0.0).view(b, k)
    rewards = (normed * weights.to(per_func.dtype).unsqueeze(0)).nansum(dim=1)
    rewards[torch.isnan(per_func).all(dim=1)] = torch.nan
    std = nanstd(rewards).expand_as(rewards)
    adv = torch.nan_to_num((rewards - torch.nanmean(rewards)) / (std + eps), nan=0.0)
    return adv, torch.isclose(std, torch.zeros_like(std)).float().mean().item()


def all_equal(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Whether the values of ``x`` along ``dim`` that are not NaN are all equal (at least one of them): the groups
    whose advantage is exactly 0 (module docstring)."""
    lo = torch.where(torch.isnan(x), torch.inf, x).amin(dim)
    hi = torch.where(torch.isnan(x), -torch.inf, x).amax(dim)
    return lo == hi
