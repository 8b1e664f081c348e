"""The generation backend and the GRPO loop on a tiny model: shapes, log-prob consistency, a real step."""

import pytest
import torch

from grpoflow.tasks.config import GRPOConfig, ModelConfig, TinyModelConfig
from grpoflow.tasks.generation.transformers_loop import TransformersGenerator
from grpoflow.tasks.generation.types import SamplingParams
from grpoflow.tasks.grpo.batch import build_round, policy_logprobs
from grpoflow.tasks.grpo.trainer import GRPOTrainer, PromptSampler
from grpoflow.tasks.grpo.trainer_runtime import TrainerRuntime
from grpoflow.tasks.model.loading import add_lora, prompt_ids
from grpoflow.tasks.model.tiny import build_tiny_model, train_tiny_tokenizer
from grpoflow.tasks.rewards import resolve_reward_funcs
from grpoflow.tasks.tracking.tracker import RunLogger

TEXTS = ["What is 3 + 4?", "<reasoning>\n3 + 4 = 7\n</reasoning>\n<answer>\n7\n</answer>"] * 20


def make(lora=True):
    tok = train_tiny_tokenizer(TEXTS, 280)
    model = build_tiny_model(
        TinyModelConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1
        ),
        tok,
        seed=0,
    )
    if lora:
        model = add_lora(model, ModelConfig().lora.model_copy(update={"r": 4, "target_modules": "all-linear"}))
    return tok, model


def addition_rows(tok, n):
    """n 'What is a + a?' rows (TRL conversational prompts) and their chat-templated prompt ids."""
    rows = [
        {"prompt": [{"role": "user", "content": f"What is {a} + {a}?"}], "question": f"{a}+{a}", "answer": str(2 * a)}
        for a in range(n)
    ]
    return rows, [prompt_ids(tok, r["prompt"]) for r in rows]


def make_trainer(
    cfg, tok, model, out_dir, funcs=None, n_rows=4, generator=None, row_seeded=False, is_correction=None, **runtime
):
    """A GRPOTrainer on addition_rows, sampling with the training model itself (unless ``generator`` is given),
    logging nowhere; ``runtime``: further TrainerRuntime fields (ref_model, autocast_dtype, comm, root, hooks)."""
    rows, prompts = addition_rows(tok, n_rows)
    generator = generator or TransformersGenerator(model, tok)
    rt = TrainerRuntime(
        model, tok, rows, prompts, funcs or [("length", length)], generator, RunLogger.disabled(), out_dir, **runtime
    )
    return GRPOTrainer(cfg, rt, seed=0, row_seeded=row_seeded, is_correction=is_correction)


def length(prompts, completions, **columns):
    """A reward with spread, so even a random model gets a gradient."""
    return [float(len(c[0]["content"])) for c in completions]


def test_generation_is_prompt_major_and_logprobs_match_the_trainer():
    tok, model = make()
    prompts = [tok("What is 3 + 4?")["input_ids"], tok("What is 10 + 20 + 30?")["input_ids"]]
    torch.manual_seed(0)
    gen = TransformersGenerator(model, tok, batch_size=3).generate(
        prompts, 3, SamplingParams(max_new_tokens=6, temperature=0.9)
    )
    assert len(gen.completion_ids) == 6
    for ids, lps, reason in zip(gen.completion_ids, gen.logprobs, gen.finish_reasons):
        assert len(ids) == len(lps) and 1 <= len(ids) <= 6
        assert reason == ("stop" if ids[-1] == tok.eos_token_id else "length")
    batch = build_round(
        [p for p in prompts for _ in range(3)],
        gen.completion_ids,
        gen.logprobs,
        gen.finish_reasons,
        tok.pad_token_id,
        mask_truncated=False,
    )
    with torch.no_grad():
        logp, _ = policy_logprobs(model, batch, temperature=0.9)
    m = batch.completion_mask.bool()
    torch.testing.assert_close(logp[m], batch.sampler_logp[m], atol=1e-4, rtol=1e-4)


def test_greedy_generation_is_deterministic():
    tok, model = make()
    prompts = [tok("What is 3 + 4?")["input_ids"]]
    g = TransformersGenerator(model, tok)
    p = SamplingParams(max_new_tokens=5, greedy=True)
    assert g.generate(prompts, 1, p).completion_ids == g.generate(prompts, 1, p).completion_ids


def test_mask_truncated_completions_zeroes_their_rows():
    batch = build_round([[1, 2], [1]], [[5, 6, 9], [5, 6]], [[-1.0] * 3, [-1.0] * 2], ["stop", "length"], 0, True)
    assert batch.completion_mask.tolist() == [[1, 1, 1], [0, 0, 0]]
    assert batch.prompt_ids.tolist() == [[1, 2], [0, 1]]


def test_prompt_sampler_covers_every_row_each_epoch_and_resumes():
    s = PromptSampler(5, seed=1)
    first = s.take(5)
    assert sorted(first) == [0, 1, 2, 3, 4]
    state = s.state()
    nxt = s.take(3)
    t = PromptSampler(5, seed=1)
    t.load(state)
    assert t.take(3) == nxt


