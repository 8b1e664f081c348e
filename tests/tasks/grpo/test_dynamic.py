"""DAPO's dynamic sampling and overlong reward shaping (tasks/grpo/dynamic.py), alone and through the trainer."""

import pytest
import torch

from grpoflow.tasks.config import ConfigError, GRPOConfig, config_from_dict
from grpoflow.tasks.grpo.advantages import combine_rewards, nanstd
from grpoflow.tasks.grpo.dynamic import Drawn, fill_round, overlong_penalty
from tests.tasks.grpo.test_trainer import make, make_trainer

G = 3


def dapo_eq13(length: int, max_len: int, buffer: int) -> float:
    """DAPO (arXiv 2503.14476) eq. 13, written from the paper's piecewise definition."""
    if length <= max_len - buffer:
        return 0.0
    if length <= max_len:
        return ((max_len - buffer) - length) / buffer
    return -1.0


@pytest.mark.parametrize("max_len, buffer, factor", [(32, 8, 1.0), (6, 6, 0.5), (10, 1, 2.0)])
def test_overlong_penalty_is_daps_eq13(max_len, buffer, factor):
    lengths = torch.arange(0, max_len + 3)
    got = overlong_penalty(lengths, max_len, buffer, factor)
    expected = torch.tensor([factor * dapo_eq13(int(n), max_len, buffer) for n in lengths])
    torch.testing.assert_close(got, expected)
    assert got[max_len] == -factor and got[max_len - buffer] == 0  # the ramp's two ends


def batch(prompts: list[int], rewards: list[list[float]]) -> Drawn:
    """A scored batch: prompt p's G completions got rewards[i] (one reward function)."""
    rows = [{"prompt": f"p{p}"} for p in prompts for _ in range(G)]
    ids = [[p, j] for p in prompts for j in range(G)]
    per_func = torch.tensor([[r] for rs in rewards for r in rs])
    return Drawn(prompts, ids, [[0.0, 0.0]] * len(ids), ["stop"] * len(ids), rows, [str(i) for i in ids], per_func)


def source(*batches: Drawn):
    """draw(n): the next prepared batch, which must hold n prompts (the missing places)."""
    queue = list(batches)

    def draw(n: int) -> Drawn:
        b = queue.pop(0)
        assert len(b.idx) == n
        return b

    return draw


FLAT, NAN = [1.0, 1.0, 1.0], [float("nan")] * G


def test_a_round_without_flat_groups_is_kept_as_it_is():
    first = batch([0, 1], [[0.0, 1.0, 0.0], [2.0, 1.0, 1.0]])
    out, stats = fill_round(first, source(), None, G, max_rounds=3)
    assert out.idx == [0, 1] and out.completion_ids == first.completion_ids
    assert stats == {
        "dynamic_sampling/extra_rounds": 0.0,
        "dynamic_sampling/dropped_groups": 0.0,
        "dynamic_sampling/filled_groups": 0.0,
        "dynamic_sampling/prompts_drawn": 2.0,
    }


def test_flat_groups_are_replaced_by_fresh_prompts():
    first = batch([0, 1, 2], [FLAT, [0.0, 1.0, 1.0], NAN])  # prompts 0 (all agree) and 2 (unscored) go
    second = batch([3, 4], [[0.0, 0.0, 0.0], [1.0, 0.0, 0.5]])  # 3 agrees too
    third = batch([5], [[0.0, 3.0, 0.0]])
    out, stats = fill_round(first, source(second, third), None, G, max_rounds=3)
    assert out.idx == [1, 4, 5]
    assert [r["prompt"] for r in out.rows] == [f"p{p}" for p in (1, 4, 5) for _ in range(G)]
    assert out.completion_ids == [[p, j] for p in (1, 4, 5) for j in range(G)]
    std = nanstd(combine_rewards(out.per_func).view(-1, G), dim=1)
    assert (std > 0).all()
    assert stats["dynamic_sampling/extra_rounds"] == 2 and stats["dynamic_sampling/dropped_groups"] == 3
    assert stats["dynamic_sampling/filled_groups"] == 0 and stats["dynamic_sampling/prompts_drawn"] == 6


