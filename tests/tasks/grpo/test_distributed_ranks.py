"""Two ranks train exactly as one process: the cases of distributed_cases.py (DDP and FSDP2, LoRA and full
fine-tuning, loss types grpo, dr_grpo and dapo) run once on 2 ranks (ONE torchrun launch with gloo, ~40 s on 2
cores) and once in this process, and every case must agree, to 1e-6 in the weights after each of its two SGD
steps, on the round's completions, rewards and advantages and on the logged metrics."""

import logging

import pytest
import torch

from grpoflow.tasks.config import GRPOConfig
from grpoflow.tasks.grpo.distributed import local_rows
from grpoflow.tasks.launch.dist import Comm
from tests.tasks.grpo.distributed_cases import CASES, RESUMED, ROWS_PER_ROUND, ZERO_ADVANTAGE, run_all, run_case
from tests.tasks.grpo.two_ranks import run_two_ranks

NAMES = [c[0] for c in CASES]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ranks")
    out, checkpoints = folder / "two.pt", folder / "checkpoints"
    run_two_ranks("tests.tasks.grpo.distributed_cases", str(out), str(checkpoints))
    return run_all(Comm()), torch.load(out, weights_only=False), checkpoints


def test_a_group_straddles_the_ranks():
    """The layout the cases run: rank 0 owns rows 0-5 of the round of 12, so the group of rows 4-7 is split."""
    g = GRPOConfig.model_validate(
        {"per_device_train_batch_size": ROWS_PER_ROUND // 4, "steps_per_generation": 2, "num_generations": 4},
        context={"num_processes": 2},
    )
    b = g.batching(2)
    assert b.generation_batch_size == ROWS_PER_ROUND and local_rows(b, 0) == slice(0, 6)
    assert local_rows(b, 0).stop % g.num_generations != 0


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_two_ranks_update_the_weights_as_one_process(runs, name):
    one, two = runs[0][name], runs[1][name]
    assert len(one["weights"]) == len(two["weights"]) == 2  # two optimizer steps, the second on old log-probs
    for step, (a, b) in enumerate(zip(one["weights"], two["weights"]), 1):
        for n in a:
            torch.testing.assert_close(b[n], a[n], atol=1e-6, rtol=0, msg=lambda m, n=n, s=step: f"step {s} {n}: {m}")
    moved = max((one["weights"][1][n] - one["weights"][0][n]).abs().max().item() for n in one["weights"][0])
    assert moved > 1e-3  # the second step changed the weights by far more than the tolerance


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(ZERO_ADVANTAGE))
def test_rows_without_gradient_forward_apart_under_ddp_not_fsdp2(runs, name):
    """Half the prompts' groups get equal rewards (advantage 0: rows without a gradient, micro_plan.py). Under DDP
    such rows go through its inner module in a no-grad forward of their own; a micro-batch with no row to train
    keeps its forward with autograd. Either way every rank makes one forward (and backward) through the wrapper a
    micro-step, so the collectives pair up. FSDP2 keeps one forward of every row. The weights match one process's
    (test_two_ranks_update_the_weights_as_one_process)."""
    strategy = next(c[4] for c in CASES if c[0] == name)
    ranks = runs[1][name]["passes"]
    assert len(ranks) == 2 and all(len(r) == len(ranks[0]) > 0 for r in ranks)
    passes = [p for r in ranks for p in r]
    assert all(p[-1] == 1 for p in passes)  # (kind, ..., forwards through the wrapper)
    assert any(p[0] == "whole" and p[2] == 0 for p in passes)  # a micro-batch of rows without a gradient
    if strategy == "ddp":
        assert any(p[0] == "split" and p[1] > 0 and p[2] > 0 for p in passes)
    else:
        assert all(p[0] == "whole" for p in passes)
    (one,) = runs[0][name]["passes"]  # one process: the rows apart, through the one root
    assert any(p[0] == "split" and p[-1] == 2 for p in one)


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_two_ranks_see_the_same_round_and_advantages(runs, name):
    """Completions seeded by row do not depend on the world size; rewards are gathered and advantages computed over
    the whole round (the group straddling the ranks included; scale_rewards=batch in half the cases)."""
    (a,), (b,) = runs[0][name]["samples"], runs[1][name]["samples"]
    assert len(a) == len(b) == ROWS_PER_ROUND
    assert [s["completion"] for s in b] == [s["completion"] for s in a]
    assert [s["reward"] for s in b] == [s["reward"] for s in a]
    torch.testing.assert_close(torch.tensor([s["advantage"] for s in b]), torch.tensor([s["advantage"] for s in a]))
    assert len({s["completion"] for s in a}) > 1 and any(s["advantage"] != 0 for s in a)


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_two_ranks_log_the_whole_rounds_metrics(runs, name):
    """The metrics rank 0 logs are the whole round's (gathered), and the loss the mean over the ranks."""
    one, two = runs[0][name]["history"], runs[1][name]["history"]
    reward = "half" if name in ZERO_ADVANTAGE else "length"  # the case's reward function
    keys = (
        "reward",
        "reward_std",
        "frac_reward_zero_std",
        f"rewards/{reward}/mean",
        f"rewards/{reward}/std",
        "completions/mean_length",
        "completions/max_length",
        "completions/clipped_ratio",
        "num_tokens",
        "loss",
        "grad_norm",
    )
    for a, b in zip(one, two):
        for k in keys:
            assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-6), k
    if next(c[3] for c in CASES if c[0] == name) == "group":  # as TRL, scale_rewards=batch measures the batch's std
        assert (one[0]["frac_reward_zero_std"] > 0) == (name in ZERO_ADVANTAGE)


