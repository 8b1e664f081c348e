"""FSDP2 keeps gradients sharded under gradient accumulation: 2 ranks (ONE torchrun launch with gloo, ~20 s on 2
cores; the runs of fsdp2_accumulation_cases.py) hold 1/2 of the model's gradient bytes after every micro-step's
backward, and train the weights one process trains."""

import pytest
import torch

from grpoflow.tasks.launch.dist import Comm
from tests.tasks.grpo.fsdp2_accumulation_cases import MICRO_STEPS, run
from tests.tasks.grpo.two_ranks import run_two_ranks


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp2_accumulation") / "two.pt"
    run_two_ranks("tests.tasks.grpo.fsdp2_accumulation_cases", str(out))
    return run(Comm()), torch.load(out, weights_only=False)


@pytest.mark.slow
def test_each_rank_holds_half_the_gradient_across_the_micro_steps(runs):
    _, two = runs
    total = two["sharded"]["total_bytes"]
    per_rank = [sharded for sharded, _ in two["held_per_rank"]]
    assert all(len(held) == 2 * MICRO_STEPS for held in per_rank)  # two optimizer steps of 4 micro-steps
    for held in per_rank:
        # FSDP2 pads a parameter's first dimension to a multiple of the world size: a few rows more than half
        assert all(0 < h <= total / 2 * 1.05 for h in held), (held, total)
    assert all(a + b >= total for a, b in zip(*per_rank))  # the two halves make the whole gradient


@pytest.mark.slow
def test_without_gradient_sync_fsdp2_would_hold_the_whole_gradient(runs):
    """The control: with set_requires_gradient_sync(False) between micro-steps (what gradient_sync did before) every
    rank holds the unsharded float32 gradient of the whole model until the window's last backward, so the
    measurement sees it."""
    _, two = runs
    total = two["no_sync"]["total_bytes"]
    for _, held in two["held_per_rank"]:
        between = [h for i, h in enumerate(held) if (i + 1) % MICRO_STEPS]  # the non-final micro-steps
        assert all(h >= total for h in between), (between, total)


@pytest.mark.slow
def test_the_sharded_accumulation_trains_as_one_process(runs):
    one, two = runs
    for name, two_run in (("sharded", two["sharded"]), ("no_sync", two["no_sync"])):
        assert len(one["weights"]) == len(two_run["weights"]) == 2
        for step, (a, b) in enumerate(zip(one["weights"], two_run["weights"]), 1):
            for n in a:
                torch.testing.assert_close(
                    b[n], a[n], atol=1e-6, rtol=0, msg=lambda m, n=n, s=step, r=name: f"{r} step {s} {n}: {m}"
                )
    moved = max((one["weights"][1][n] - one["weights"][0][n]).abs().max().item() for n in one["weights"][0])
    assert moved > 1e-3  # the steps moved the weights by far more than the tolerance
