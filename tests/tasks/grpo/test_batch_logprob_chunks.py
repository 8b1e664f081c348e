"""grpo.logprob_chunk_rows: the log-prob pass in length-sorted chunks, each cut to its own widths, gives the
one-pass values and gradients."""

import pytest
import torch

from grpoflow.tasks.config import load_config
from grpoflow.tasks.grpo.batch import build_round, completion_lengths, policy_logprobs
from tests.tasks.grpo.test_trainer import assert_trainers_agree, make


def _round(tok, mask_truncated=False):
    """Six rows: prompts of 2-9 tokens (left-padded), completions of 1-7 tokens, one truncated at the width 7."""
    vocab = len(tok)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (4, 9, 2, 6, 9, 3)]
    completions = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (3, 1, 7, 5, 2, 7)]
    reasons = ["stop", "stop", "length", "stop", "stop", "stop"]
    lps = [[-1.0] * len(c) for c in completions]
    return build_round(prompts, completions, lps, reasons, tok.pad_token_id, mask_truncated)


def test_completion_lengths_count_the_mask_and_a_masked_truncated_row_as_the_width():
    tok, _ = make(lora=False)
    assert completion_lengths(_round(tok)).tolist() == [3, 1, 7, 5, 2, 7]
    masked = _round(tok, mask_truncated=True)
    assert masked.completion_mask[2].sum() == 0
    assert completion_lengths(masked).tolist() == [3, 1, 7, 5, 2, 7]


@pytest.mark.parametrize("chunk_rows", [1, 2, 4])
def test_chunked_logprobs_and_gradients_equal_one_pass(chunk_rows: int):
    tok, model = make(lora=True)
    batch = _round(tok)
    mask = batch.completion_mask.float()
    params = [p for p in model.parameters() if p.requires_grad]
    weights = torch.linspace(-1, 1, mask.numel()).view(mask.shape)  # a loss that weighs every token differently

    def run(chunk):
        logp, ent = policy_logprobs(model, batch, 0.7, compute_entropy=True, chunk_rows=chunk)
        grads = torch.autograd.grad((logp * weights * mask).sum(), params)
        return logp.detach(), ent, grads

    lp1, ent1, g1 = run(0)
    lpc, entc, gc = run(chunk_rows)
    assert lpc.shape == lp1.shape
    real = mask.bool()
    torch.testing.assert_close(lpc[real], lp1[real], rtol=0, atol=2e-5)
    torch.testing.assert_close(entc[real], ent1[real], rtol=0, atol=2e-5)
    assert torch.isfinite(lpc).all()
    if chunk_rows == 1:  # each row cut to its own length: nothing computed past it
        assert (lpc[~real] == 0).all()
    for a, b in zip(gc, g1, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=2e-6)


def test_a_trainer_with_chunks_follows_the_one_pass_trainer(tmp_path):
    assert_trainers_agree(tmp_path, "logprob_chunk_rows", (0, 3))


def test_fsdp2_with_chunks_is_refused():
    with pytest.raises(ValueError, match="grpo.logprob_chunk_rows with distributed.strategy=fsdp2"):
        load_config(
            None,
            ["distributed.nproc_per_node=2", "distributed.strategy=fsdp2", "grpo.logprob_chunk_rows=4"],
        )
