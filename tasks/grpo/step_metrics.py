"""The micro-step metrics of an optimizer step, kept on the device until the step ends.

Each micro-step adds one row of float32 statistics to a list on the device (:meth:`StepMetrics.add`: no
device-to-host sync); at the optimizer step :meth:`StepMetrics.flush` reduces every rank's rows with one collective
(an all-gather of [M, K]) and reads them back with one ``.tolist()``, then appends each micro-step's values to the
trainer's metric window exactly as the per-micro-step code did (docs in tasks/grpo/distributed.py):

    loss                      the micro-batch's loss times GA, averaged over the ranks
    entropy, clip_ratio/*_mean, kl    masked means over every rank's real tokens
    clip_ratio/low_min        the lowest per-sequence low-clip ratio over all sequences (a row of no tokens: 1)
    clip_ratio/high_max       the highest per-sequence high-clip ratio (a row of no tokens: 0)
    sampling/sampling_logp_difference/{mean,max}   on the round's first replay (``sampled``), over every rank's
                              real tokens that the sampler scored; left out when there is none

and the entropy bonus's (entropy sum, tokens) per micro-step, summed over the ranks, for its adaptive coefficient.
At world size 1 the same numbers as the single-process expressions (up to float rounding of the division).
"""

from __future__ import annotations

import torch

from grpoflow.tasks.launch.dist import Comm

# columns of a micro-step's row: summed over the ranks, then the per-rank minimum and maxima
SUMS = ("loss", "entropy", "low", "high", "region", "kl", "diff", "tokens", "diff_tokens", "bonus_sum", "bonus_tokens")
MIN, MAXES = ("low_min",), ("high_max", "diff_max")
COLUMNS = SUMS + MIN + MAXES
COL = {name: k for k, name in enumerate(COLUMNS)}


class StepMetrics:
    """Rows of micro-step statistics on the device, since the last :meth:`flush`."""

    def __init__(self) -> None:
        self.rows: list[torch.Tensor] = []
        self.flags: list[tuple[bool, bool, bool]] = []  # per row: (has kl, sampled, has the entropy bonus)

    def add(
        self,
        loss: torch.Tensor,
        extras: dict[str, torch.Tensor],
        mask: torch.Tensor,
        entropy: torch.Tensor,
        base_logp: torch.Tensor,
        sampler_logp: torch.Tensor,
        sampled: bool,
        gradient_accumulation_steps: int,
    ) -> None:
        """One micro-step's row, computed on the device with no sync."""
        m = mask.to(torch.float32)
        per_seq = lambda x: (x.float() * m).sum(-1) / m.sum(-1)  # noqa: E731  (NaN for rows of no tokens)
        masked_sum = lambda x: (x.float() * m).sum()  # noqa: E731
        zero = m.new_zeros(())
        real = mask.bool() & ~torch.isnan(sampler_logp)
        diff = torch.where(real, (base_logp - sampler_logp).abs().float(), 0.0) if sampled else None
        bonus = "entropy_sum" in extras
        row = {
            "loss": loss.detach().float() * gradient_accumulation_steps,
            "entropy": masked_sum(entropy.detach()),
            **{name: masked_sum(extras[f"is_{name}_clipped"]) for name in ("low", "high", "region")},
            "kl": masked_sum(extras["kl"]) if "kl" in extras else zero,
            "diff": diff.sum() if sampled else zero,
            "tokens": m.sum(),
            "diff_tokens": real.sum().float() if sampled else zero,
            "bonus_sum": extras["entropy_sum"].float() if bonus else zero,
            "bonus_tokens": extras["entropy_tokens"].float() if bonus else zero,
            "low_min": torch.nan_to_num(per_seq(extras["is_low_clipped"]), nan=1.0).min(),
            "high_max": torch.nan_to_num(per_seq(extras["is_high_clipped"]), nan=0.0).max(),
            "diff_max": diff.max() if sampled else zero,  # |difference| >= 0: the 0 of masked tokens never wins
        }
        self.rows.append(torch.stack([row[name].reshape(()) for name in COLUMNS]))
        self.flags.append(("kl" in extras, sampled, bonus))

    def flush(self, comm: Comm, window: dict[str, list[float]]) -> list[tuple[float, float]]:
        """Append the micro-steps' metrics since the last flush to ``window`` (one collective, one host read, the
        same on every rank) and return each micro-step's entropy-bonus (sum, tokens) over the ranks (empty without
        the bonus). Nothing to do without rows."""
        if not self.rows:
            return []
        rows = torch.stack(self.rows)  # [M, K]
        if comm.world > 1:
            every = comm.all_gather(rows[None])  # [W, M, K]
            sums = every[..., : len(SUMS)].sum(0)
            low = every[..., COL["low_min"]].amin(0)[..., None]
            high = every[..., COL["high_max"] :].amax(0)
            rows = torch.cat([sums, low, high], dim=1)
        values = rows.tolist()
        bonus = []
        for v, (has_kl, sampled, has_bonus) in zip(values, self.flags):
            tokens = max(v[COL["tokens"]], 1.0)
            window["loss"].append(v[COL["loss"]] / comm.world)
            window["entropy"].append(v[COL["entropy"]] / tokens)
            for name in ("low", "high", "region"):
                window[f"clip_ratio/{name}_mean"].append(v[COL[name]] / tokens)
            window["clip_ratio/low_min"].append(v[COL["low_min"]])
            window["clip_ratio/high_max"].append(v[COL["high_max"]])
            if has_kl:
                window["kl"].append(v[COL["kl"]] / tokens)
            if sampled and v[COL["diff_tokens"]] > 0:
                window["sampling/sampling_logp_difference/mean"].append(v[COL["diff"]] / v[COL["diff_tokens"]])
                window["sampling/sampling_logp_difference/max"].append(v[COL["diff_max"]])
            if has_bonus:
                bonus.append((v[COL["bonus_sum"]], v[COL["bonus_tokens"]]))
        self.rows, self.flags = [], []
        return bonus
