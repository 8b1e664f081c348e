"""Model FLOPs of the GRPO training half, and the achieved TFLOP/s a step logs as ``perf/train_tflops``.

Model FLOPs count the arithmetic the model's definition needs (matmuls and attention), not what an
implementation happens to execute: padding, recomputation and masked-out attention are not counted, so the
figure compares trainers and machines fairly (divide by a measured matmul peak for the MFU:
benchmarks/bench_matmul_peak.py). A multiply-add is 2 FLOPs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ModelShape:
    """What the FLOPs formulas need of a decoder: matmul weights by kind, layers and attention width."""

    frozen: int  # weights of nn.Linear layers (the LM head included) that get no gradient
    trainable: int  # weights of nn.Linear layers that do (LoRA A and B; every layer in full training)
    layers: int
    attn_width: int  # heads x head_dim of the queries

    @property
    def matmul_params(self) -> int:
        return self.frozen + self.trainable


def model_shape(model: torch.nn.Module) -> ModelShape:
    """The :class:`ModelShape` of a transformers causal LM (peft-wrapped or not).

    Every ``nn.Linear``'s weight is counted once (a tied LM head is an ``nn.Linear`` holding the embedding's
    matrix, so it counts; the embedding lookup itself is no matmul and does not), as trainable when it
    requires a gradient. bitsandbytes' 4-bit layers store two weights per byte, so their count is doubled."""
    frozen = trainable = 0
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            n = m.weight.numel() * (2 if type(m).__name__ == "Linear4bit" else 1)
            if m.weight.requires_grad:
                trainable += n
            else:
                frozen += n
    cfg = getattr(model, "config", None)
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    layers = getattr(text, "num_hidden_layers", 0) or 0
    heads = getattr(text, "num_attention_heads", 0) or 0
    head_dim = getattr(text, "head_dim", None) or (getattr(text, "hidden_size", 0) // max(heads, 1))
    return ModelShape(frozen, trainable, layers, heads * head_dim)


def forward_flops(shape: ModelShape, seq_lens: list[int]) -> float:
    """Forward FLOPs of sequences of ``seq_lens`` tokens (each attending causally to itself):

        F_fwd = 2 * N * T  +  sum_s 2 * n_layers * d_attn * L_s * (L_s + 1)

    with N the matmul weights (:attr:`ModelShape.matmul_params`), T = sum_s L_s the tokens. The attention term:
    token i of a sequence attends to i keys, each costing 2 d_attn for Q K^T and 2 d_attn for A V, per layer;
    summed over i = 1..L that is 4 d_attn L (L + 1) / 2."""
    tokens = sum(seq_lens)
    attn = sum(2 * shape.layers * shape.attn_width * n * (n + 1) for n in seq_lens)
    return 2.0 * shape.matmul_params * tokens + float(attn)


def train_flops(shape: ModelShape, seq_lens: list[int]) -> float:
    """Forward + backward FLOPs of a loss pass over ``seq_lens``:

        F = 2 N T  (forward)  +  2 N T  (gradients of the activations, through every weight)
              +  2 N_trainable T  (gradients of the trainable weights)  +  3 x the forward attention term

    i.e. 6 N T for full fine-tuning and 4 N_base T + 6 N_lora T for LoRA on a frozen base; attention has no
    weights and its backward (gradients of Q, K and V) costs twice its forward."""
    tokens = sum(seq_lens)
    attn = forward_flops(shape, seq_lens) - 2.0 * shape.matmul_params * tokens
    return 4.0 * shape.matmul_params * tokens + 2.0 * shape.trainable * tokens + 3.0 * attn


def tflops(flops: float, seconds: float) -> float:
    """Achieved TFLOP/s: flops / seconds / 1e12 (0 for a non-positive time)."""
    return flops / seconds / 1e12 if seconds > 0 else 0.0


class StepFlops:
    """The training half's model FLOPs and seconds between two optimizer steps, for ``perf/*`` metrics.

    The trainer reports each round it builds (:meth:`add_round`: its generation seconds, which are not training,
    and the forward passes of old/reference log-probs over the round) and each loss micro-batch
    (:meth:`add_micro`: forward + backward); :meth:`take` turns what accumulated since the last call into
    ``perf/train_flops`` (model FLOPs), ``perf/train_seconds`` (the step's time less generation) and
    ``perf/train_tflops``, and starts over."""

    def __init__(self, model: torch.nn.Module):
        self.shape = model_shape(model)
        self.flops = 0.0
        self.gen_seconds = 0.0
        self.pending: list[torch.Tensor] = []  # the loss micro-batches' row lengths since the last take

    def add_round(self, r, seq_lens: list[int]) -> None:
        """Round ``r``'s generation seconds and its old/reference log-prob passes over rows of ``seq_lens`` real
        tokens (prompt + completion)."""
        passes = (r.old_logp is not None) + (r.ref_logp is not None)
        self.flops += passes * forward_flops(self.shape, seq_lens)
        self.gen_seconds += r.stats.get("generation_time", 0.0)

    def add_micro(self, seq_lens: torch.Tensor) -> None:
        """A loss micro-batch over rows of ``seq_lens`` real tokens (a CPU tensor: the round's, read once per round,
        indexed by its rows), counted at :meth:`take` (one read per step; the FLOPs add up row by row)."""
        self.pending.append(seq_lens)

    def take(self, step_seconds: float) -> dict[str, float]:
        if self.pending:
            self.flops += train_flops(self.shape, torch.cat(self.pending).tolist())
            self.pending = []
        seconds = max(step_seconds - self.gen_seconds, 0.0)
        out = {
            "perf/train_flops": self.flops,
            "perf/train_seconds": seconds,
            "perf/train_tflops": tflops(self.flops, seconds),
        }
        self.flops = self.gen_seconds = 0.0
        return out
