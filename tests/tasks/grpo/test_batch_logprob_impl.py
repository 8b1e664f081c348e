"""grpo.logprob_impl (auto | triton | chunked): validated by the config, refused on a CPU device for triton when
the trainer starts, and passed to kernels.token_logprobs by the loss, old and reference passes."""

import pytest
import torch
from pydantic import ValidationError

from grpoflow.tasks.config import GRPOConfig, load_config
from grpoflow.tasks.grpo import batch as batch_module
from grpoflow.tasks.grpo.batch import check_logprob_impl
from tests.tasks.grpo.test_trainer import make, make_trainer


def test_the_key_takes_the_three_names_and_defaults_to_auto():
    assert GRPOConfig().logprob_impl == "auto"
    assert load_config(None, ["grpo.logprob_impl=chunked"]).grpo.logprob_impl == "chunked"
    with pytest.raises(ValidationError, match="logprob_impl"):
        GRPOConfig(logprob_impl="reference")  # the test-only naive path is no config choice


def test_triton_on_a_cpu_device_is_refused_naming_the_key(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="grpo.logprob_impl=triton needs a CUDA device"):
        check_logprob_impl("triton", torch.device("cpu"))
    check_logprob_impl("triton", torch.device("cuda", 1))  # accepted: CUDA
    for impl in ("auto", "chunked"):
        check_logprob_impl(impl, torch.device("cpu"))


def test_the_trainer_refuses_triton_on_cpu_at_start(tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    tok, model = make(lora=True)
    cfg = GRPOConfig(max_steps=1, per_device_train_batch_size=4, num_generations=2, logprob_impl="triton")
    with pytest.raises(ValueError, match="grpo.logprob_impl"):
        make_trainer(cfg, tok, model, tmp_path / "ckpt", n_rows=4)


def test_every_logprob_pass_of_a_step_uses_the_configured_impl(tmp_path, monkeypatch):
    """One step with beta > 0 (a reference pass) and num_iterations=2 (an old-log-prob pass): every call of
    kernels.token_logprobs from the trainer gets impl='chunked' (recorded, then run for real)."""
    impls = []
    real = batch_module.token_logprobs

    def recording(*args, **kwargs):
        impls.append(kwargs.get("impl"))
        return real(*args, **kwargs)

    monkeypatch.setattr(batch_module, "token_logprobs", recording)
    tok, model = make(lora=True)
    cfg = GRPOConfig(
        max_steps=1,
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=4,
        num_iterations=2,
        beta=0.1,
        logprob_impl="chunked",
    )
    trainer = make_trainer(cfg, tok, model, tmp_path / "ckpt", n_rows=4)
    trainer.train()
    assert len(impls) >= 3 and set(impls) == {"chunked"}  # loss, old and reference passes


def test_the_entropy_bonus_trains_through_the_fused_kernels(tmp_path, monkeypatch):
    """Issue 41: with the entropy bonus on, the loss pass asks token_logprobs for the entropy's gradient and the
    full-logits reference is never called by training code."""
    from grpoflow.kernels import logprobs as kernel_module

    calls = []
    real = batch_module.token_logprobs

    def recording(*args, **kwargs):
        calls.append(kwargs.get("entropy_grad"))
        return real(*args, **kwargs)

    def refuse(*args, **kwargs):
        raise AssertionError("token_logprobs_reference called from training")

    monkeypatch.setattr(batch_module, "token_logprobs", recording)
    monkeypatch.setattr(kernel_module, "token_logprobs_reference", refuse)
    tok, model = make(lora=True)
    cfg = GRPOConfig(
        max_steps=1, per_device_train_batch_size=4, num_generations=2, max_completion_length=4, entropy_coef=0.05
    )
    make_trainer(cfg, tok, model, tmp_path / "ckpt", n_rows=4).train()
    assert True in calls


@pytest.mark.parametrize("lora", [False, True])
def test_entropy_grad_log_probs_match_the_full_logits(lora):
    """policy_logprobs with entropy_grad: log-probs, entropies and the gradient of sum(a logp + c H) w.r.t. every
    trainable parameter equal those from the model's full float32 logits."""
    from grpoflow.tasks.grpo.batch import build_round, policy_logprobs

    tok, model = make(lora=lora)
    g = torch.Generator().manual_seed(0)
    v = model.get_output_embeddings().weight.shape[0]
    prompts = [[5, 9, 11], [7, 8], [5, 9, 11]]
    completions = [torch.randint(3, v, (k,), generator=g).tolist() for k in (4, 2, 3)]
    batch = build_round(prompts, completions, [[0.0] * len(c) for c in completions], ["stop"] * 3, 0, False)
    params = [p for p in model.parameters() if p.requires_grad]
    a, c = torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=g)
    m = batch.completion_mask.float()

    logp, ent = policy_logprobs(model, batch, 0.8, compute_entropy=True, impl="chunked", entropy_grad=True)
    grads = torch.autograd.grad((m * (a * logp + c * ent)).sum(), params)

    ids = torch.cat([batch.prompt_ids, batch.completion_ids], 1)
    attn = torch.cat([batch.prompt_mask, torch.ones_like(batch.completion_ids)], 1)
    P, C = batch.prompt_ids.shape[1], batch.completion_ids.shape[1]
    logits = model(input_ids=ids, attention_mask=attn).logits[:, P - 1 : P + C - 1].float() / 0.8
    logsm = torch.log_softmax(logits, -1)
    rlogp = logsm.gather(-1, batch.completion_ids[..., None])[..., 0]
    rent = -(logsm.exp() * logsm).sum(-1)
    rgrads = torch.autograd.grad((m * (a * rlogp + c * rent)).sum(), params)

    torch.testing.assert_close(logp * m, rlogp * m, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent * m, rent * m, atol=1e-5, rtol=1e-5)
    for got, want in zip(grads, rgrads, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    assert any(gr.abs().sum() > 0 for gr in grads)
