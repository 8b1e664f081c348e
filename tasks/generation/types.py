"""What every generation backend takes and returns, and the helpers they share.

The interface of a backend (:class:`grpoflow.tasks.generation.transformers_loop.TransformersGenerator`,
:class:`grpoflow.tasks.generation.vllm_engine.VLLMGenerator`):

    generate(prompts: list[list[int]], n, params, row_seeds=None) -> Generation
        completions are prompt-major: prompt 0's n samples, then prompt 1's, ...
    sync_weights(model)   push trained weights into the engine (no-op when it is the model)
    separate_engine       True when another implementation samples (vLLM): the trainer corrects for the
                          drift (importance sampling) and leaves FSDP2's gathering to the engine's sync
    weights_key           None, or a callable the trainer sets (distributed GRPO: its optimizer step) that
                          decides when the engine syncs, alike on every rank

:class:`Generator` states it for type checkers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

import torch


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float = 1.0
    greedy: bool = False

    @classmethod
    def from_grpo(cls, g) -> SamplingParams:
        return cls(
            max_new_tokens=g.max_completion_length,
            temperature=g.temperature,
            top_p=g.top_p,
            top_k=g.top_k,
            min_p=g.min_p,
            repetition_penalty=g.repetition_penalty,
        )


@dataclass
class Generation:
    completion_ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)
    finish_reasons: list[str] = field(default_factory=list)

    def extend(self, other: Generation) -> None:
        self.completion_ids += other.completion_ids
        self.logprobs += other.logprobs
        self.finish_reasons += other.finish_reasons


def left_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            ids[i, width - len(s) :] = torch.tensor(s, dtype=torch.long)
            mask[i, width - len(s) :] = 1
    return ids, mask


@contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """torch.set_num_threads(n) inside, the previous count after (None: leave it)."""
    before = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if n:
            torch.set_num_threads(before)


class Generator(Protocol):
    """A generation backend, as the trainer uses it (see the module docstring)."""

    name: str
    separate_engine: bool
    weights_key: Callable[[], int] | None

    def generate(
        self, prompts: list[list[int]], n: int, params: SamplingParams, row_seeds: list[int] | None = None
    ) -> Generation: ...

    def sync_weights(self, model) -> None: ...
