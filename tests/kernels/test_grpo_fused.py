"""One GRPO micro-step (policy_logprobs -> grpo_loss -> backward) on a tiny model: the fused log-prob paths give
the loss and gradients of the naive path, with LoRA (frozen head) and full fine-tuning (trainable head), with
tied and untied embeddings."""

import pytest
import torch

from grpoflow.tasks.config import LoraConfig, TinyModelConfig
from grpoflow.tasks.grpo.batch import build_round, policy_logprobs
from grpoflow.tasks.grpo.loss import LossSettings, grpo_loss
from grpoflow.tasks.model.loading import add_lora, backbone_and_head
from grpoflow.tasks.model.tiny import build_tiny_model, train_tiny_tokenizer

TEXTS = ["What is 3 + 4?", "<reasoning>\n3 + 4 = 7\n</reasoning>\n<answer>\n7\n</answer>"] * 20
TEMPERATURE = 0.9


@pytest.fixture(scope="module")
def tokenizer():
    return train_tiny_tokenizer(TEXTS, 280)


def make_model(tokenizer, lora: bool, tied: bool):
    cfg = TinyModelConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=tied,
    )
    model = build_tiny_model(cfg, tokenizer, seed=0)
    if lora:
        model = add_lora(model, LoraConfig(r=4, target_modules="all-linear"))
    return model.eval()  # no dropout: every pass sees the same network


def make_batch(vocab: int, pad_id: int):
    """Four rows of random prompts and completions; the last is truncated and masked out, the others padded."""
    g = torch.Generator().manual_seed(0)
    ids = lambda k: torch.randint(3, vocab, (k,), generator=g).tolist()  # noqa: E731
    completions = [ids(k) for k in (6, 2, 4, 6)]
    return build_round(
        [ids(k) for k in (5, 3, 4, 6)],
        completions,
        [[-1.0] * len(c) for c in completions],
        ["stop", "stop", "stop", "length"],
        pad_id,
        mask_truncated=True,
    )


def grpo_step(model, batch, old_logp, impl: str):
    """Loss, entropy and the gradients of the trainable parameters after one micro-step with ``impl``."""
    model.zero_grad(set_to_none=True)
    logp, entropy = policy_logprobs(model, batch, TEMPERATURE, compute_entropy=True, impl=impl)
    advantages = torch.tensor([1.0, -0.5, 0.3, -1.2])
    loss, _ = grpo_loss(logp, old_logp, advantages, batch.completion_mask, LossSettings(loss_type="bnpo"))
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return loss, entropy, grads


@pytest.mark.parametrize("impl", ["chunked", pytest.param("triton", marks=pytest.mark.triton_interpret)])
@pytest.mark.parametrize("lora", [True, False])
@pytest.mark.parametrize("tied", [True, False])
def test_fused_grpo_step_matches_naive(tokenizer, impl, lora, tied):
    model = make_model(tokenizer, lora, tied)
    batch = make_batch(len(tokenizer), tokenizer.pad_token_id)
    with torch.no_grad():
        ref_logp, _ = policy_logprobs(model, batch, TEMPERATURE, impl="reference")
    noise = torch.randn(ref_logp.shape, generator=torch.Generator().manual_seed(1))
    old_logp = ref_logp + 0.3 * noise  # off-policy enough that some ratios clip

    loss, entropy, grads = grpo_step(model, batch, old_logp, impl)
    ref_loss, ref_entropy, ref_grads = grpo_step(model, batch, old_logp, "reference")

    torch.testing.assert_close(loss, ref_loss, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(entropy, ref_entropy, atol=1e-5, rtol=1e-5)
    head = backbone_and_head(model)[1].weight
    assert head.requires_grad is not lora  # LoRA freezes the head; full fine-tuning trains it
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], atol=1e-6, rtol=1e-4, msg=name)
