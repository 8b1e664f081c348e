"""Our GRPO loss against TRL's own GRPOTrainer._compute_loss on identical inputs.

TRL's method is called unbound on a stand-in object that carries just the attributes it reads
(single process, train mode, no entropy bonus), with its log-prob forward replaced by our tensor, so
the loss and the gradient w.r.t. the log-probs come from TRL's code path itself.
"""

import zlib
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from trl.trainer.grpo_trainer import GRPOTrainer as TRLGRPOTrainer

from grpoflow.tasks.config import GRPOConfig
from grpoflow.tasks.generation.transformers_loop import TransformersGenerator
from grpoflow.tasks.grpo.batch import policy_logprobs
from grpoflow.tasks.grpo.loss import LossSettings, grpo_loss, importance_sampling_ratio
from grpoflow.tasks.grpo.schedule import micro_batch_rows
from tests.tasks.grpo.test_trainer import make, make_trainer
from tests.tasks.grpo.trl_source import run_trl, trl_block, trl_span


class _Accelerator:
    num_processes = 1
    sync_gradients = True

    def gather(self, x):
        return x

    gather_for_metrics = gather

    def reduce(self, x, reduction="sum"):
        return x

    def pad_across_processes(self, x, dim=0, pad_index=0):
        return x


# non-default values, so that a setting that does not reach the loss fails the comparison
NEW_LOSS_ARGS = dict(
    sapo_temperature_neg=1.3,
    sapo_temperature_pos=0.8,
    vespo_k_pos=1.5,
    vespo_lambda_pos=2.5,
    vespo_k_neg=2.5,
    vespo_lambda_neg=1.5,
)


def trl_stub(
    logp,
    *,
    loss_type,
    level,
    beta,
    delta,
    eps,
    eps_high,
    ga,
    spg,
    max_len,
    is_correction,
    top_entropy_quantile=1.0,
    off_policy_mask_threshold=None,
    entropies=None,
):
    """A stand-in GRPOTrainer with the attributes TRL's _compute_loss reads (entropy bonus off)."""
    entropies = torch.zeros_like(logp) if entropies is None else entropies
    stub = SimpleNamespace(
        top_entropy_quantile=top_entropy_quantile,
        off_policy_mask_threshold=off_policy_mask_threshold,
        get_off_policy_mask=TRLGRPOTrainer.get_off_policy_mask,
        importance_sampling_level=level,
        beta=beta,
        loss_type=loss_type,
        epsilon_low=eps,
        epsilon_high=eps_high,
        use_vllm=is_correction,
        vllm_importance_sampling_correction=is_correction,
        model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=ga,
        max_completion_length=max_len,
        accelerator=_Accelerator(),
        _entropy_bonus_enabled=False,
        aux_loss_enabled=False,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        args=SimpleNamespace(use_bias_correction_kl=True, delta=delta, steps_per_generation=spg, **NEW_LOSS_ARGS),
        get_gamma_weights=TRLGRPOTrainer.get_gamma_weights,
        _get_per_token_logps_and_entropies=lambda *a, **k: (logp, entropies, None),
    )
    stub.get_high_entropy_mask = lambda e, m, t: TRLGRPOTrainer.get_high_entropy_mask(stub, e, m, t)
    return stub


def trl_loss(logp, inputs, *, is_correction, **settings):
    if not is_correction:  # TRL's inputs hold the ratio only with vLLM's correction on (vespo reads it if present)
        inputs = {k: v for k, v in inputs.items() if k != "importance_sampling_ratio"}
    stub = trl_stub(logp, is_correction=is_correction, **settings)
    return TRLGRPOTrainer._compute_loss(stub, None, inputs)


def make_inputs(seed: int, truncate: bool):
    g = torch.Generator().manual_seed(seed)
    B, T = 6, 7
    lengths = torch.tensor([7, 3, 5, 7, 1, 6])
    mask = (torch.arange(T)[None, :] < lengths[:, None]).long()
    if truncate:  # rows that hit max length without EOS leave the loss (mask_truncated_completions)
        mask[lengths == T] = 0
    logp = -torch.rand(B, T, generator=g) * 3
    old = logp + 0.3 * torch.randn(B, T, generator=g)
    ref = logp + 0.5 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, generator=g)
    is_ratio = torch.rand(B, T, generator=g) * 2
    return logp, old, ref, adv, mask, is_ratio


