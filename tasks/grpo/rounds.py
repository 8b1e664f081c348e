"""What a GRPO run is in the middle of: the prompt sampler's position and the generation round being replayed.

Both are part of a checkpoint (tasks/grpo/trainer.py ``save_checkpoint``): the sampler as JSON, the round as
plain tensors plus JSON (:meth:`Round.to_state`), so a checkpoint loads with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from grpoflow.tasks.grpo.batch import RoundTensors


@dataclass
class PromptSampler:
    """Shuffled passes over the dataset; its position is part of a checkpoint."""

    n_rows: int
    seed: int
    shuffle: bool = True
    epoch: int = 0
    cursor: int = 0
    _order: list[int] = field(default_factory=list)

    def _fill(self) -> None:
        self._order = list(range(self.n_rows))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(self._order)

    def take(self, k: int) -> list[int]:
        out = []
        while len(out) < k:
            if not self._order:
                self._fill()
            if self.cursor >= self.n_rows:
                self.epoch, self.cursor = self.epoch + 1, 0
                self._fill()
            out.append(self._order[self.cursor])
            self.cursor += 1
        return out

    def state(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load(self, state: dict) -> None:
        self.epoch, self.cursor = state["epoch"], state["cursor"]
        self._fill()


@dataclass
class Round:
    """One scored generation round and how far its micro-batches have been consumed."""

    batch: RoundTensors
    advantages: torch.Tensor  # [B]
    stats: dict
    samples: list[dict]
    old_logp: torch.Tensor | None
    ref_logp: torch.Tensor | None
    is_ratio: torch.Tensor | None  # sampler importance-sampling correction, [B, T] or [B, 1]
    n_tokens: float  # active completion tokens of the round (dapo normalizer)
    order: torch.Tensor  # the order its rows are trained in (shuffled, as TRL)
    position: int = 0  # micro-batches done, over all num_iterations
    # sampler-correction metric parts of the micro-batches that took their correction from the loss pass
    # (trainer.micro_loss); not checkpointed: such rounds end inside one optimizer step
    correction: list = field(default_factory=list)
    # not checkpointed (remade for a resumed round): each row's real tokens on the CPU (flops.py) and each
    # micro-step position's plan (micro_plan.py: prompt groups, head positions, rows without a gradient)
    seq_lens: torch.Tensor | None = None
    plans: list | None = None

    _TENSORS = ("advantages", "old_logp", "ref_logp", "is_ratio", "order")

    def to_state(self) -> tuple[dict[str, torch.Tensor], dict]:
        """(tensors, JSON) of this round for a checkpoint: plain tensors and JSON, no pickled objects, so the
        checkpoint loads with torch.load(weights_only=True)."""
        tensors = {f"batch.{f}": getattr(self.batch, f) for f in RoundTensors.__dataclass_fields__}
        tensors.update({k: getattr(self, k) for k in self._TENSORS if getattr(self, k) is not None})
        meta = {"stats": self.stats, "samples": self.samples, "n_tokens": self.n_tokens, "position": self.position}
        return tensors, meta

    @classmethod
    def from_state(cls, tensors: dict[str, torch.Tensor], meta: dict, device: torch.device) -> Round:
        """The round of ``to_state``, its tensors on ``device`` (the row order stays on the CPU: it indexes)."""
        batch = RoundTensors(**{f: tensors[f"batch.{f}"] for f in RoundTensors.__dataclass_fields__}).to(device)
        moved = {k: None if tensors.get(k) is None else tensors[k].to(device) for k in cls._TENSORS if k != "order"}
        return cls(batch=batch, **moved, order=tensors["order"], **meta)
