"""Regularizers that live across micro-batches (TRL 1.16 semantics): the entropy bonus's coefficient, adaptive or
fixed, and the TR-DPO reference-model update (``sync_ref_model``).

Entropy bonus (TRL ``entropy_coef``; adaptive control from Skywork-OR1, arXiv 2505.22312):

    H_mb   = sum m' * H / max(1, sum m')     (over the micro-batch; m' = mask, times the high-entropy mask
                                              when top_entropy_quantile < 1)
    loss  -= c_applied * H_mb / GA
    fixed    : c_applied = entropy_coef
    adaptive : c_applied = c if H_prev <= entropy_target else 0      (H_prev = inf before the first step)
               after each optimizer step, with H_win = the token-weighted mean entropy of the step's micro-batches:
               c = min(c + delta, c_max) if H_win <= entropy_target else max(c - delta, c_min);  H_prev = H_win

Reference update (TR-DPO, arXiv 2404.09656), every ``ref_model_sync_steps`` optimizer steps:

    ref = alpha * policy + (1 - alpha) * ref
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class EntropyControl:
    """The entropy bonus's coefficient, and its adaptive controller's state (part of a checkpoint)."""

    coef: float
    adaptive: bool = False
    target: float = 0.2
    delta: float = 0.005
    coef_min: float = 0.0
    coef_max: float = 1.0
    last_entropy: float = math.inf
    window_sum: float = 0.0
    window_tokens: float = 0.0

    @classmethod
    def from_config(cls, g) -> EntropyControl | None:
        """None when the bonus is off (entropy_coef == 0 and no adaptive control), as TRL's _entropy_bonus_enabled."""
        if g.entropy_coef == 0.0 and not g.use_adaptive_entropy:
            return None
        return cls(
            coef=g.entropy_coef,
            adaptive=g.use_adaptive_entropy,
            target=g.entropy_target,
            delta=g.entropy_coef_delta,
            coef_min=g.entropy_coef_min,
            coef_max=g.entropy_coef_max,
        )

    def applied(self) -> float:
        """The coefficient every micro-batch of the current optimizer step uses."""
        if self.adaptive:
            return self.coef if self.last_entropy <= self.target else 0.0
        return self.coef

    def observe(self, entropy_sum: float, tokens: float) -> None:
        """A micro-batch's entropy sum and token count over the tokens the bonus acts on."""
        self.window_sum += entropy_sum
        self.window_tokens += tokens

    def step(self) -> None:
        """At an optimizer step: move the adaptive coefficient for the next step, reset the window."""
        if self.adaptive:
            h = self.window_sum / max(self.window_tokens, 1.0)
            if h <= self.target:
                self.coef = min(self.coef + self.delta, self.coef_max)
            else:
                self.coef = max(self.coef - self.delta, self.coef_min)
            self.last_entropy = h
        self.window_sum = self.window_tokens = 0.0

    def state(self) -> dict:
        return {"coef": self.coef, "last_entropy": self.last_entropy if math.isfinite(self.last_entropy) else None}

    def load(self, state: dict) -> None:
        self.coef = state["coef"]
        self.last_entropy = math.inf if state["last_entropy"] is None else state["last_entropy"]


@torch.no_grad()
def mix_reference(model: torch.nn.Module, ref_model: torch.nn.Module, alpha: float) -> None:
    """ref = alpha * policy + (1 - alpha) * ref, parameter by parameter (TRL's SyncRefModelCallback)."""
    for ref, p in zip(ref_model.parameters(), model.parameters(), strict=True):
        ref.mul_(1.0 - alpha).add_(p.to(ref.device, ref.dtype), alpha=alpha)