def random_round_inputs(mask, adv, old, ref, n_round, is_ratio) -> dict:
    """TRL's inputs dict for make_inputs' tensors (prompt and completion ids are not read: log-probs are given)."""
    return {
        "prompt_ids": torch.zeros(6, 2, dtype=torch.long),
        "prompt_mask": torch.ones(6, 2, dtype=torch.long),
        "completion_ids": torch.zeros(6, 7, dtype=torch.long),
        "completion_mask": mask,
        "advantages": adv,
        "old_per_token_logps": old,
        "ref_per_token_logps": ref,
        "num_items_in_batch": torch.tensor(n_round),
        "importance_sampling_ratio": is_ratio,
    }


CASES = [
    (lt, level, beta, delta, trunc)
    for lt in ("grpo", "bnpo", "dr_grpo", "dapo", "gspo")
    for level in (("sequence",) if lt == "gspo" else ("token", "sequence"))
    for beta in (0.0, 0.04)
    for delta in (None, 1.5)
    for trunc in (False, True)
] + [  # the newer losses (delta is a grpo-family option); vespo computes its own sequence weight: token level
    (lt, level, beta, None, trunc)
    for lt in ("cispo", "sapo", "luspo", "vespo")
    for level in (("token",) if lt == "vespo" else ("token", "sequence"))
    for beta in (0.0, 0.04)
    for trunc in (False, True)
]


@pytest.mark.parametrize("loss_type, level, beta, delta, truncate", CASES)
@pytest.mark.parametrize("is_correction", [False, True])
def test_loss_and_gradient_match_trl(loss_type, level, beta, delta, truncate, is_correction):
    logp0, old, ref, adv, mask, is_ratio = make_inputs(zlib.crc32(f"{loss_type}-{level}".encode()), truncate)
    ga, spg, max_len, eps, eps_high = 2, 4, 7, 0.2, 0.28
    n_round = float(mask.sum() * 3 + 5)  # active tokens of the whole round, not just this micro-batch

    ours_logp = logp0.clone().requires_grad_()
    s = LossSettings(
        loss_type=loss_type,
        importance_sampling_level=level,
        epsilon=eps,
        epsilon_high=eps_high,
        delta=delta,
        beta=beta,
        max_completion_length=max_len,
        gradient_accumulation_steps=ga,
        steps_per_generation=spg,
        **NEW_LOSS_ARGS,
    )
    ours, _ = grpo_loss(
        ours_logp,
        old,
        adv,
        mask,
        s,
        ref_logp=ref if beta else None,
        is_ratio=is_ratio if is_correction else None,
        num_items_in_round=n_round,
    )
    ours.backward()

    trl_logp = logp0.clone().requires_grad_()
    inputs = random_round_inputs(mask, adv, old, ref, n_round, is_ratio)
    theirs = trl_loss(
        trl_logp,
        inputs,
        loss_type="grpo" if loss_type == "gspo" else loss_type,
        level=level,
        beta=beta,
        delta=delta,
        eps=eps,
        eps_high=eps_high,
        ga=ga,
        spg=spg,
        max_len=max_len,
        is_correction=is_correction,
    )
    theirs.backward()

    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(ours_logp.grad, trl_logp.grad, rtol=1e-5, atol=1e-7)


TRL_ADVANTAGES = trl_span(
    TRLGRPOTrainer._generate_and_score_completions,
    "unscorable_mask = torch.isnan(rewards_per_func).all(dim=1)",
    "advantages = torch.nan_to_num(advantages, nan=0.0)",
)
TRL_IS_RATIO = trl_block(
    TRLGRPOTrainer._generate_and_score_completions, "if self.use_vllm and self.vllm_importance_sampling_correction:"
)


