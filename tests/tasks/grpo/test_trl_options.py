"""The GRPO options of TRL 1.16 beyond the loss types, against TRL's own code: the entropy bonus (fixed and
adaptive) through TRL's _compute_loss over a run of micro-batches, sync_ref_model through TRL's
SyncRefModelCallback, multi_objective_aggregation through TRL's advantage lines in one trainer round."""

import copy
import zlib
from types import SimpleNamespace

import pytest
import torch
from trl.trainer.grpo_trainer import GRPOTrainer as TRLGRPOTrainer

from grpoflow.tasks.config import GRPOConfig
from grpoflow.tasks.grpo.loss import LossSettings, grpo_loss
from grpoflow.tasks.grpo.regularizers import EntropyControl
from tests.tasks.grpo.test_trainer import make, make_trainer
from tests.tasks.grpo.test_trl_parity import NEW_LOSS_ARGS, make_inputs, random_round_inputs, trl_advantages, trl_stub


def reward_a(prompts, completions, **columns):
    return [float(len(c[0]["content"]) % 3) for c in completions]


def reward_b(prompts, completions, **columns):
    return [float(c[0]["content"].count("1")) if i % 3 else None for i, c in enumerate(completions)]


@pytest.mark.parametrize(
    "loss_type, coef, adaptive, quantile",
    [("dapo", 0.05, False, 1.0), ("grpo", 0.1, True, 1.0), ("bnpo", 0.0, True, 0.5), ("cispo", 0.02, True, 1.0)],
)
def test_entropy_bonus_matches_trl_over_optimizer_steps(loss_type, coef, adaptive, quantile):
    """Six micro-batches (three optimizer steps of two): each micro-batch's loss and its gradients w.r.t. log-probs
    and entropies, and the coefficient after each step, against TRL's _compute_loss carrying its controller."""
    ga, spg, target, delta = 2, 2, 0.25, 0.04
    settings = dict(loss_type=loss_type, level="token", beta=0.0, delta=None, eps=0.2, eps_high=0.28)
    s = LossSettings(
        loss_type=loss_type,
        epsilon=0.2,
        epsilon_high=0.28,
        max_completion_length=7,
        gradient_accumulation_steps=ga,
        steps_per_generation=spg,
        top_entropy_quantile=quantile,
        **NEW_LOSS_ARGS,
    )
    ours_ctl = EntropyControl(coef, adaptive, target, delta, coef_min=0.0, coef_max=0.1)
    stub = None
    coefs, bonus_grads = [], []
    for micro in range(6):
        logp0, old, ref, adv, mask, is_ratio = make_inputs(zlib.crc32(f"ent-{loss_type}-{micro}".encode()), False)
        g = torch.Generator().manual_seed(micro)
        level = 0.15 if micro < 2 or micro >= 4 else 0.4  # below, then above the target: the coef moves both ways
        ent0 = torch.rand(logp0.shape, generator=g) * 2 * level
        n_round = float(mask.sum() * 2)
        inputs = random_round_inputs(mask, adv, old, ref, n_round, is_ratio)
        del inputs["importance_sampling_ratio"]

        logp, ent = logp0.clone().requires_grad_(), ent0.clone().requires_grad_()
        loss, extras = grpo_loss(
            logp, old, adv, mask, s, num_items_in_round=n_round, entropy=ent, entropy_coef=ours_ctl.applied()
        )
        loss.backward()
        ours_ctl.observe(float(extras["entropy_sum"]), float(extras["entropy_tokens"]))

        t_logp, t_ent = logp0.clone().requires_grad_(), ent0.clone().requires_grad_()
        fresh = trl_stub(t_logp, ga=ga, spg=spg, max_len=7, is_correction=False, top_entropy_quantile=quantile,
                         entropies=t_ent, **settings)  # fmt: skip
        if stub is None:  # TRL's controller state lives on the trainer across micro-batches
            stub = fresh
            stub._entropy_bonus_enabled = coef != 0.0 or adaptive
            stub.entropy_coef, stub.use_adaptive_entropy = coef, adaptive
            stub._last_world_entropy, stub._entropy_window_stats = float("inf"), None
            stub.args.entropy_target, stub.args.entropy_coef_delta = target, delta
            stub.args.entropy_coef_min, stub.args.entropy_coef_max = 0.0, 0.1
        stub._get_per_token_logps_and_entropies = fresh._get_per_token_logps_and_entropies
        stub.accelerator.sync_gradients = micro % ga == ga - 1  # the last micro-batch of an optimizer step
        theirs = TRLGRPOTrainer._compute_loss(stub, None, inputs)
        theirs.backward()

        torch.testing.assert_close(loss, theirs, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(logp.grad, t_logp.grad, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(ent.grad, t_ent.grad, rtol=1e-5, atol=1e-7)
        bonus_grads.append(ent.grad.abs().sum().item())
        if micro % ga == ga - 1:
            ours_ctl.step()
            assert ours_ctl.coef == pytest.approx(stub.entropy_coef, abs=1e-12)
            assert ours_ctl.last_entropy == pytest.approx(stub._last_world_entropy, rel=1e-6) or not adaptive
            coefs.append(ours_ctl.coef)
    if adaptive:
        assert len(set(coefs)) > 1  # the controller moved
        assert 0 in bonus_grads  # the bonus is off while the last step's entropy is above the target
    assert max(bonus_grads) > 0  # and on somewhere: the comparison covers its gradient


def test_adaptive_entropy_runs_in_the_trainer_and_resumes(tmp_path):
    tok, model = make()
    cfg = GRPOConfig(
        max_steps=2,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        num_generations=4,
        max_completion_length=6,
        use_adaptive_entropy=True,
        entropy_coef=0.01,
        entropy_coef_delta=0.003,
        entropy_target=100.0,  # always above: the coef grows every step
        save_steps=1,
    )
    torch.manual_seed(0)
    trainer = make_trainer(cfg, tok, model, tmp_path)
    trainer.train()
    assert [h["entropy_coef"] for h in trainer.history] == pytest.approx([0.013, 0.016])
    again = make_trainer(cfg, tok, make()[1], tmp_path)
    again.load_checkpoint(tmp_path / "checkpoint-1")
    assert again.entropy.coef == pytest.approx(0.013) and again.entropy.last_entropy < 100


def test_sync_ref_model_follows_trls_callback(tmp_path):
    """Full fine-tuning with beta > 0: after every optimizer step TRL's SyncRefModelCallback.on_step_end runs on a
    copy of the reference with the real policy; the trainer's own reference must end equal to it."""
    from accelerate import Accelerator
    from trl.trainer.callbacks import SyncRefModelCallback

    torch.manual_seed(0)
    tok, model = make(lora=False)
    ref = copy.deepcopy(model).eval().requires_grad_(False)
    start = [p.clone() for p in ref.parameters()]
    cfg = GRPOConfig(
        max_steps=3,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=1,
        num_generations=4,
        max_completion_length=6,
        beta=0.04,
        learning_rate=1e-3,
        sync_ref_model=True,
        ref_model_mixup_alpha=0.3,
        ref_model_sync_steps=2,
    )
    trainer = make_trainer(cfg, tok, model, tmp_path, ref_model=ref)
    shadow = copy.deepcopy(ref)
    callback = SyncRefModelCallback(ref_model=shadow, accelerator=Accelerator(cpu=True))
    args = SimpleNamespace(ref_model_sync_steps=cfg.ref_model_sync_steps, ref_model_mixup_alpha=0.3)
    ours_after_step = trainer._after_step

    def after_step(window):
        ours_after_step(window)
        callback.on_step_end(args, SimpleNamespace(global_step=trainer.step), None, model=trainer.model)

    trainer._after_step = after_step
    trainer.train()
    for mine, theirs in zip(ref.parameters(), shadow.parameters(), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0)
    assert any(not torch.equal(p, q) for p, q in zip(ref.parameters(), start))  # step 2 moved it


def test_sync_ref_model_is_refused_where_trl_refuses():
    from grpoflow.tasks.config import ConfigError, config_from_dict

    with pytest.raises(ConfigError, match="sync_ref_model needs beta > 0"):
        config_from_dict({"grpo": {"sync_ref_model": True}})
    with pytest.raises(ConfigError, match="full fine-tuning"):
        config_from_dict({"grpo": {"sync_ref_model": True, "beta": 0.04}})
    full = {"model": {"lora": {"enabled": False}}, "export": {"adapter": False}}
    cfg = config_from_dict({"grpo": {"sync_ref_model": True, "beta": 0.04}, **full})
    assert cfg.grpo.sync_ref_model


@pytest.mark.parametrize("aggregation", ["sum_then_normalize", "normalize_then_sum"])
def test_trainer_round_advantages_match_trl(tmp_path, aggregation):
    """A real round with two reward functions (one leaving rows unscored): its advantages equal TRL's advantage
    lines on the round's rewards, and the two aggregations differ on it."""
    tok, model = make()
    cfg = GRPOConfig(
        max_steps=1,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=6,
        reward_funcs=["a", "b"],  # names only: the trainer is handed the functions
        reward_weights=[1.0, 0.5],
        multi_objective_aggregation=aggregation,
        shuffle_generation_batch=False,
    )
    torch.manual_seed(0)
    trainer = make_trainer(cfg, tok, model, tmp_path, funcs=[("a", reward_a), ("b", reward_b)])
    batch, adv, stats, samples = trainer.generate_round()
    nan = float("nan")
    per_func = torch.tensor([[s["rewards/a"], s["rewards/b"]] for s in samples]).nan_to_num(nan)
    expected, is_std_zero = trl_advantages(per_func, torch.tensor([1.0, 0.5]), 4, "group", aggregation)
    torch.testing.assert_close(adv, expected, rtol=1e-5, atol=1e-6)
    assert stats["frac_reward_zero_std"] == pytest.approx(is_std_zero.float().mean().item())
    other = "normalize_then_sum" if aggregation == "sum_then_normalize" else "sum_then_normalize"
    assert not torch.allclose(expected, trl_advantages(per_func, torch.tensor([1.0, 0.5]), 4, "group", other)[0])
