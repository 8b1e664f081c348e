"""The SFT loss: cross-entropy of the labelled next tokens, the head applied to those positions only."""

import pytest
import torch

from grpoflow.tasks.stages.sft import collate, labelled_token_loss, tokenize_sft
from tests.tasks.grpo.test_trainer import make


def _full_logits_loss(model, ids, labels, mask) -> torch.Tensor:
    """The textbook form: every position's vocabulary logits, ignore_index on the unlabelled ones."""
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100, reduction="sum"
    )


@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("completion_only", [True, False])
def test_labelled_token_loss_equals_the_full_logits_loss_and_its_gradient(lora: bool, completion_only: bool) -> None:
    tok, model = make(lora=lora)
    rows = [
        {"prompt": [{"role": "user", "content": f"What is {a} + {a}?"}], "reference": f"<answer>{2 * a}</answer>"}
        for a in (3, 17, 250)  # different lengths: padding on the right of the shorter rows
    ]
    ids, labels, mask = collate(tokenize_sft(rows, tok, 64, completion_only), tok.pad_token_id)
    assert (mask == 0).any() and (labels[:, 1:] == -100).any()
    params = [p for p in model.parameters() if p.requires_grad]

    ours = labelled_token_loss(model, ids, labels, mask)
    ours_grads = torch.autograd.grad(ours, params)
    full = _full_logits_loss(model, ids, labels, mask)
    full_grads = torch.autograd.grad(full, params)

    torch.testing.assert_close(ours, full, rtol=1e-6, atol=1e-5)
    for a, b in zip(ours_grads, full_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert any(g.abs().sum() > 0 for g in ours_grads)