def trl_advantages(per_func, weights, num_generations, scale, aggregation):
    """TRL 1.16's advantage lines of _generate_and_score_completions, run as they are (trl_source.py)."""
    from trl.trainer.utils import nanstd as trl_nanstd

    stub = SimpleNamespace(
        multi_objective_aggregation=aggregation,
        scale_rewards=scale,
        reward_weights=weights,
        reward_funcs=[None] * per_func.shape[1],
    )
    ns = dict(self=stub, rewards_per_func=per_func.clone(), num_generations=num_generations, device="cpu")
    ns = run_trl(TRL_ADVANTAGES, {"torch": torch, "nanstd": trl_nanstd, **ns})
    return ns["advantages"], ns["is_std_zero"]


def nan_rewards(seed: int, groups: int = 5, g: int = 4, k: int = 3) -> torch.Tensor:
    """[groups*g, k] rewards with NaNs (a function that did not score a sample), a row no function scored, a
    group whose rewards all agree and a function constant within a group."""
    gen = torch.Generator().manual_seed(seed)
    r = torch.randn(groups * g, k, generator=gen)
    r[torch.rand(groups * g, k, generator=gen) < 0.2] = float("nan")
    r[3] = float("nan")
    r[g : 2 * g] = 1.0
    r[2 * g : 3 * g, 0] = 0.5
    return r


@pytest.mark.parametrize("aggregation", ["sum_then_normalize", "normalize_then_sum"])
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("seed", [0, 1])
def test_advantages_match_trls_own_lines(aggregation, scale, seed):
    """Our advantages (group_advantages, and decoupled_advantages for normalize_then_sum, as the trainer calls
    them) against TRL's advantage lines run on the same rewards, with NaNs and zero-spread groups."""
    from grpoflow.tasks.grpo.advantages import combine_rewards, decoupled_advantages, group_advantages

    G = 4
    per_func = nan_rewards(seed, g=G)
    weights = torch.tensor([1.0, 0.5, 2.0])
    expected, is_std_zero = trl_advantages(per_func, weights, G, scale, aggregation)
    ours, stats = group_advantages(combine_rewards(per_func, weights), G, scale)
    if aggregation == "normalize_then_sum":
        ours, stats["frac_reward_zero_std"] = decoupled_advantages(per_func, weights, G)
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-6)
    assert stats["frac_reward_zero_std"] == pytest.approx(is_std_zero.float().mean().item())
    assert ours.abs().sum() > 0 and not torch.isnan(ours).any()


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
@pytest.mark.parametrize("floor", [None, 0.5])
def test_importance_sampling_ratio_matches_trls_own_lines(mode, floor):
    """The sampler correction against TRL 1.16's own lines of _generate_and_score_completions."""
    import math

    from grpoflow.tasks.grpo.loss import importance_sampling_ratio

    g = torch.Generator().manual_seed(5)
    old = -torch.rand(4, 6, generator=g) * 2
    sampler = old + 0.6 * torch.randn(4, 6, generator=g)
    sampler[1, 2] = float("nan")  # a token the sampler could not score: ratio 1
    mask = torch.ones(4, 6)
    mask[2, 4:] = 0
    cap = 2.0
    stub = SimpleNamespace(
        use_vllm=True,
        vllm_importance_sampling_correction=True,
        vllm_importance_sampling_mode=mode,
        vllm_importance_sampling_clip_min=floor,
        vllm_importance_sampling_clip_max=cap,
    )
    ns = dict(self=stub, completion_mask=mask, tool_mask=None, old_per_token_logps=old)
    ns = run_trl(TRL_IS_RATIO, {"torch": torch, "math": math, "sampling_per_token_logps": sampler, **ns})
    ours = importance_sampling_ratio(old, sampler, mask, mode, cap, floor)
    torch.testing.assert_close(ours, ns["vllm_importance_sampling_ratio"])
    if mode == "token_truncate":
        assert ours[1, 2] == 1.0


class DriftingSampler(TransformersGenerator):
    """The training model's own sampler, reporting each token's log-prob shifted by up to -0.6 nats: a sampling
    engine whose numerics differ from the trainer's (vLLM in bf16, say), so the sampler correction is far from 1."""

    def generate(self, prompts, n, params):
        out = super().generate(prompts, n, params)
        g = torch.Generator().manual_seed(3)
        out.logprobs = [[lp - 0.6 * torch.rand(1, generator=g).item() for lp in row] for row in out.logprobs]
        return out


