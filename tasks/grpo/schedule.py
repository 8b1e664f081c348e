"""Where each completion of a generation round is trained, and when the optimizer steps.

TRL's buffering (GRPOTrainer._prepare_inputs), per process:

    a round holds generation_batch_size = per_device_train_batch_size * steps_per_generation
    completions, unique_prompts = generation_batch_size / num_generations prompts, prompt-major
    (row r belongs to the round's prompt r // num_generations);
    the rows are shuffled once per round, then split into steps_per_generation micro-batches of
    per_device_train_batch_size; the round is replayed num_iterations times, so it covers
    steps_per_generation * num_iterations micro-steps;
    the optimizer steps after every gradient_accumulation_steps micro-steps, counted over the
    whole run (a window may span two rounds).

:func:`plan` lays this out as a table (the seed's "GRPO batch examples"); the trainer takes its
rows from :func:`micro_batch_rows` and its optimizer steps from :func:`is_optimizer_step`, so the
table and the training loop cannot disagree.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grpoflow.tasks.config import Batching


def micro_batch_rows(b: Batching, position: int, order: torch.Tensor) -> tuple[int, torch.Tensor]:
    """(iteration, rows) of the round's ``position``-th micro-step; ``order`` is the round's row order.

    iteration, k = divmod(position, steps_per_generation); rows = order[k * pdb : (k + 1) * pdb]
    """
    iteration, k = divmod(position, b.steps_per_generation)
    return iteration, order[k * b.micro_batch_size : (k + 1) * b.micro_batch_size]


def is_optimizer_step(micro_steps_done: int, b: Batching) -> bool:
    """True after the micro-step that completes a gradient-accumulation window (1-based count)."""
    return micro_steps_done % b.gradient_accumulation_steps == 0


@dataclass(frozen=True)
class PlannedStep:
    round: int  # generation round (the seed's "generation cycle")
    step: int  # micro-step within the round, 0 .. steps_per_generation * num_iterations - 1
    iteration: int  # which replay of the round (num_iterations)
    prompts: tuple[int, ...]  # global prompt index of each completion: round * unique_prompts + row // G
    new_round: bool  # this micro-step starts a generation round
    optimizer_step: bool  # the optimizer steps after this micro-step


def plan(b: Batching, num_generations: int, rounds: int, orders: list[torch.Tensor] | None = None) -> list[PlannedStep]:
    """The micro-steps of ``rounds`` generation rounds; ``orders[i]`` is round i's row order (identity if None)."""
    out = []
    done = 0
    per_round = b.steps_per_generation * b.num_iterations
    for rnd in range(rounds):
        order = orders[rnd] if orders is not None else torch.arange(b.generation_batch_size)
        for position in range(per_round):
            iteration, rows = micro_batch_rows(b, position, order)
            done += 1
            prompts = tuple(rnd * b.unique_prompts + int(r) // num_generations for r in rows)
            out.append(PlannedStep(rnd, position, iteration, prompts, position == 0, is_optimizer_step(done, b)))
    return out