@pytest.mark.slow
def test_the_loss_types_are_told_apart(runs):
    """The comparison above is not vacuous: on this round the three normalizers give different updates."""
    one = runs[0]
    first = {n: one[n]["weights"][0] for n in ("grpo-lora", "dr_grpo-lora", "dapo-lora")}

    def gap(x, y):
        return max((first[x][n] - first[y][n]).abs().max().item() for n in first[x])

    assert gap("grpo-lora", "dapo-lora") > 1e-4 and gap("grpo-lora", "dr_grpo-lora") > 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("name", [c[0] for c in RESUMED])
def test_two_ranks_resume_a_sharded_checkpoint_exactly(runs, name):
    """Resumed from the checkpoint written after step 1 (in the middle of a round, with DDP and with FSDP2), a fresh
    2-rank run ends with exactly the weights and metrics of the uninterrupted one."""
    whole, resumed = runs[1]["resumed"][name]["whole"], runs[1]["resumed"][name]["resumed"]
    assert [h["step"] for h in resumed["history"]] == [1, 2, 3]
    for n, w in whole["final"].items():
        assert torch.equal(resumed["final"][n], w), n
    for n, w in whole["weights"][0].items():  # the weights after step 1, as the checkpoint holds them
        assert torch.equal(resumed["loaded"][n], w), n
    assert [h["loss"] for h in resumed["history"]] == [h["loss"] for h in whole["history"]]


@pytest.mark.slow
@pytest.mark.parametrize("case", RESUMED, ids=[c[0] for c in RESUMED])
def test_one_process_resumes_a_two_rank_checkpoint_with_a_warning(runs, case, tmp_path, caplog):
    """Another world size: the sharded model and optimizer load whole into one process, the round in progress is
    generated anew (warned), and the run continues to its last step."""
    checkpoint = runs[2] / case[0] / "whole" / "checkpoint-1"
    with caplog.at_level(logging.WARNING, logger="grpoflow.tasks.grpo.dist_checkpoint"):
        one = run_case(Comm(), *case, checkpoints=tmp_path, resume_from=checkpoint, max_steps=3, per_device=4)
    assert "written by 2 processes, this run has 1" in caplog.text
    for n, w in runs[1]["resumed"][case[0]]["whole"]["weights"][0].items():
        assert torch.equal(one["loaded"][n], w), n
    assert [h["step"] for h in one["history"]] == [1, 2, 3]
