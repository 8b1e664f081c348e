"""transformers' logits processors for a :class:`SamplingParams`, shared by the eager decoding loop
(transformers_loop.py) and the compiled step (static_decode.py)."""

from __future__ import annotations

from grpoflow.tasks.generation.types import SamplingParams


def logits_warpers(p: SamplingParams):
    """transformers' own logits processors for ``p``, in generate's order (repetition penalty, temperature,
    top-k, top-p, min-p); an empty list for plain sampling or greedy without a penalty."""
    from transformers import (
        LogitsProcessorList,
        MinPLogitsWarper,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    procs = LogitsProcessorList()
    if p.repetition_penalty != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(p.repetition_penalty))
    if not p.greedy:
        if p.temperature != 1.0:
            procs.append(TemperatureLogitsWarper(p.temperature))
        if p.top_k:
            procs.append(TopKLogitsWarper(p.top_k))
        if p.top_p < 1.0:
            procs.append(TopPLogitsWarper(p.top_p))
        if p.min_p:
            procs.append(MinPLogitsWarper(p.min_p))
    return procs
