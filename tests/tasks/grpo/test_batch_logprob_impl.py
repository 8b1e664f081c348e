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
