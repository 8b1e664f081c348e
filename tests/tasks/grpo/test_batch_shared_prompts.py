"""grpo.share_prompt_forward: each distinct prompt runs once and its group's completions over its KV cache; the
log-probs, entropies and gradients equal the full pass's."""

import pytest
import torch

from grpoflow.tasks.config import GRPOConfig
from grpoflow.tasks.grpo.batch import PolicyLogProbs, build_round, can_share, prompt_groups, root_logprobs
from grpoflow.tasks.model.loading import backbone_and_head, enable_gradient_checkpointing
from grpoflow.tasks.model.precision import train_precision, use_float32_attention
from tests.tasks.grpo.test_trainer import assert_trainers_agree, make, make_trainer


def _round(tok):
    """Seven rows over three prompts of 2, 9 and 5 tokens (left-padded), the groups interleaved, completions of
    1-7 tokens."""
    vocab = len(tok)
    g = torch.Generator().manual_seed(0)
    distinct = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (2, 9, 5)]
    which = [0, 1, 0, 2, 1, 0, 2]
    completions = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (3, 1, 7, 5, 2, 7, 4)]
    lps = [[-1.0] * len(c) for c in completions]
    return build_round([distinct[w] for w in which], completions, lps, ["stop"] * 7, tok.pad_token_id, False), which


def test_prompt_groups_index_the_distinct_prompts():
    tok, _ = make(lora=False)
    batch, which = _round(tok)
    first, inverse = prompt_groups(batch.prompt_ids, batch.prompt_mask)
    assert len(first) == 3
    # rows with one prompt share an index, and first[] holds a row of that prompt
    assert [inverse.tolist().index(inverse[i]) for i in range(7)] == [which.index(w) for w in which]
    assert torch.equal(batch.prompt_ids[first][inverse], batch.prompt_ids)
    assert prompt_groups(batch.prompt_ids[:2], batch.prompt_mask[:2]) is None  # nothing shared


def _pass(model, batch, share, autocast=None, chunk_rows=0):
    mask = batch.completion_mask.float()
    weights = torch.linspace(-1, 1, mask.numel()).view(mask.shape)  # every token weighed differently
    params = [p for p in model.parameters() if p.requires_grad]
    with train_precision(model, "cpu", autocast):
        logp, ent = root_logprobs(PolicyLogProbs(model, share), batch, 0.7, compute_entropy=True, chunk_rows=chunk_rows)
    grads = torch.autograd.grad((logp.float() * weights * mask).sum(), params)
    return logp.detach().float(), ent.float(), grads


@pytest.mark.parametrize("chunk_rows", [0, 4])
def test_shared_prompt_logprobs_and_gradients_equal_the_full_pass(chunk_rows):
    tok, model = make(lora=True)
    batch, _ = _round(tok)
    real = batch.completion_mask.bool()
    lp1, ent1, g1 = _pass(model, batch, share=False, chunk_rows=chunk_rows)
    lp2, ent2, g2 = _pass(model, batch, share=True, chunk_rows=chunk_rows)
    torch.testing.assert_close(lp2[real], lp1[real], rtol=0, atol=2e-5)
    torch.testing.assert_close(ent2[real], ent1[real], rtol=0, atol=2e-5)
    for a, b in zip(g2, g1, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=2e-6)
    assert max(float(g.abs().max()) for g in g1) > 1e-3  # gradients that could differ


def test_shared_prompts_in_bf16_with_float32_attention_follow_the_full_pass():
    tok, model = make(lora=True)
    for p in model.parameters():
        if not p.requires_grad:
            p.data = p.data.to(torch.bfloat16)
    assert use_float32_attention(model, torch.device("cpu"), computes_bf16=True)
    batch, _ = _round(tok)
    real = batch.completion_mask.bool()
    lp1, _, g1 = _pass(model, batch, share=False, autocast=torch.bfloat16)
    lp2, _, g2 = _pass(model, batch, share=True, autocast=torch.bfloat16)
    assert (lp2[real] - lp1[real]).abs().max() < 0.05  # bf16 rounding of two different pass shapes
    for a, b in zip(g2, g1, strict=True):
        assert (a - b).norm() <= 0.05 * b.norm() + 1e-6


def test_gradient_checkpointing_falls_back_to_the_full_pass():
    tok, model = make(lora=True)
    backbone, _ = backbone_and_head(model)
    assert can_share(backbone)
    enable_gradient_checkpointing(model)
    model.train()
    assert not can_share(backbone)
    batch, _ = _round(tok)
    real = batch.completion_mask.bool()
    lp1, _, _ = _pass(model, batch, share=False)
    lp2, _, _ = _pass(model, batch, share=True)
    torch.testing.assert_close(lp2[real], lp1[real], rtol=0, atol=2e-5)


def test_a_trainer_sharing_prompts_follows_the_full_pass_trainer(tmp_path):
    tok, model = make()
    for share in (False, True):  # the key reaches the trainer's log-prob root
        cfg = GRPOConfig(max_steps=1, per_device_train_batch_size=4, num_generations=4, share_prompt_forward=share)
        assert make_trainer(cfg, tok, model, tmp_path / f"root{share}").root.share_prompts is share
    assert GRPOConfig().share_prompt_forward  # on by default
    assert_trainers_agree(tmp_path, "share_prompt_forward", (False, True))


def test_the_shared_pass_gradient_is_the_same_on_every_run():
    """Each prompt's gradient sums over its rows in a fixed order: reruns of a run give bit-identical adapters.

    64 interleaved rows over 8 prompts of 40 tokens: the KV cache indexed out to the rows is past torch's grain size,
    where advanced indexing's backward (index_put_ with accumulate) adds the rows with parallel atomic float adds
    on CPU, so the sum's order (and its last bits) changed from call to call."""
    tok, model = make(lora=True)
    vocab = len(tok)
    g = torch.Generator().manual_seed(1)
    distinct = [torch.randint(3, vocab, (40,), generator=g).tolist() for _ in range(8)]
    lengths = torch.randint(1, 6, (64,), generator=g).tolist()
    completions = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]
    lps = [[-1.0] * len(c) for c in completions]
    batch = build_round([distinct[i % 8] for i in range(64)], completions, lps, ["stop"] * 64, tok.pad_token_id, False)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        _, _, first = _pass(model, batch, share=True)
        for _ in range(6):
            _, _, again = _pass(model, batch, share=True)
            assert all(torch.equal(a, b) for a, b in zip(again, first, strict=True))
    finally:
        torch.set_num_threads(threads)
