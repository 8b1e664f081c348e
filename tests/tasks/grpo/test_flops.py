"""The model-FLOPs formulas (tasks/grpo/flops.py) against torch's own FLOP counter on a real tiny model, and the
per-step perf/* metrics the GRPO trainer logs from them."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from grpoflow.tasks.config import GRPOConfig
from grpoflow.tasks.grpo.flops import ModelShape, forward_flops, model_shape, tflops, train_flops
from tests.tasks.grpo.test_trainer import make, make_trainer

L = 10


def counted(fn) -> int:
    """FLOPs torch's FlopCounterMode records for ``fn()`` (its matmuls: on the CPU it has no formula for SDPA)."""
    with FlopCounterMode(display=False) as fc:
        fn()
    return fc.get_total_flops()


def ids():
    return torch.randint(3, 200, (1, L), generator=torch.Generator().manual_seed(0))


def test_model_shape_splits_frozen_and_lora_weights():
    _, full = make(lora=False)
    _, lora = make(lora=True)
    n_linear = sum(m.weight.numel() for m in full.modules() if isinstance(m, torch.nn.Linear))
    s_full, s_lora = model_shape(full), model_shape(lora)
    assert s_full.matmul_params == n_linear and s_full.layers == 2 and s_full.attn_width == 32
    assert s_lora.frozen == n_linear  # the base is frozen; LoRA A and B are the trainable matmuls
    assert s_lora.trainable == sum(p.numel() for n, p in lora.named_parameters() if "lora_" in n) > 0


def test_forward_matmul_term_is_what_torch_counts():
    _, model = make(lora=False)
    shape = model_shape(model)
    attn = forward_flops(shape, [L]) - 2 * shape.matmul_params * L
    assert attn == 2 * shape.layers * shape.attn_width * L * (L + 1)
    assert counted(lambda: model(input_ids=ids())) == 2 * shape.matmul_params * L


def test_attention_term_is_the_causal_half_of_eager_attention():
    """Eager attention multiplies the full L x L score matrix (masked afterwards); the model FLOPs count the
    causal part only: sum_i i = L (L + 1) / 2 of the L^2 query-key pairs."""
    _, model = make(lora=False)
    model.set_attn_implementation("eager")
    shape = model_shape(model)
    eager_attn = counted(lambda: model(input_ids=ids())) - 2 * shape.matmul_params * L
    ours = forward_flops(shape, [L]) - 2 * shape.matmul_params * L
    assert ours == pytest.approx(eager_attn * (L + 1) / (2 * L))


@pytest.mark.parametrize("lora", [False, True])
def test_forward_backward_is_6n_full_and_4n_plus_6n_lora(lora):
    _, model = make(lora=lora)
    if not lora:
        model.requires_grad_(True)
    # the embedding trainable too, so that the first layer's input gradients are computed as the formula assumes
    model.get_input_embeddings().weight.requires_grad_(True)
    shape = model_shape(model)
    expected = (6 * shape.matmul_params if not lora else 4 * shape.frozen + 6 * shape.trainable) * L
    assert train_flops(shape, [L]) - 3 * (forward_flops(shape, [L]) - 2 * shape.matmul_params * L) == expected
    assert counted(lambda: model(input_ids=ids()).logits.sum().backward()) == expected


def test_sums_over_sequences_and_tflops():
    s = ModelShape(frozen=1000, trainable=10, layers=2, attn_width=8)
    assert forward_flops(s, [3, 5]) == forward_flops(s, [3]) + forward_flops(s, [5])
    assert train_flops(s, []) == 0.0
    assert tflops(3e12, 2.0) == 1.5 and tflops(1.0, 0.0) == 0.0


def test_trainer_logs_train_flops_per_step(tmp_path):
    """Each step logs the loss passes' model FLOPs (the old-log-prob pass added when a round needs one) and
    achieved TFLOP/s over the step's time less generation."""
    tok, model = make()
    cfg = GRPOConfig(
        max_steps=2,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=1,
        num_generations=4,
        max_completion_length=5,
        num_iterations=2,  # a round spans two steps: its old log-probs are a forward pass
        reward_funcs=["proximity"],
    )
    trainer = make_trainer(cfg, tok, model, tmp_path)
    trainer.train()
    first, second = trainer.history
    shape = model_shape(model)
    # step 1: the round's old-log-prob forward + one loss pass over its 4 rows; step 2: the same rows again
    loss_pass, old_pass = second["perf/train_flops"], first["perf/train_flops"] - second["perf/train_flops"]
    assert old_pass > 0
    # forward + backward of LoRA on a frozen base: 2x to 3x a forward (4 N_base + 6 N_lora against 2 N, attention 3x)
    assert 2 < loss_pass / old_pass < 3
    assert loss_pass / old_pass == pytest.approx(train_flops(shape, [10]) / forward_flops(shape, [10]), rel=0.1)
    for h in (first, second):
        assert 0 < h["perf/train_seconds"] <= h["step_time"]
        assert h["perf/train_tflops"] == pytest.approx(h["perf/train_flops"] / h["perf/train_seconds"] / 1e12)
    assert first["perf/train_seconds"] <= first["step_time"] - first["generation_time"] + 1e-6
