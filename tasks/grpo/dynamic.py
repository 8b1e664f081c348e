"""DAPO's additions to a generation round (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System
at Scale", arXiv 2503.14476), both off by default: dynamic sampling and overlong reward shaping.

Dynamic sampling (``grpo.dynamic_sampling``): a group whose rewards all agree (std 0: every completion right, or
every one wrong) has advantage 0 everywhere and teaches nothing. Such groups are dropped and fresh prompts are
drawn for the missing places, at most ``dynamic_sampling_max_rounds`` extra generation calls per round; a round
still short after them is filled with dropped groups (their advantage is 0), so its layout never changes.

Overlong reward shaping (``grpo.overlong_buffer_length`` = L_cache, L_max = ``max_completion_length``), DAPO eq. 13,
times ``overlong_penalty_factor``:

    R_length(y) = 0                                  if |y| <= L_max - L_cache
                = ((L_max - L_cache) - |y|) / L_cache  if L_max - L_cache < |y| <= L_max
                = -1                                 if |y| > L_max
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from grpoflow.tasks.grpo.advantages import combine_rewards, nanstd


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer: int, factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment (module docstring) of completions of ``lengths`` tokens, times ``factor``."""
    lengths = lengths.to(torch.float32)
    start = max_len - buffer
    ramp = (start - lengths) / buffer
    r = torch.where(lengths <= start, torch.zeros_like(lengths), torch.where(lengths <= max_len, ramp, -1.0))
    return r * factor


def with_overlong_penalty(per_func: torch.Tensor, completion_ids: list[list[int]], g) -> torch.Tensor:
    """[B, K] rewards -> [B, K + 1]: the overlong penalty of each completion's token count as the last column."""
    lengths = torch.tensor([len(c) for c in completion_ids])
    penalty = overlong_penalty(lengths, g.max_completion_length, g.overlong_buffer_length, g.overlong_penalty_factor)
    return torch.cat([per_func, penalty.unsqueeze(1)], dim=1)


@dataclass
class Drawn:
    """A batch of prompts sampled and scored: rows [g*G, (g+1)*G) are group g (prompt ``idx[g]``)."""

    idx: list[int]
    completion_ids: list[list[int]]
    logprobs: list[list[float]]
    finish_reasons: list[str]
    rows: list[dict]
    texts: list[str]
    per_func: torch.Tensor  # [B, K]

    def groups(self, keep: list[int], g: int) -> Drawn:
        rows = [r for k in keep for r in range(k * g, (k + 1) * g)]
        pick = lambda xs: [xs[i] for i in rows]  # noqa: E731
        return Drawn(
            [self.idx[k] for k in keep],
            pick(self.completion_ids),
            pick(self.logprobs),
            pick(self.finish_reasons),
            pick(self.rows),
            pick(self.texts),
            self.per_func[rows],
        )

    @staticmethod
    def cat(parts: list[Drawn]) -> Drawn:
        return Drawn(
            [i for p in parts for i in p.idx],
            [c for p in parts for c in p.completion_ids],
            [c for p in parts for c in p.logprobs],
            [c for p in parts for c in p.finish_reasons],
            [c for p in parts for c in p.rows],
            [c for p in parts for c in p.texts],
            torch.cat([p.per_func for p in parts]),
        )


def varied_groups(per_func: torch.Tensor, weights: torch.Tensor | None, g: int) -> torch.Tensor:
    """[P] bool: groups whose total rewards differ (NaN-aware std > 0); a group with fewer than two scored
    completions has no spread either."""
    std = nanstd(combine_rewards(per_func, weights).view(-1, g), dim=1)
    return torch.nan_to_num(std, nan=0.0) > 0


def fill_round(
    first: Drawn,
    draw: Callable[[int], Drawn],
    weights: torch.Tensor | None,
    g: int,
    max_rounds: int,
) -> tuple[Drawn, dict[str, float]]:
    """DAPO dynamic sampling: keep ``first``'s varied groups, draw fresh prompts for the missing places up to
    ``max_rounds`` extra times, fill what is still missing with dropped groups. Returns the round (as many groups
    as ``first``, kept ones first) and its counts."""
    want = len(first.idx)
    kept: list[Drawn] = []
    dropped: list[Drawn] = []
    n_kept = n_dropped = rounds = 0
    batch = first
    while True:
        varied = varied_groups(batch.per_func, weights, g).tolist()
        keep = [k for k, v in enumerate(varied) if v][: want - n_kept]
        kept.append(batch.groups(keep, g))
        n_kept += len(keep)
        rest = [k for k, v in enumerate(varied) if not v]
        dropped.append(batch.groups(rest, g))
        n_dropped += len(rest)
        if n_kept == want or rounds == max_rounds:
            break
        rounds += 1
        batch = draw(want - n_kept)
    filled = want - n_kept
    parts = kept + ([Drawn.cat(dropped).groups(list(range(filled)), g)] if filled else [])
    stats = {
        "dynamic_sampling/extra_rounds": float(rounds),
        "dynamic_sampling/dropped_groups": float(n_dropped),
        "dynamic_sampling/filled_groups": float(filled),
        "dynamic_sampling/prompts_drawn": float(n_kept + n_dropped),
    }
    return Drawn.cat(parts), stats