def test_grpo_steps_update_lora_and_log_metrics(tmp_path):
    tok, model = make()
    cfg = GRPOConfig(
        max_steps=2,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        num_generations=4,
        max_completion_length=6,
        learning_rate=1e-2,
        save_steps=1,
        reward_funcs=["proximity", "length"],
        num_iterations=2,
        beta=0.1,
    )
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}

    funcs = resolve_reward_funcs(["proximity"]) + [("length", length)]
    trainer = make_trainer(cfg, tok, model, tmp_path / "ckpt", funcs=funcs, n_rows=8)
    result = trainer.train()
    assert result["steps"] == 2 and len(trainer.history) == 2
    h = trainer.history[-1]
    for key in (
        "loss",
        "reward",
        "reward_std",
        "rewards/proximity/mean",
        "rewards/length/std",
        "kl",
        "entropy",
        "clip_ratio/region_mean",
        "completions/mean_length",
        "grad_norm",
        "frac_reward_zero_std",
    ):
        assert key in h and h[key] == h[key], key
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters() if p.requires_grad)
    assert all(torch.equal(frozen[n], p) for n, p in model.named_parameters() if not p.requires_grad)
    assert (tmp_path / "ckpt" / "checkpoint-1" / "adapter_model.safetensors").is_file()
    assert (tmp_path / "ckpt" / "checkpoint-1" / "trainer_state.json").is_file()


def test_sampler_importance_sampling_path_with_transformers_logprobs(tmp_path):
    """The correction path runs on the transformers sampler's log-probs: same weights, so rho ~ 1."""
    tok, model = make()
    cfg = GRPOConfig(
        max_steps=1,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=5,
        reward_funcs=["proximity"],
        vllm_importance_sampling_mode="sequence_truncate",
    )

    trainer = make_trainer(cfg, tok, model, tmp_path / "ckpt", is_correction=True)
    trainer.train()
    h = trainer.history[-1]
    assert h["sampling/importance_sampling_ratio/mean"] == pytest.approx(1.0, abs=1e-3)
    assert h["sampling/sampling_logp_difference/max"] < 1e-3
    assert 0.0 <= h["clip_ratio/low_min"] <= 1.0 and 0.0 <= h["clip_ratio/high_max"] <= 1.0


@pytest.mark.parametrize(
    "ga, spg, mu, needs_old",
    [(1, 1, 1, False), (2, 2, 1, False), (3, 2, 1, True), (2, 4, 1, True), (1, 1, 2, True), (2, 1, 2, False)],
)
def test_old_logprobs_computed_exactly_when_a_round_spans_an_optimizer_step(tmp_path, ga, spg, mu, needs_old):
    """TRL's rule: gradient_accumulation_steps % (steps_per_generation * num_iterations) != 0."""
    tok, model = make()
    cfg = GRPOConfig(
        max_steps=1,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=ga,
        steps_per_generation=spg,
        num_iterations=mu,
        num_generations=2,
        max_completion_length=3,
        reward_funcs=["proximity"],
    )
    trainer = make_trainer(cfg, tok, model, tmp_path)
    assert (trainer.new_round().old_logp is not None) == needs_old


def test_checkpoint_mid_round_is_weights_only_and_restores_round_and_rngs(tmp_path):
    """A checkpoint taken inside a generation round holds tensors and JSON only (torch.load weights_only=True),
    and a fresh trainer loaded from it has the same round in progress and the same RNG streams."""
    import random

    import numpy as np

    tok, model = make()
    cfg = GRPOConfig(
        max_steps=1,
        per_device_train_batch_size=2,
        steps_per_generation=2,
        num_generations=2,
        max_completion_length=4,
        reward_funcs=["proximity"],
    )
    trainer = make_trainer(cfg, tok, model, tmp_path / "a")
    trainer.train()  # one optimizer step = one of the round's two micro-batches
    r = trainer.round
    assert r is not None and r.position == 1
    path = trainer.save_checkpoint()
    blob = torch.load(path / "trainer_state.pt", weights_only=True)
    assert set(blob["round"]) >= {"batch.completion_ids", "advantages", "order"}
    draws = (random.random(), float(np.random.rand()), torch.rand(1).item())

    tok2, model2 = make()
    other = make_trainer(cfg, tok2, model2, tmp_path / "b")
    other.load_checkpoint(path)
    assert (random.random(), float(np.random.rand()), torch.rand(1).item()) == draws
    s = other.round
    assert s.position == 1 and s.n_tokens == r.n_tokens and s.stats == r.stats and s.samples == r.samples
    for f in ("prompt_ids", "completion_ids", "completion_mask", "truncated"):
        assert torch.equal(getattr(s.batch, f), getattr(r.batch, f)), f
    assert torch.equal(s.advantages, r.advantages) and torch.equal(s.order, r.order)
    assert (s.old_logp is None) == (r.old_logp is None) and s.is_ratio is None and s.ref_logp is None
    trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
    for n, p in model2.named_parameters():
        if p.requires_grad:
            assert torch.equal(p, trained[n]), n


