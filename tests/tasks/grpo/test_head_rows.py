"""The head computes only what the loss uses (batch.selected_logprobs): the real tokens, and a backward only for the
rows whose log-probs get a gradient (loss.rows_with_gradient). The values there and every gradient are those of the
full computation; padding and masked-out rows cost nothing."""

import typing

import pytest
import torch

import grpoflow.tasks.grpo.batch as batch_mod
from grpoflow.tasks.config import GRPOConfig
from grpoflow.tasks.grpo.batch import PolicyLogProbs, build_round, head_positions, root_logprobs
from grpoflow.tasks.grpo.loss import LossSettings, grpo_loss, rows_with_gradient
from tests.tasks.grpo.test_trainer import make

LOSS_TYPES = typing.get_args(GRPOConfig.model_fields["loss_type"].annotation)


def _round(tok, mask_truncated=True):
    """Eight rows, two prompts of four rows each (a GRPO group shares its prompt), completions of 1-7 tokens; row 5
    truncated at the width 7 (its mask zeroed with ``mask_truncated``)."""
    vocab = len(tok)
    g = torch.Generator().manual_seed(0)
    two = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (4, 7)]
    prompts = [two[i // 4] for i in range(8)]
    lengths = (3, 1, 6, 5, 2, 7, 4, 6)
    completions = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]
    reasons = ["length" if n == 7 else "stop" for n in lengths]
    return build_round(prompts, completions, [[-1.0] * n for n in lengths], reasons, tok.pad_token_id, mask_truncated)


def _seen_rows(monkeypatch) -> list[tuple[int, bool]]:
    """(rows, with autograd) of every token_logprobs call the log-prob path makes."""
    seen = []
    real = batch_mod.token_logprobs

    def counting(h, *a, **k):
        seen.append((h.reshape(-1, h.shape[-1]).shape[0], torch.is_grad_enabled()))
        return real(h, *a, **k)

    monkeypatch.setattr(batch_mod, "token_logprobs", counting)
    return seen


@pytest.mark.parametrize("lora", [True, False], ids=["frozen-head", "trainable-head"])
@pytest.mark.parametrize("chunk_rows", [0, 3])
def test_the_head_computes_real_tokens_and_the_loss_gradients_are_the_full_ones(monkeypatch, lora, chunk_rows):
    tok, model = make(lora=lora)
    b = _round(tok)
    mask = b.completion_mask
    adv = torch.tensor([0.5, -0.5, 1.0, -1.0, 0.0, 0.0, 0.0, 0.0])  # the second group's rewards were all equal
    s = LossSettings(loss_type="grpo")
    trains = rows_with_gradient(adv, s, entropy_bonus=False)
    params = [p for p in model.parameters() if p.requires_grad]
    old = -torch.rand(mask.shape, generator=torch.Generator().manual_seed(1)) - 1.0  # a ratio away from 1

    def run(head_rows):
        seen = _seen_rows(monkeypatch)
        logp, ent = root_logprobs(PolicyLogProbs(model), b, 0.7, True, chunk_rows=chunk_rows, head_rows=head_rows)
        loss, _ = grpo_loss(logp, old, adv, mask, s)
        return logp.detach(), ent, torch.autograd.grad(loss, params), seen

    lp_all, ent_all, g_all, _ = run(None)
    lp, ent, g, seen = run(head_positions(mask, trains, "cpu"))
    real = mask.bool()
    torch.testing.assert_close(lp[real], lp_all[real], rtol=0, atol=2e-5)
    torch.testing.assert_close(ent[real], ent_all[real], rtol=0, atol=2e-5)
    assert (lp[~real] == 0).all() and (ent[~real] == 0).all()  # padding and the masked truncated row: not computed
    for a, want in zip(g, g_all, strict=True):
        torch.testing.assert_close(a, want, rtol=1e-5, atol=1e-7)
    assert any(x.abs().sum() > 0 for x in g)  # the loss does train
    with_grad = sum(n for n, grad in seen if grad)
    without = sum(n for n, grad in seen if not grad)
    assert with_grad == int(mask[:4].sum()), seen  # the first group's real tokens, with a backward
    assert without == int(mask[4:].sum()), seen  # the second group's: values only (row 5 is masked: none of it)
    assert with_grad + without < mask.numel()


def test_a_micro_batch_of_rows_without_gradient_still_gives_every_parameter_a_zero_gradient():
    tok, model = make(lora=False)
    b = _round(tok)
    rows = head_positions(b.completion_mask, torch.zeros(8, dtype=torch.bool), "cpu")
    logp, _ = root_logprobs(PolicyLogProbs(model), b, 1.0, head_rows=rows)
    assert logp.requires_grad and rows[0].numel() == 0
    (logp * b.completion_mask).sum().backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(gr is not None and (gr == 0).all() for gr in grads)  # as distributed wrappers expect


def _loss_inputs(B=6, T=5):
    g = torch.Generator().manual_seed(3)
    logp = (-torch.rand(B, T, generator=g) * 3).requires_grad_()
    old = logp.detach() + 0.3 * torch.randn(B, T, generator=g)
    mask = torch.ones(B, T)
    mask[1, 3:] = 0
    adv = torch.tensor([1.0, 0.0, -1.0, 0.0, 0.5, 0.0])
    return logp, old, adv, mask


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_rows_with_zero_advantage_get_no_gradient_from_any_loss_type(loss_type):
    """The rule head_positions relies on, for every loss type the config accepts (a new one fails here until the rule
    covers it), with the off-policy mask, the high-entropy mask, the sampler correction and delta on."""
    logp, old, adv, mask = _loss_inputs()
    entropy = torch.rand(mask.shape, generator=torch.Generator().manual_seed(4))
    is_ratio = torch.rand(mask.shape, generator=torch.Generator().manual_seed(5)) + 0.5
    s = LossSettings(
        loss_type=loss_type, delta=1.5, top_entropy_quantile=0.8, off_policy_mask_threshold=0.1, max_completion_length=5
    )
    kw = {"is_ratio": is_ratio, "num_items_in_round": float(mask.sum()), "entropy": entropy}
    loss, _ = grpo_loss(logp, old, adv, mask, s, sampler_logp=old - 0.2, **kw)
    (grad,) = torch.autograd.grad(loss, logp)
    trains = rows_with_gradient(adv, s, entropy_bonus=False)
    assert trains.tolist() == [True, False, True, False, True, False]
    assert (grad[~trains] == 0).all(), grad
    assert grad[trains].abs().sum() > 0


@pytest.mark.parametrize("term", ["kl", "entropy_bonus"])
def test_a_kl_or_an_entropy_bonus_trains_every_row(term):
    logp, old, adv, mask = _loss_inputs()
    s = LossSettings(loss_type="dapo", beta=0.1 if term == "kl" else 0.0)
    ent = torch.rand(mask.shape, generator=torch.Generator().manual_seed(4)).requires_grad_()
    kw = {"ref_logp": old - 0.1} if term == "kl" else {"entropy": ent, "entropy_coef": 0.01}
    loss, _ = grpo_loss(logp, old, adv, mask, s, num_items_in_round=float(mask.sum()), **kw)
    grads = torch.autograd.grad(loss, [logp, ent] if term == "entropy_bonus" else [logp])
    zero_rows = adv == 0
    assert grads[-1][zero_rows].abs().sum() > 0  # a zero-advantage row does get a gradient here
    assert rows_with_gradient(adv, s, entropy_bonus=term == "entropy_bonus").all()


def half_constant(prompts, completions, question, **columns):
    """Spread for the prompts 'a+a' with an even a, 1.0 for the others: those groups' advantages are exactly 0."""
    return [
        float(len(c[0]["content"])) if int(q.split("+")[0]) % 2 == 0 else 1.0 for c, q in zip(completions, question)
    ]


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
@pytest.mark.parametrize("per_device", [4, 8], ids=["one-group-a-micro-batch", "two-groups"])
def test_rows_without_gradient_forward_apart_and_training_is_unchanged(tmp_path, lora, per_device):
    """One process: the rows of zero-advantage groups run in a no-grad forward of their own (micro_plan.py), a
    micro-batch of only such rows makes no backward at all; the weights end where the one-forward pass takes them."""
    from tests.tasks.grpo.test_trainer import make_trainer

    weights, splits = [], []
    for split in (True, False):
        torch.manual_seed(0)
        tok, model = make(lora=lora)
        cfg = GRPOConfig(
            max_steps=3,
            per_device_train_batch_size=per_device,
            gradient_accumulation_steps=8 // per_device,
            num_generations=4,
            max_completion_length=6,
            learning_rate=1e-2,
            loss_type="dr_grpo",
            shuffle_generation_batch=False,  # a micro-batch holds whole groups
        )
        trainer = make_trainer(cfg, tok, model, tmp_path / f"{split}", funcs=[("half", half_constant)], n_rows=8)
        trainer.split_rows = split
        seen = []

        def recording(mb, plan, real=trainer._policy_logprobs, seen=seen):
            seen.append((plan.train is None, plan.free is None))
            return real(mb, plan)

        trainer._policy_logprobs = recording
        torch.manual_seed(0)
        trainer.train()
        splits.append(seen)
        weights.append({n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad})
    with_split, without = splits
    assert all(free for _, free in without)  # turned off: one forward each
    assert any(not free for _, free in with_split)  # rows apart in some micro-step
    if per_device == 4:  # a micro-batch is one group: some have no row with a gradient at all
        assert any(no_train for no_train, _ in with_split)
    else:
        assert any(not no_train and not free for no_train, free in with_split)  # both kinds in one micro-batch
    moved = 0.0
    torch.manual_seed(0)
    start = make(lora=lora)[1].state_dict()
    for name, w in weights[1].items():
        torch.testing.assert_close(weights[0][name], w, rtol=0, atol=1e-5)
        moved = max(moved, float((w - start[name]).abs().max()))
    assert moved > 1e-3
