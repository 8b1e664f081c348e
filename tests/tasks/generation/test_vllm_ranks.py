"""vLLM per rank: on 2 ranks each rank samples its rows with its own co-located engine, and a run equals the same run
on one process: the same completions (seeded by their row), the same weights after each SGD step (to 1e-6), and
each engine follows the trained weights after every optimizer step (DDP and FSDP2, LoRA and full fine-tuning).
The cases are distributed_vllm_cases.py: ONE torchrun launch (gloo) and one plain process, run side by side."""

import os
import subprocess
import sys

import pytest
import torch

from grpoflow.tasks.generation.vllm_engine import engine_kwargs
from grpoflow.tasks.generation.vllm_ranks import executor_backend, row_requests
from grpoflow.tasks.generation.vllm_support import unsupported_reason
from tests.paths import REPO
from tests.tasks.generation.distributed_vllm_cases import CASES, ROWS_PER_ROUND, TINY

NAMES = [c[0] for c in CASES]
vllm_problem = unsupported_reason(["Qwen2ForCausalLM"], head_dim=TINY.hidden_size // TINY.num_attention_heads)
needs_vllm = pytest.mark.skipif(vllm_problem is not None, reason=f"vLLM unavailable: {vllm_problem}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(one process, two ranks): both launched at once, each writing its results to its own folder."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GRPOFLOW_PROGRESS": "0"}
    outs, procs = [], []
    for launcher in ([], ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]):
        out = tmp_path_factory.mktemp("vllm-ranks") / "results.pt"
        cmd = [sys.executable, *launcher, "-m", "tests.tasks.generation.distributed_vllm_cases", str(out)]
        log = open(out.with_suffix(".log"), "w")  # noqa: SIM115 - closed below
        procs.append((subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT), log))
        outs.append(out)
    for (proc, log), out in zip(procs, outs):
        rc = proc.wait(timeout=900)
        log.close()
        assert rc == 0, out.with_suffix(".log").read_text()[-8000:]
    return [torch.load(out, weights_only=False) for out in outs]


def test_one_engine_per_rank_joins_torchruns_group():
    assert executor_backend(1) == "uni" and executor_backend(2) == "external_launcher"
    from grpoflow.tasks.config import GenerationConfig

    kw = dict(model_path="m", dtype="float32", max_model_len=64, seed=0, hf_config=TINY, sleep_available=False)
    assert engine_kwargs(GenerationConfig(), device="cpu", **kw)["distributed_executor_backend"] == "uni"
    two = engine_kwargs(GenerationConfig(), device="cuda", world=2, **kw)
    assert two["distributed_executor_backend"] == "external_launcher" and "tensor_parallel_size" not in two


def test_vllm_is_accepted_on_several_processes_and_with_row_seeds():
    from grpoflow.tasks.config import load_config

    for overrides in (["distributed.nproc_per_node=2"], ["distributed.seed_by_row=true"]):
        cfg = load_config(None, [*overrides, "generation.backend=vllm"])
        assert cfg.generation.backend == "vllm" and cfg.distributed.row_seeded


def test_row_requests_are_prompt_major_with_one_seed_each():
    assert row_requests([[1], [2]], 2, [10, 11, 12, 13]) == [([1], 10), ([1], 11), ([2], 12), ([2], 13)]
    with pytest.raises(ValueError, match="row_seeds: 3 seeds for 4 completions"):
        row_requests([[1], [2]], 2, [10, 11, 12])


@needs_vllm
@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_two_ranks_sample_the_same_completions_as_one_process(runs, name):
    """Both rounds (the second after an optimizer step and a weight sync on every rank): the same completions,
    rewards and advantages, the group straddling the ranks included."""
    one, two = runs[0][name]["samples"], runs[1][name]["samples"]
    assert len(one) == len(two) == 2
    for a, b in zip(one, two):
        assert len(a) == len(b) == ROWS_PER_ROUND
        assert [s["completion"] for s in b] == [s["completion"] for s in a]
        assert [s["reward"] for s in b] == [s["reward"] for s in a]
        torch.testing.assert_close(torch.tensor([s["advantage"] for s in b]), torch.tensor([s["advantage"] for s in a]))
    assert [s["completion"] for s in one[0]] != [s["completion"] for s in one[1]]  # the rounds differ
    assert len({s["completion"] for s in one[0]}) > 1 and any(s["advantage"] != 0 for s in one[0])


@needs_vllm
@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_two_ranks_update_the_weights_as_one_process(runs, name):
    """The sampler's log-probs enter the loss (the importance-sampling correction): the weights agree only if
    both engines sampled and scored alike."""
    one, two = runs[0][name]["weights"], runs[1][name]["weights"]
    assert len(one) == len(two) == 2
    for step, (a, b) in enumerate(zip(one, two), 1):
        for n in a:
            torch.testing.assert_close(b[n], a[n], atol=1e-6, rtol=0, msg=lambda m, n=n, s=step: f"step {s} {n}: {m}")
    assert max((one[1][n] - one[0][n]).abs().max().item() for n in one[0]) > 1e-3  # the step moved the weights


@needs_vllm
@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_every_engine_follows_the_trained_weights(runs, name):
    """Each rank's engine synced once per optimizer step that preceded a round (decided from the step, alike on
    every rank), and its log-probs match the trainer's on every rank's tokens (max over the ranks) after it."""
    for run in runs:
        assert run[name]["syncs"] == [1] * len(run[name]["syncs"])
        gaps = [h["sampling/sampling_logp_difference/max"] for h in run[name]["history"]]
        assert len(gaps) == 2 and max(gaps) < 1e-4, gaps


@needs_vllm
@pytest.mark.slow
def test_a_resumed_run_resyncs_every_engine_after_the_load(runs):
    """Resumed from the sharded checkpoint of step 2 (FSDP2, LoRA), a fresh trainer whose engines hold the fresh
    model's weights samples round 3 from the loaded ones: the same completions and final weights as the run that
    was not interrupted, on 1 process and on 2 ranks."""
    for run in runs:
        whole, resumed = run["resumed"]["whole"], run["resumed"]["resumed"]
        assert [h["step"] for h in resumed["history"]] == [1, 2, 3] and len(resumed["samples"]) == 1
        assert [s["completion"] for s in resumed["samples"][0]] == [s["completion"] for s in whole["samples"][2]]
        assert resumed["syncs"] == [1] * len(resumed["syncs"])  # after the load, before round 3
        for n, w in whole["final"].items():
            assert torch.equal(resumed["final"][n], w), n
