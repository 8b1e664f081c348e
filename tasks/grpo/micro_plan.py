"""What each micro-step's log-prob pass computes, decided on the host once per round, so no forward syncs to find it.

- **Prompts:** the rows that share a prompt (batch.host_prompt_groups), whose prompt forward runs once.
- **Positions:** the head computes the real tokens only (batch.head_positions); padding and masked-out rows cost
  nothing.
- **Rows without a gradient:** a row whose log-probs the loss gives no gradient (loss.rows_with_gradient: advantage
  0, as in a group whose rewards were all equal, with no KL or entropy term) needs only its values, for the metrics
  (entropy, sampler correction). Its head runs without a backward (2NVD instead of 4NVD). On one process and under
  DDP (``split``) such rows also go through the model in a forward of their own under no_grad: no activations
  kept, no backward through the model for them. A backward costs about twice a forward, so that is about 2/3 of
  those rows' training compute. Under DDP the rows apart go through its inner module (distributed.collective_free),
  which runs no collective, and every micro-step keeps its one forward and backward through the wrapper, whatever
  its rows' advantages (``grad_forward_each_step``): every rank must make the same collective calls. FSDP2 keeps
  one forward per micro-step: each forward gathers the layers' shards.

The gradients are the one-forward computation's: the rows left out of the backward are those whose gradient is 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grpoflow.tasks.config import Batching
from grpoflow.tasks.grpo.batch import (
    HeadRows,
    PromptGroups,
    RoundTensors,
    head_positions,
    host_prompt_groups,
    prompt_keys,
    root_logprobs,
)
from grpoflow.tasks.grpo.schedule import micro_batch_rows


@dataclass(frozen=True)
class Part:
    """Rows of a micro-batch that run through the model together: their positions in it, prompt groups and head."""

    rows: torch.Tensor  # [b'] indices into the micro-batch, on the model's device
    groups: PromptGroups | None
    head_rows: HeadRows


@dataclass(frozen=True)
class MicroPlan:
    """One micro-step's pass: ``whole`` (one forward of every row) or, split, ``train`` (the rows with a gradient,
    None when there is none) with autograd and ``free`` (the others) under no_grad."""

    whole: Part | None
    train: Part | None = None
    free: Part | None = None

    @property
    def split(self) -> bool:
        return self.whole is None


def micro_plan(
    keys: list[int],
    mask: torch.Tensor,
    trains: torch.Tensor,
    split: bool,
    device: torch.device | str,
    grad_forward_each_step: bool = False,
) -> MicroPlan:
    """The plan of a micro-batch from host values: its rows' prompt keys (batch.prompt_keys), completion mask [b, C]
    and ``trains`` [b] (loss.rows_with_gradient) on the CPU. ``split``: rows without a gradient get a forward of
    their own; nothing is split when every row trains, nor, with ``grad_forward_each_step`` (DDP), when none does:
    the micro-step then keeps its one forward with autograd (its backward gives every parameter a zero gradient)."""
    rows = torch.arange(mask.shape[0])
    if not split or bool(trains.all()) or (grad_forward_each_step and not bool(trains.any())):
        return MicroPlan(_part(rows, keys, mask, trains, device))
    train, free = rows[trains], rows[~trains]
    return MicroPlan(None, _part(train, keys, mask, trains, device), _part(free, keys, mask, trains, device))


def round_plans(
    b: Batching,
    order: torch.Tensor,
    batch: RoundTensors,
    trains: torch.Tensor,
    split: bool,
    device,
    grad_forward_each_step: bool = False,
) -> list[MicroPlan]:
    """:func:`micro_plan` of each micro-step position of a round (schedule.micro_batch_rows of its row ``order``),
    from the round's ``batch`` and ``trains`` [B] (loss.rows_with_gradient) on the CPU."""
    keys = prompt_keys(batch.prompt_ids, batch.prompt_mask)
    plans = []
    for position in range(b.micro_steps_per_round):
        part = micro_batch_rows(b, position, order)[1]
        keys_p = [keys[i] for i in part.tolist()]
        mask = batch.completion_mask[part]
        plans.append(micro_plan(keys_p, mask, trains[part], split, device, grad_forward_each_step))
    return plans


def _part(rows: torch.Tensor, keys: list[int], mask: torch.Tensor, trains: torch.Tensor, device) -> Part | None:
    """The Part of micro-batch ``rows`` (None for none): their prompt groups and head positions."""
    if rows.numel() == 0:
        return None
    ids = rows.tolist()
    return Part(rows.to(device, non_blocking=True), host_prompt_groups([keys[i] for i in ids], device),
                head_positions(mask[rows], trains[rows], device))  # fmt: skip


def planned_logprobs(
    root: torch.nn.Module,
    mb: RoundTensors,
    plan: MicroPlan,
    temperature: float,
    *,
    impl: str = "auto",
    entropy_grad: bool = False,
    chunk_rows: int = 0,
    free_root: torch.nn.Module | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropy [b, C] of micro-batch ``mb`` through ``root`` (batch.root_logprobs), as ``plan`` says:
    one forward of every row, or the rows with a gradient with autograd and the others under no_grad through
    ``free_root`` (DDP's inner module: no collective; ``root`` by default), put back in the micro-batch's order.
    Positions the plan's head leaves out hold 0. With no row that trains the result has no gradient: the caller
    skips the backward (its gradient would be 0)."""
    kw = {"compute_entropy": True, "impl": impl, "entropy_grad": entropy_grad, "chunk_rows": chunk_rows}
    if not plan.split:
        return root_logprobs(root, mb, temperature, groups=plan.whole.groups, head_rows=plan.whole.head_rows, **kw)
    logp = torch.zeros(mb.completion_ids.shape, dtype=torch.float32, device=mb.completion_ids.device)
    entropy = torch.zeros_like(logp)
    grad_on = torch.is_grad_enabled()
    for part, grad, module in ((plan.train, grad_on, root), (plan.free, False, free_root or root)):
        if part is None:
            continue
        with torch.set_grad_enabled(grad):
            sub = mb.select(part.rows)
            lp, ent = root_logprobs(module, sub, temperature, groups=part.groups, head_rows=part.head_rows, **kw)
        logp, entropy = logp.index_copy(0, part.rows, lp), entropy.index_copy(0, part.rows, ent)
    return logp, entropy