def test_micro_step_path_keeps_every_tensor_on_the_model_device(tmp_path, monkeypatch):
    """The model on the `meta` device (no data, any op on a CPU tensor mixed in raises): the trainer's round
    placement, old/reference log-probs (one forward per distinct prompt), the sampler correction and the micro-batch
    loss with its backward all run there, so none of them builds a tensor on the CPU by default (the bug a GPU run
    would hit)."""
    from grpoflow.tasks.grpo.loss import importance_sampling_ratio
    from grpoflow.tasks.grpo.trainer import Round

    tok, model = make()
    cfg = GRPOConfig(max_steps=1, per_device_train_batch_size=4, num_generations=4, max_completion_length=5, beta=0.04)
    trainer = make_trainer(cfg, tok, model, tmp_path, is_correction=True)
    torch.manual_seed(0)
    batch, adv, _, _ = trainer.generate_round()  # on the CPU: the sampler's lists
    # two value-dependent branches meta tensors cannot take: sdpa's all-ones mask check and the log-prob
    # kernel's refold of rows whose float32 exp-sum overflowed (a numerical fix-up, no placement in it)
    model.set_attn_implementation("eager")
    monkeypatch.setattr("grpoflow.kernels.chunked_logprobs._refold_overflowed", lambda *a: None)
    # and the grouping of rows by prompt (read to the host once per round): one group, the shared-prompt pass and
    # its groups (sent to the model's device) run on meta
    monkeypatch.setattr("grpoflow.tasks.grpo.trainer.prompt_keys", lambda ids, mask: [0] * ids.shape[0])
    model.to("meta")
    trainer.device = torch.device("meta")
    host = (batch, adv)  # as new_round keeps them: what each micro-step computes is planned from them
    batch, adv = trainer.place(batch, adv)
    assert batch.completion_ids.device.type == "meta" and adv.device.type == "meta"
    old = trainer._logprobs_no_grad(batch, host=host[0])
    ref = trainer.reference_logprobs(batch, host[0])
    rho = importance_sampling_ratio(old, batch.sampler_logp, batch.completion_mask)
    r = Round(batch, adv, {}, [], old, ref, rho, n_tokens=10.0, order=torch.arange(adv.numel()))
    trainer._plans(r, host)
    loss, extras, mb, logp, entropy = trainer.micro_loss(r, torch.arange(4))
    assert {loss.device.type, logp.device.type, entropy.device.type, extras["kl"].device.type} == {"meta"}
    loss.backward()
    assert all(p.grad.device.type == "meta" for p in model.parameters() if p.requires_grad)


def test_a_round_no_reward_scores_warns_and_logs_no_nan(tmp_path, caplog):
    """Every reward None: a warning naming the functions, frac_unscored = 1, and no NaN reward in the history
    (TRL would log NaN); the step still runs (advantages 0)."""
    import json
    import logging
    import math

    def never(prompts, completions, **kwargs):
        return [None] * len(completions)

    tok, model = make()
    cfg = GRPOConfig(max_steps=1, per_device_train_batch_size=4, num_generations=4, max_completion_length=4)
    trainer = make_trainer(cfg, tok, model, tmp_path, funcs=[("never", never)])
    with caplog.at_level(logging.WARNING, logger="grpoflow.tasks.grpo.trainer"):
        trainer.train()
    assert "no reward function scored any completion" in caplog.text and "never" in caplog.text
    h = trainer.history[-1]
    assert h["frac_unscored"] == 1.0 and "reward" not in h and "rewards/never/mean" not in h
    assert all(not (isinstance(v, float) and math.isnan(v)) for v in h.values() if v is not None)
    assert "NaN" not in json.dumps(trainer.history)


def assert_trainers_agree(tmp_path, key: str, values) -> None:
    """Two short LoRA trainings that differ only in GRPOConfig ``key`` (a setting that must not change the math)
    end at the same adapter weights, and those weights did move."""
    weights = []
    for value in values:
        torch.manual_seed(0)  # LoRA's A matrices are drawn from the global generator
        tok, model = make()
        cfg = GRPOConfig(
            max_steps=2,
            per_device_train_batch_size=8,
            num_generations=4,
            max_completion_length=6,
            learning_rate=1e-2,
            num_iterations=2,
            beta=0.1,
            **{key: value},
        )
        trainer = make_trainer(cfg, tok, model, tmp_path / f"ckpt-{key}-{value}", n_rows=8)
        torch.manual_seed(0)
        trainer.train()
        weights.append({n: p.detach() for n, p in model.named_parameters() if p.requires_grad})
        assert trainer.history[-1]["loss"] == trainer.history[-1]["loss"]  # not NaN
    torch.manual_seed(0)
    start = make()[1].state_dict()
    moved = 0.0
    for name, w in weights[0].items():
        torch.testing.assert_close(weights[1][name], w, rtol=0, atol=1e-5)
        moved = max(moved, float((w - start[name]).abs().max()))
    assert moved > 1e-3  # the steps did train
