"""What a scored generation round yields besides its tensors: the advantages, the reward and completion stats the
trainer logs, and the completion table's rows. Functions of the round and the config, used by GRPOTrainer."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from grpoflow.tasks.config import GRPOConfig
from grpoflow.tasks.grpo.advantages import combine_rewards, decoupled_advantages, group_advantages, nanstd
from grpoflow.tasks.grpo.batch import RoundTensors
from grpoflow.tasks.grpo.dynamic import Drawn
from grpoflow.tasks.launch.dist import Comm
from grpoflow.tasks.rewards import UnscoredRounds

log = logging.getLogger(__name__)


def round_advantages(
    per_func: torch.Tensor, weights: torch.Tensor | None, reward_names: Sequence[str], g: GRPOConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict]:
    """(total reward r [B], unscored [B], advantages A [B], their stats) of the whole round's per-function
    rewards r_k [B, K] (NaN: not scored), w the reward ``weights``:

        r = nansum_k w_k * r_k    (NaN where no function scored the row: unscored; combine_rewards)
        A = group_advantages(r)   ("sum_then_normalize"), or decoupled_advantages(r_k) ("normalize_then_sum")
    Warns when no function scored any completion of the round."""
    total = combine_rewards(per_func, weights)
    unscored = torch.isnan(total)
    if bool(unscored.all()):
        log.warning(
            "no reward function scored any completion of this round (every value None or NaN): its advantages "
            "are 0 and it teaches nothing; check that the functions find the columns they need (%s)",
            ", ".join(reward_names),
        )
    adv, stats = group_advantages(total, g.num_generations, g.scale_rewards)  # over the round, then sliced
    if g.multi_objective_aggregation == "normalize_then_sum":
        adv, stats["frac_reward_zero_std"] = decoupled_advantages(per_func, weights, g.num_generations)
    return total, unscored, adv, stats


def reward_stats(
    per_func: torch.Tensor,
    unscored: torch.Tensor,
    reward_funcs: Sequence[tuple[str, object]],
    reward_names: Sequence[str],
    unscored_rounds: UnscoredRounds,
) -> dict:
    """The round's reward stats: each function's own counts (``take_counts``: code_tests' outcomes, e.g.
    rewards/x/timeout), frac_unscored (completions no function scored), the unscored-rounds tally (``unscored_rounds``
    updated) and each function's NaN-aware rewards/<name>/mean and /std."""
    stats = {}
    for name, fn in reward_funcs:  # a reward's own counts (code_tests: outcomes), e.g. rewards/x/timeout
        if callable(take := getattr(fn, "take_counts", None)):
            stats.update({f"rewards/{name}/{k}": v for k, v in take().items()})
    stats["frac_unscored"] = unscored.float().mean().item()  # completions no reward function scored
    stats.update(unscored_rounds.update(reward_names, per_func.t().tolist()))
    for k, name in enumerate(reward_names):
        col = per_func[:, k]
        stats[f"rewards/{name}/mean"] = torch.nanmean(col).item()
        stats[f"rewards/{name}/std"] = torch.nan_to_num(nanstd(col), nan=0.0).item()
    return stats


def completion_stats(completion_ids: list[list[int]], batch: RoundTensors, comm: Comm) -> tuple[dict, int]:
    """The round's completion lengths over every rank (completions/*: all, terminated ones apart, the fraction cut
    at the limit) and its token count over every rank (prompt and completion tokens), for num_tokens."""
    local_lengths = torch.tensor([len(c) for c in completion_ids], dtype=torch.float32)
    lengths, truncated = comm.all_gather(local_lengths), comm.all_gather(batch.truncated)  # the round's
    term = lengths[~truncated]
    tokens = int(comm.all_reduce(batch.prompt_mask.sum() + local_lengths.sum()))
    stats = {
        "completions/mean_length": lengths.mean().item(),
        "completions/min_length": lengths.min().item(),
        "completions/max_length": lengths.max().item(),
        "completions/clipped_ratio": truncated.float().mean().item(),
        "completions/mean_terminated_length": term.mean().item() if term.numel() else 0.0,
        "completions/min_terminated_length": term.min().item() if term.numel() else 0.0,
        "completions/max_terminated_length": term.max().item() if term.numel() else 0.0,
    }
    return stats, tokens


def round_samples(
    d: Drawn,
    total: torch.Tensor,
    adv: torch.Tensor,
    mine: slice,
    reward_names: Sequence[str],
    comm: Comm,
    log_completions: bool,
) -> list[dict]:
    """The completion table's rows for this rank's completions (question, answer, completion, total and
    per-function rewards, advantage); with distributed completion logging, every rank's (rank 0 logs them)."""
    samples = [
        {
            "question": r.get("question", ""),
            "answer": r.get("answer", ""),
            "completion": t,
            "reward": float(tr),
            **{f"rewards/{name}": float(v) for name, v in zip(reward_names, parts)},
            "advantage": float(a),
        }
        for r, t, tr, parts, a in zip(d.rows, d.texts, total[mine].tolist(), d.per_func.tolist(), adv[mine].tolist())
    ]
    if comm.world > 1 and log_completions:  # rank 0 logs the whole round's table
        samples = [s for part in comm.all_gather_object(samples) for s in part]
    return samples


def completion_tables(step: int, max_steps: int) -> list[str]:
    """Names of the completion tables to log at optimizer ``step``: start (step 1), middle
    ((max_steps + 1) // 2) and end (max_steps). A few fixed names rather than one per step, since MLflow
    keeps every logged table's name in one run tag of bounded length; a short run logs one table under
    several names (max_steps 1: all three at step 1)."""
    points = {"start": 1, "middle": (max_steps + 1) // 2, "end": max_steps}
    return [name for name, at in points.items() if at == step]