@pytest.mark.parametrize(
    "loss_type, mode, beta, mu",
    [
        ("dapo", "token_truncate", 0.0, 1),
        ("grpo", "sequence_truncate", 0.04, 1),
        ("bnpo", "token_mask", 0.0, 1),
        ("cispo", "token_truncate", 0.04, 1),
        ("sapo", "sequence_mask", 0.0, 1),
        ("luspo", "token_truncate", 0.0, 1),
        ("vespo", "token_mask", 0.04, 1),
        ("dapo", "token_truncate", 0.0, 2),  # replays cross the optimizer window: the round's own old pass
        ("grpo", "sequence_mask", 0.04, 2),
    ],
)
def test_trainer_micro_step_applies_the_sampler_correction_as_trl(tmp_path, loss_type, mode, beta, mu):
    """A round from a sampler that disagrees with the trainer: the loss of the trainer's micro-step equals TRL's
    _compute_loss on the same micro-batch, old/ref log-probs and importance-sampling ratio (and differs from TRL's
    loss without the correction, so leaving the ratio out of the micro-step fails here).

    TRL computes the old log-probs in a pass of their own whenever the correction is on. With one iteration
    (the round inside one optimizer window) ours makes no such pass: the micro-step takes the ratio from its own
    loss pass, which runs on the same weights. TRL's inputs here still come from a separate pass, so the two
    ways are compared; with num_iterations 2 the round carries its old log-probs and ratio as TRL's does."""
    tok, model = make()
    cfg = GRPOConfig(
        max_steps=1,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        num_iterations=mu,
        num_generations=4,
        max_completion_length=6,
        loss_type=loss_type,
        beta=beta,
        vllm_importance_sampling_mode=mode,
        vllm_importance_sampling_cap=3.0,
        vllm_importance_sampling_clip_min=0.5 if mode.endswith("mask") else None,
        **NEW_LOSS_ARGS,
    )
    torch.manual_seed(0)
    trainer = make_trainer(cfg, tok, model, tmp_path, generator=DriftingSampler(model, tok), is_correction=True)
    r = trainer.new_round()
    if mu == 1:  # no pass of its own: the micro-step's loss pass gives the old log-probs and the ratio
        assert r.old_logp is None and r.is_ratio is None
        old = trainer._logprobs_no_grad(r.batch)  # TRL's separate pass, for TRL's inputs
        rho_round = importance_sampling_ratio(
            old, r.batch.sampler_logp, r.batch.completion_mask, mode, 3.0, cfg.vllm_importance_sampling_clip_min
        )
    else:
        old, rho_round = r.old_logp, r.is_ratio
    m = r.batch.completion_mask.bool()
    rho = rho_round.expand_as(m)[m]
    assert (rho - 1).abs().max() > 0.3, rho  # the correction matters in this round
    it, idx = micro_batch_rows(trainer.batching, 0, r.order)
    window = defaultdict(list)
    trainer._micro_step(r, idx, it)
    trainer.step_metrics.flush(trainer.comm, window)  # the metrics of the micro-step, read at the optimizer step
    if mu == 1:  # the ratio the micro-step used is the one of TRL's separate pass
        mi = r.batch.completion_mask[idx].bool()
        want = rho_round[idx].flatten() if rho_round.shape[1] == 1 else rho_round[idx][mi]
        torch.testing.assert_close(r.correction[0][0], want, rtol=1e-5, atol=1e-6)
    ours = window["loss"][0] / cfg.gradient_accumulation_steps

    mb = r.batch.select(idx)
    with torch.no_grad():
        logp, _ = policy_logprobs(model, mb, cfg.temperature)
    inputs = {
        "prompt_ids": mb.prompt_ids,
        "prompt_mask": mb.prompt_mask,
        "completion_ids": mb.completion_ids,
        "completion_mask": mb.completion_mask,
        "advantages": r.advantages[idx],
        "old_per_token_logps": old[idx],
        "ref_per_token_logps": r.ref_logp[idx] if beta else None,
        "num_items_in_batch": torch.tensor(r.n_tokens),
        "importance_sampling_ratio": rho_round[idx],
    }
    settings = dict(
        loss_type=loss_type,
        level=cfg.importance_sampling_level,
        beta=beta,
        delta=cfg.delta,
        eps=cfg.epsilon,
        eps_high=cfg.effective_epsilon_high,
        ga=cfg.gradient_accumulation_steps,
        spg=trainer.batching.steps_per_generation,
        max_len=cfg.max_completion_length,
    )
    theirs = trl_loss(logp, inputs, **settings, is_correction=True).item()
    uncorrected = trl_loss(logp, inputs, **settings, is_correction=False).item()
    # float32 sums in another order per CPU's kernels (AVX2-only hosts: 1.5e-5 relative in vespo); the correction's
    # own effect, checked next, is over 60x that
    assert ours == pytest.approx(theirs, rel=5e-5, abs=1e-7)
    assert abs(theirs - uncorrected) > 1e-3 * max(abs(theirs), 1e-3)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "cispo", "vespo"])
