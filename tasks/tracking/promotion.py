"""A fair promotion: the candidate against the champion on the same held-out rows, measured in one run.

The continuous cycle warm-starts GRPO from the champion, so its eval stage scores both models greedily on the same
rows with the same settings ("before" is the champion, "after" the candidate). Per row the two answers pair up:

    b = rows the candidate answers correctly and the champion does not
    c = rows the champion answers correctly and the candidate does not

Rows both get right (or both wrong) say nothing about which is better. Under "no difference" each of the n = b + c
discordant rows is equally likely to fall either way, so b ~ Binomial(n, 1/2); the exact two-sided McNemar test
(the binomial sign test on the discordant pairs) gives

    p = min(1, 2 * sum_{i=0}^{min(b, c)} C(n, i) / 2^n)        (p = 1 when n = 0)

and the candidate is promoted when b > c and p < alpha (``tracking.promotion_alpha``, default 0.05): a gain larger
than the held-out set's noise. With no row lost (c = 0) that takes b >= 6 rows gained; with c = 5, b >= 15.
A tie in accuracy (b = c) never promotes. Rows whose answer both models change are what the test weighs, so two
models a few points apart on a small held-out set stay where they are.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from math import comb


@dataclass(frozen=True)
class PairedComparison:
    """Champion and candidate on the same held-out rows, and the decision."""

    rows: int
    accuracy_champion: float
    accuracy_candidate: float
    b: int  # candidate right, champion wrong
    c: int  # champion right, candidate wrong
    p_value: float
    alpha: float
    promote: bool
    reason: str

    def tags(self) -> dict[str, str]:
        """The comparison as MLflow tags (``promotion.<field>``), for the run and the registry version."""
        out = {f"promotion.{k}": str(v) for k, v in asdict(self).items() if k not in ("promote", "reason")}
        for k in ("accuracy_champion", "accuracy_candidate", "p_value"):
            out[f"promotion.{k}"] = f"{getattr(self, k):.6g}"
        out["promotion.decision"] = "promoted" if self.promote else "kept the champion"
        return out


def mcnemar_exact_p(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value for ``b`` and ``c`` discordant pairs (the module docstring's formula).
    Exact integer binomials; Python's int division rounds a ratio of big integers correctly."""
    if b < 0 or c < 0:
        raise ValueError(f"McNemar: discordant counts must be >= 0 (got b={b}, c={c})")
    n = b + c
    if n == 0:
        return 1.0
    tail = sum(comb(n, i) for i in range(min(b, c) + 1))
    return min(1.0, 2 * tail / 2**n)


def paired_promotion(
    champion_correct: Sequence[bool | None], candidate_correct: Sequence[bool | None], alpha: float
) -> PairedComparison:
    """Promote the candidate over the champion? ``*_correct``: per held-out row (the same rows, in the same order),
    whether that model's greedy answer was correct, None where its reward did not score it (a code sandbox that
    failed to start): such a row is left out for both models, not counted as a loss of the one it failed for.
    Promote when b > c and the exact McNemar p < ``alpha``."""
    if len(champion_correct) != len(candidate_correct):
        raise ValueError(
            f"paired comparison: {len(champion_correct)} champion rows vs {len(candidate_correct)} candidate rows; "
            "both models must be scored on the same held-out rows"
        )
    pairs = [(old, new) for old, new in zip(champion_correct, candidate_correct) if old is not None and new is not None]
    champion_correct, candidate_correct = [old for old, _ in pairs], [new for _, new in pairs]
    if not champion_correct:
        raise ValueError("paired comparison: no held-out rows (scored for both models)")
    if not 0 < alpha <= 1:
        raise ValueError(f"tracking.promotion_alpha: must be in (0, 1] (got {alpha})")
    rows = len(champion_correct)
    b = sum(1 for old, new in zip(champion_correct, candidate_correct) if new and not old)
    c = sum(1 for old, new in zip(champion_correct, candidate_correct) if old and not new)
    p = mcnemar_exact_p(b, c)
    acc_old, acc_new = sum(map(bool, champion_correct)) / rows, sum(map(bool, candidate_correct)) / rows
    promote = b > c and p < alpha
    figures = (
        f"held-out {acc_new:.1%} vs the champion's {acc_old:.1%} on the same {rows} rows: "
        f"{b} rows gained, {c} lost, McNemar p={p:.3g}"
    )
    if promote:
        reason = f"{figures} < alpha {alpha:g}: promoted"
    elif b <= c:
        reason = f"{figures}: no gain, the champion is kept"
    else:
        reason = f"{figures} >= alpha {alpha:g}: within the held-out noise, the champion is kept"
    return PairedComparison(rows, acc_old, acc_new, b, c, p, alpha, promote, reason)