def test_a_round_still_short_is_filled_with_dropped_groups():
    first = batch([0, 1], [FLAT, [0.0, 1.0, 1.0]])
    second = batch([2], [FLAT])
    out, stats = fill_round(first, source(second), None, G, max_rounds=1)
    assert out.idx == [1, 0]  # the kept group first, then the first dropped one: the round stays full
    assert stats["dynamic_sampling/filled_groups"] == 1 and stats["dynamic_sampling/extra_rounds"] == 1
    out, stats = fill_round(first, source(), None, G, max_rounds=0)  # no draw at all (an empty source raises)
    assert out.idx == [1, 0] and stats["dynamic_sampling/extra_rounds"] == 0


def test_weights_decide_what_agrees():
    two = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]])  # the sum agrees, the first function does not
    first = Drawn([0], [[0]] * 3, [[0.0]] * 3, ["stop"] * 3, [{}] * 3, ["a"] * 3, two)
    fresh = Drawn([1], [[1]] * 3, [[0.0]] * 3, ["stop"] * 3, [{}] * 3, ["b"] * 3, two * torch.tensor([1.0, 0.0]))
    out, stats = fill_round(first, source(fresh), None, G, max_rounds=1)
    assert out.idx == [1] and stats["dynamic_sampling/dropped_groups"] == 1
    out, stats = fill_round(first, source(), torch.tensor([1.0, 0.5]), G, max_rounds=1)
    assert out.idx == [0] and stats["dynamic_sampling/dropped_groups"] == 0


def flat_for_small(prompts, completions, question, **columns):
    """0 for every completion of the prompts 0+0 and 1+1 (no spread), the completion's length otherwise."""
    return [0.0 if q in ("0+0", "1+1") else float(len(c[0]["content"])) for q, c in zip(question, completions)]


def test_trainer_rounds_with_dynamic_sampling(tmp_path):
    tok, model = make()
    common = dict(max_steps=1, per_device_train_batch_size=8, num_generations=4, max_completion_length=6)
    torch.manual_seed(0)
    plain = make_trainer(GRPOConfig(**common), tok, model, tmp_path / "a", funcs=[("f", flat_for_small)], n_rows=6)
    _, adv, stats, _ = plain.generate_round()
    assert not any(k.startswith("dynamic_sampling/") for k in stats)  # off: nothing new in the round
    cfg = GRPOConfig(**common, dynamic_sampling=True, dynamic_sampling_max_rounds=4)
    trainer = make_trainer(cfg, tok, model, tmp_path / "b", funcs=[("f", flat_for_small)], n_rows=6)
    dropped = full = 0
    for _ in range(3):
        batch_, adv, stats, samples = trainer.generate_round()
        questions = [s["question"] for s in samples]
        dropped += stats["dynamic_sampling/dropped_groups"]
        assert len(questions) == 8 and batch_.completion_ids.shape[0] == 8  # the layout never changes
        if stats["dynamic_sampling/filled_groups"] == 0:
            full += 1
            assert not {"0+0", "1+1"} & set(questions)
            assert (adv.view(-1, 4).abs().sum(1) > 0).all()
    assert dropped > 0 and full > 0  # 0+0 and 1+1 came up and were replaced by fresh prompts


def test_trainer_adds_the_overlong_reward(tmp_path):
    tok, model = make()
    cfg = GRPOConfig(
        max_steps=1,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=6,
        overlong_buffer_length=3,
        overlong_penalty_factor=0.5,
        reward_funcs=["len"],
        reward_weights=[2.0],
    )
    torch.manual_seed(0)
    trainer = make_trainer(cfg, tok, model, tmp_path, funcs=[("len", flat_for_small)], n_rows=6)
    batch_, adv, stats, samples = trainer.generate_round()
    lengths = batch_.completion_mask.sum(1)  # no truncation mask: every sampled token counts
    expected = overlong_penalty(lengths, 6, 3, 0.5)
    assert [s["rewards/overlong"] for s in samples] == pytest.approx(expected.tolist())
    assert [s["reward"] for s in samples] == pytest.approx(
        [2 * s["rewards/len"] + s["rewards/overlong"] for s in samples]
    )
    assert stats["rewards/overlong/mean"] == pytest.approx(expected.mean().item())
    assert expected.min() < 0  # this round has completions in the buffer


def test_config_bounds():
    with pytest.raises(ConfigError, match="overlong_buffer_length"):
        config_from_dict({"grpo": {"overlong_buffer_length": 300, "max_completion_length": 256}})
    with pytest.raises(ConfigError, match="dynamic_sampling_max_rounds"):
        config_from_dict({"grpo": {"dynamic_sampling_max_rounds": -1}})
