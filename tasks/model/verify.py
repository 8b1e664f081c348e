"""Checking a merged export against the model it was made from: teacher-forced per-token log-probs.

Greedy decoding is no test of a 16-bit export: one rounding that flips a near-tie changes every later token, and
on a real model that happens within a few dozen tokens. The check instead feeds the same token sequences (each
verify prompt followed by the trained model's own greedy completion) through both models and compares the
log-probability each gives to every completion token, against a tolerance derived from the dtypes involved
(logprob_tolerance). How far the merged model's own greedy path would follow the trained one is reported as a
figure (greedy_agreement), not checked.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# torch.finfo(dtype).eps: the gap between 1.0 and the next representable number
EPS = {"float32": 2.0**-23, "bfloat16": 2.0**-7, "float16": 2.0**-10}
TOLERANCE_FACTOR = 64
TOLERANCE_FLOOR = 1e-3


def logprob_tolerance(*dtypes: str) -> float:
    """Largest per-token log-prob gap accepted between two models that differ only by rounding to ``dtypes``.

        tol = max(FLOOR, FACTOR * max_d eps(d)),   FACTOR = 64, FLOOR = 1e-3

    eps(d) is the dtype's machine epsilon (float32 2^-23, bfloat16 2^-7, float16 2^-10). Rounding a weight or an
    activation to d changes it by at most eps/2 relative. A token's log-prob log p_t = z_t - logsumexp(z) moves by
    at most 2 max_j |dz_j| when the logits z move by dz, and dz ~ |z| * eps/2 * g, with logits of real models up
    to |z| ~ 30 and g a small growth factor for roundings compounding through the layers: 2 * 30 * g/2 ~ 64 for
    g ~ 2. The coarsest dtype of the two models governs (a bfloat16 trained model compared with a float16 export
    differs by bfloat16 rounding). float32 gets the floor: both models then compute in float32 and differ only in
    the order of their sums (W x + B (A x) against (W + B A) x), logit errors of order sqrt(D) eps |z|, at
    D = 4096 and |z| = 30 about 2.3e-4, so 2 * 2.3e-4 on a log-prob, with a factor 2 of margin: 1e-3.
    Results: float32 1e-3, float16 0.0625, bfloat16 0.5 nats. A corrupted merge (a missing or doubled update, a
    wrong scale, a mis-mapped tensor) moves log-probs by whole nats.
    """
    unknown = [d for d in dtypes if d not in EPS]
    if not dtypes or unknown:
        raise ValueError(f"logprob_tolerance: dtypes must be among {sorted(EPS)}, got {list(dtypes)}")
    return max(TOLERANCE_FLOOR, TOLERANCE_FACTOR * max(EPS[d] for d in dtypes))


def agreement_until_divergence(expected: list[int], chosen: list[int]) -> float:
    """Share of ``expected`` that ``chosen`` reproduces before the first differing token: k / len(expected), where
    k is the first index with chosen[k] != expected[k] (len(expected) when none differ); 1.0 for an empty one."""
    if not expected:
        return 1.0
    k = next((i for i, (a, b) in enumerate(zip(expected, chosen)) if a != b), min(len(expected), len(chosen)))
    return k / len(expected)


@torch.no_grad()
def teacher_forced(model, prompt: list[int], completion: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(completion[t] | prompt, completion[:t]) for each t, the model's argmax at each of those positions),
    both [len(completion)], from one forward of prompt + completion (no padding: one sequence at a time). The
    log-softmax runs in float32 on logits in the model's own dtype."""
    ids = torch.tensor([prompt + completion], device=model.device)
    logits = model(input_ids=ids, use_cache=False).logits[0, len(prompt) - 1 : -1].float()
    target = torch.tensor(completion, device=logits.device)
    logprobs = torch.log_softmax(logits, dim=-1).gather(-1, target[:, None])[:, 0]
    return logprobs.cpu(), logits.argmax(-1).cpu()


@dataclass
class Verification:
    """The merged-against-trained comparison over the verify batch."""

    tokens: int  # completion tokens compared
    max_gap: float  # max_t |log p_merged - log p_trained|
    mean_gap: float  # mean of the same over all tokens
    worst: tuple[int, int]  # (prompt index, completion position) of max_gap
    greedy_agreement: float  # mean over prompts of agreement_until_divergence(trained completion, merged argmax)


def compare_logprobs(
    reference: list[torch.Tensor],
    other: list[torch.Tensor],
    other_argmax: list[torch.Tensor],
    completions: list[list[int]],
) -> Verification:
    """Gap statistics between per-prompt log-prob vectors (``reference``: the trained model's; ``other``: the
    merged model's) and the merged model's greedy agreement with the trained completions. A log-prob that is not
    finite on either side (a merged float16 model whose activations overflow, a NaN weight) is an infinite gap:
    ``NaN > max_gap`` is False, so before this a NaN merged model verified with max_gap 0."""
    gaps = [torch.nan_to_num((a - b).abs(), nan=math.inf, posinf=math.inf) for a, b in zip(reference, other)]
    gaps = [torch.where(a.isfinite() & b.isfinite(), g, math.inf) for a, b, g in zip(reference, other, gaps)]
    flat = torch.cat(gaps) if gaps else torch.zeros(0)
    worst, max_gap = (0, 0), 0.0
    for i, g in enumerate(gaps):
        if g.numel() and float(g.max()) > max_gap:
            max_gap, worst = float(g.max()), (i, int(g.argmax()))
    agreement = [agreement_until_divergence(c, a.tolist()) for c, a in zip(completions, other_argmax)]
    return Verification(
        tokens=int(flat.numel()),
        max_gap=max_gap,
        mean_gap=float(flat.mean()) if flat.numel() else 0.0,
        worst=worst,
        greedy_agreement=sum(agreement) / len(agreement) if agreement else 1.0,
    )