@pytest.mark.parametrize("quantile, threshold", [(0.4, None), (1.0, 0.05), (0.6, 0.02)])
@pytest.mark.parametrize("is_correction", [False, True])
def test_entropy_and_off_policy_masks_match_trl(loss_type, quantile, threshold, is_correction):
    """top_entropy_quantile and off_policy_mask_threshold against TRL's own get_high_entropy_mask and
    get_off_policy_mask inside _compute_loss: the masked tokens and dropped sequences change loss and gradient."""
    logp0, old, ref, adv, mask, is_ratio = make_inputs(zlib.crc32(f"mask-{loss_type}".encode()), False)
    g = torch.Generator().manual_seed(11)
    entropy = torch.rand(logp0.shape, generator=g) * 3
    sampler = logp0 + 0.3 + 0.2 * torch.randn(logp0.shape, generator=g)  # mean KL ~0.3: over both thresholds
    sampler[0, 2] = float("nan")  # a token the sampler could not score: no evidence either way
    ga, spg, n_round = 2, 4, float(mask.sum() * 3 + 5)
    common = dict(loss_type=loss_type, level="token", beta=0.04, delta=None, eps=0.2, eps_high=0.28)
    s = LossSettings(
        loss_type=loss_type,
        epsilon=0.2,
        epsilon_high=0.28,
        beta=0.04,
        max_completion_length=7,
        gradient_accumulation_steps=ga,
        steps_per_generation=spg,
        top_entropy_quantile=quantile,
        off_policy_mask_threshold=threshold,
        **NEW_LOSS_ARGS,  # what trl_loss gives TRL
    )
    ours_logp = logp0.clone().requires_grad_()
    ours, _ = grpo_loss(
        ours_logp,
        old,
        adv,
        mask,
        s,
        ref_logp=ref,
        is_ratio=is_ratio if is_correction else None,
        num_items_in_round=n_round,
        entropy=entropy,
        sampler_logp=sampler if is_correction else None,
    )
    ours.backward()
    inputs = random_round_inputs(mask, adv, old, ref, n_round, is_ratio)
    if is_correction:  # TRL with vLLM compares the policy with the engine's log-probs
        inputs["sampling_per_token_logps"] = sampler
    trl_logp = logp0.clone().requires_grad_()
    theirs = trl_loss(
        trl_logp,
        inputs,
        **common,
        ga=ga,
        spg=spg,
        max_len=7,
        is_correction=is_correction,
        top_entropy_quantile=quantile,
        off_policy_mask_threshold=threshold,
        entropies=entropy,
    )
    theirs.backward()
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(ours_logp.grad, trl_logp.grad, rtol=1e-5, atol=1e-7)
    plain = LossSettings(**{**s.__dict__, "top_entropy_quantile": 1.0, "off_policy_mask_threshold": None})
    unmasked, _ = grpo_loss(
        logp0,
        old,
        adv,
        mask,
        plain,
        ref_logp=ref,
        is_ratio=is_ratio if is_correction else None,
        num_items_in_round=n_round,
    )
    if quantile < 1 or is_correction:  # (without the engine's log-probs the mask reads old_logp: may keep all)
        assert not torch.isclose(unmasked, ours)  # the masks changed something in this draw
