"""Distributed GRPO without processes: the distributed config section, TRL's batch layout over W processes, per-row
seeded sampling, the torchrun command line and how a failed launch is reported (the 2-process runs are in
test_distributed_ranks.py)."""

import json
import sys

import pytest
import torch

from grpoflow.tasks.config import ConfigError, GRPOConfig, config_from_dict, load_config
from grpoflow.tasks.generation.transformers_loop import TransformersGenerator
from grpoflow.tasks.generation.types import SamplingParams
from grpoflow.tasks.grpo.distributed import check_fsdp2_placement, local_rows, rounds_done, row_seed, wrap_root
from grpoflow.tasks.launch.dist import Comm, resolve_backend
from grpoflow.tasks.launch.torchrun import failure, rank_errors, torchrun_command, write_rank_error
from grpoflow.tasks.pipeline.shell import USER_ERRORS
from tests.tasks.grpo.test_trainer import make


def test_one_process_by_default():
    d = load_config().distributed
    assert (d.nproc_per_node, d.nnodes, d.world_size, d.strategy, d.backend) == (1, 1, 1, "ddp", "auto")
    assert d.row_seeded is False  # the single-process path samples exactly as before
    two = config_from_dict({"distributed": {"nproc_per_node": 2}}).distributed
    assert two.world_size == 2 and two.row_seeded is True
    assert config_from_dict({"distributed": {"seed_by_row": True}}).distributed.row_seeded is True


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["distributed.nproc_per_node=0"], "distributed.nproc_per_node"),
        (["distributed.strategy=deepspeed"], "distributed.strategy"),
        (["distributed.backend=mpi"], "distributed.backend"),
        (["distributed.timeout_s=0"], "distributed.timeout_s"),
        (["distributed.nnodes=2", "distributed.node_rank=2"], "node_rank (2) must be less than nnodes (2)"),
        (["distributed.rdzv_endpoint=head:29400"], "are for nnodes > 1"),
        (
            ["distributed.nnodes=2", "distributed.rdzv_endpoint=h:1", "distributed.master_addr=h"],
            "rdzv_endpoint and master_addr",
        ),
        (
            ["distributed.nproc_per_node=2", "grpo.per_device_train_batch_size=8", "grpo.generation_batch_size=24"],
            "grpo: generation_batch_size (24) must be divisible by per_device_train_batch_size * num_processes "
            "(8 * 2 = 16)",
        ),
        (
            ["distributed.nproc_per_node=2", "distributed.strategy=fsdp2", "model.lora.enabled=false"]
            + ["export.adapter=false", "grpo.beta=0.04"],
            "distributed.strategy=fsdp2 with grpo.beta > 0 and full fine-tuning",
        ),
        (
            ["distributed.nproc_per_node=2", "distributed.strategy=fsdp2", "model.load_in_4bit=true"],
            "cannot shard model.load_in_4bit",
        ),
        (
            ["distributed.nproc_per_node=2", "distributed.strategy=fsdp2", "grpo.optim=adamw_8bit"],
            "grpo.optim=adamw_8bit with distributed.strategy=fsdp2: bitsandbytes' 8-bit optimizers fault on FSDP2's "
            "sharded (DTensor) parameters (bitsandbytes issue #1633",
        ),
        (
            ["distributed.nnodes=2", "distributed.rdzv_endpoint=h:1", "distributed.strategy=fsdp2"]
            + ["grpo.optim=paged_adamw_8bit"],
            "grpo.optim=paged_adamw_8bit with distributed.strategy=fsdp2",
        ),
        (
            ["distributed.nproc_per_node=2", "run.device=cuda:1"],
            "run.device=cuda:1 with distributed (nproc_per_node * nnodes = 2): each GRPO process takes the GPU of its "
            "LOCAL_RANK",
        ),
    ],
)
def test_bad_distributed_config_names_the_key(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert message in str(err.value)


def test_what_fsdp2_and_several_processes_still_take():
    """The refusals above are narrow: an 8-bit optimizer with DDP (the GSM8K config's), torch AdamW with FSDP2, and a
    bare cuda with several processes all load."""
    two = ["distributed.nproc_per_node=2"]
    assert load_config(None, [*two, "grpo.optim=adamw_8bit"]).grpo.optim == "adamw_8bit"
    assert load_config(None, [*two, "distributed.strategy=fsdp2"]).distributed.strategy == "fsdp2"
    assert load_config(None, [*two, "run.device=cuda"]).run.device == "cuda"
    assert load_config(None, ["run.device=cuda:1", "grpo.optim=adamw_8bit"]).run.device == "cuda:1"  # one process


def test_batching_over_processes_is_trls():
    """generation_batch_size = per_device_train_batch_size * num_processes * steps_per_generation; each process
    owns L = per_device_train_batch_size * steps_per_generation rows of it."""
    g = GRPOConfig(per_device_train_batch_size=3, gradient_accumulation_steps=2, num_generations=3)
    one, two = g.batching(), g.batching(2)
    assert (one.generation_batch_size, one.unique_prompts, one.rows_per_process, one.num_processes) == (6, 2, 6, 1)
    assert (two.generation_batch_size, two.unique_prompts, two.rows_per_process, two.num_processes) == (12, 4, 6, 2)
    assert [local_rows(two, r) for r in (0, 1)] == [slice(0, 6), slice(6, 12)]
    # a TRL config tuned for 2 processes: its round (2 * 2 = 4 completions, one prompt) does not fit one process,
    # and its one group of 4 straddles the two ranks
    cfg = config_from_dict(
        {"distributed": {"nproc_per_node": 2}, "grpo": {"per_device_train_batch_size": 2, "num_generations": 4}}
    )
    b = cfg.grpo.batching(2)
    assert (b.generation_batch_size, b.unique_prompts, local_rows(b, 1)) == (4, 1, slice(2, 4))
    with pytest.raises(ConfigError, match="grpo: generation_batch_size"):
        config_from_dict({"grpo": {"per_device_train_batch_size": 2, "num_generations": 4}})
    with_gbs = GRPOConfig(per_device_train_batch_size=2, generation_batch_size=8, num_generations=4).batching(2)
    assert (with_gbs.steps_per_generation, with_gbs.rows_per_process) == (2, 4)


def test_rounds_and_row_seeds_depend_on_the_position_in_the_run_only():
    assert rounds_done(epoch=0, cursor=0, n_rows=10, unique_prompts=3) == 0
    assert rounds_done(epoch=1, cursor=2, n_rows=10, unique_prompts=3) == 4
    seeds = {row_seed(0, r, i) for r in range(3) for i in range(8)}
    assert len(seeds) == 24 and all(0 <= s < 2**63 for s in seeds)
    assert row_seed(0, 1, 5) == row_seed(0, 1, 5) != row_seed(1, 1, 5)


def test_row_seeded_completions_do_not_depend_on_the_batch():
    """What makes completions independent of the world size: a row's tokens depend on its seed, not on the rows
    sampled beside it (the 4 rows drawn together, in two halves, or one by one with another chunk size)."""
    tok, model = make()
    prompts = [tok("What is 3 + 4?")["input_ids"], tok("What is 1 + 2?")["input_ids"]]
    params = SamplingParams(max_new_tokens=6, temperature=1.0)
    seeds = [row_seed(7, 0, i) for i in range(4)]
    whole = TransformersGenerator(model, tok).generate(prompts, 2, params, row_seeds=seeds)
    halves = [
        TransformersGenerator(model, tok).generate([p], 2, params, row_seeds=seeds[2 * i : 2 * i + 2])
        for i, p in enumerate(prompts)
    ]
    singles = TransformersGenerator(model, tok, batch_size=1).generate(prompts, 2, params, row_seeds=seeds)
    assert whole.completion_ids == halves[0].completion_ids + halves[1].completion_ids == singles.completion_ids
    other = TransformersGenerator(model, tok).generate(prompts, 2, params, row_seeds=[s + 1 for s in seeds])
    assert other.completion_ids != whole.completion_ids
    with pytest.raises(ValueError, match="row_seeds: 3 seeds for 4 completions"):
        TransformersGenerator(model, tok).generate(prompts, 2, params, row_seeds=seeds[:3])


def test_one_process_collectives_return_their_input():
    comm = Comm()
    x = torch.arange(4.0)
    assert comm.all_gather(x) is x and comm.all_reduce(x) is x and comm.all_gather_object({"a": 1}) == [{"a": 1}]
    assert comm.is_main and comm.world == 1


def test_backend_auto_is_nccl_on_cuda_and_gloo_on_cpu():
    assert (resolve_backend("auto", "cuda"), resolve_backend("auto", "cpu"), resolve_backend("gloo", "cuda")) == (
        "nccl",
        "gloo",
        "gloo",
    )
    with pytest.raises(ValueError, match="distributed.backend=nccl needs CUDA"):
        resolve_backend("nccl", "cpu")


def test_torchrun_command():
    one = config_from_dict({"distributed": {"nproc_per_node": 2}}).distributed
    assert torchrun_command(one, "m.w", ["spec.json"]) == [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "-m",
        "m.w",
        "spec.json",
    ]
    multi = config_from_dict(
        {"distributed": {"nproc_per_node": 8, "nnodes": 2, "node_rank": 1, "rdzv_endpoint": "head:29400"}}
    ).distributed
    assert torchrun_command(multi, "m.w", [])[3:] == [
        "--nnodes=2",
        "--node_rank=1",
        "--rdzv_backend=c10d",
        "--rdzv_endpoint=head:29400",
        "--nproc_per_node=8",
        "-m",
        "m.w",
    ]
    pet = config_from_dict({"distributed": {"nnodes": 4}}).distributed  # the rest from torchrun's PET_* variables
    assert torchrun_command(pet, "m.w", [])[3:5] == ["--nnodes=4", "--nproc_per_node=1"]


TORCHRUN_FAILURE = """E1202 00:32:50.536000 2701 api.py:1002] failed (exitcode: -9) local_rank: 1 (pid: 2607)
============================================================
tests.tasks.grpo.distributed_cases FAILED
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-02_00:32:14
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 2607)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 2607
============================================================
"""


def _raise(exc):
    try:
        raise exc
    except Exception as e:
        return e


def test_a_failed_launch_raises_the_first_failing_ranks_error(tmp_path):
    write_rank_error(tmp_path, 1, _raise(ValueError("reward 'mine' failed on row 3")), USER_ERRORS)
    peer = type("DistBackendError", (RuntimeError,), {})
    write_rank_error(tmp_path, 0, _raise(peer("Connection closed by peer")), USER_ERRORS)
    errors = rank_errors(tmp_path)
    assert [e["rank"] for e in errors] == [1, 0]  # a lost peer is never the cause
    exc = failure(1, errors, ["last line\n"], 2)
    assert isinstance(exc, ValueError) and str(exc) == "rank 1 of 2: reward 'mine' failed on row 3"

    (tmp_path / "rank1.error.json").unlink()
    write_rank_error(tmp_path, 1, _raise(KeyError("oops")), USER_ERRORS)
    exc = failure(1, rank_errors(tmp_path), [], 2)
    assert type(exc) is RuntimeError and "rank 1 of 2: KeyError: 'oops'" in str(exc) and "Traceback" in str(exc)

    (tmp_path / "rank1.error.json").unlink()
    tail = TORCHRUN_FAILURE.splitlines(keepends=True)
    write_rank_error(
        tmp_path,
        1,
        _raise(RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer")),
        USER_ERRORS,
    )
    assert [e["rank"] for e in rank_errors(tmp_path)] == [0, 1] and rank_errors(tmp_path)[1]["lost_peer"]
    (tmp_path / "rank1.error.json").unlink()
    exc = failure(1, rank_errors(tmp_path), tail, 2)
    assert isinstance(exc, ChildProcessError) and isinstance(exc, USER_ERRORS)  # the stage fails with a StageError
    assert "\n" not in str(exc) and str(exc).endswith(
        ": rank 1 (local_rank: 1), exitcode -9 (pid: 2607), traceback Signal 9 (SIGKILL) received by PID 2607; "
        "then rank 0: DistBackendError: Connection closed by peer"
    )
    assert "Root Cause" in str(exc.__cause__)  # torchrun's lines, for the error log
    assert json.loads((tmp_path / "rank0.error.json").read_text())["user_error"] is False


def test_a_rank_stopped_by_torchruns_sigterm_is_not_taken_for_the_cause(tmp_path):
    """rank 1 killed by SIGKILL writes no record; torchrun notices first and SIGTERMs rank 0, whose checkpoint
    drain exits 143 (SystemExit): the launch names the killed rank, not rank 0's exit."""
    try:
        raise SystemExit(143)
    except SystemExit as e:
        write_rank_error(tmp_path, 0, e, USER_ERRORS)
    assert rank_errors(tmp_path)[0]["lost_peer"]
    exc = failure(1, rank_errors(tmp_path), TORCHRUN_FAILURE.splitlines(keepends=True), 2)
    assert isinstance(exc, ChildProcessError), exc
    assert "rank 1 (local_rank: 1), exitcode -9" in str(exc) and "then rank 0: SystemExit: 143" in str(exc)
    (tmp_path / "rank0.error.json").unlink()
    try:
        raise SystemExit(1)  # any other exit is this rank's own
    except SystemExit as e:
        write_rank_error(tmp_path, 0, e, USER_ERRORS)
    assert not rank_errors(tmp_path)[0]["lost_peer"]


def test_a_launched_child_dies_with_its_parent(tmp_path):
    """die_with_parent (the torchrun launch's and the Prefect server's preexec): a kill -9 of the parent takes
    the child, even one in a session of its own, down with it."""
    import os
    import signal
    import subprocess
    import sys
    import time

    pid_file = tmp_path / "child.pid"
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys, time; from grpoflow.tasks.launch.torchrun import die_with_parent\n"
            "c = subprocess.Popen(['sleep', '120'], start_new_session=True, preexec_fn=die_with_parent)\n"
            f"open({str(pid_file)!r}, 'w').write(str(c.pid)); time.sleep(120)",
        ]
    )
    deadline = time.time() + 60
    while not (pid_file.is_file() and pid_file.read_text()) and time.time() < deadline:
        time.sleep(0.05)
    child = int(pid_file.read_text())
    os.kill(child, 0)  # alive
    parent.kill()
    parent.wait()
    deadline = time.time() + 10
    while time.time() < deadline:
        try:
            with open(f"/proc/{child}/status") as f:
                if "zombie" in f.read():
                    break
        except FileNotFoundError:
            break
        time.sleep(0.05)
    else:
        os.kill(child, signal.SIGKILL)
        raise AssertionError("the child outlived its parent")


def test_fsdp2_refuses_a_mesh_on_another_device_than_the_weights():
    """gloo on GPUs: the group's device is the CPU, the weights are on CUDA; FSDP2 would shard across the two.
    Checked before any mesh is built (a model on the meta device stands in for one on a GPU)."""
    check_fsdp2_placement("cuda", "cuda")
    check_fsdp2_placement("cpu", "cpu")
    with pytest.raises(ValueError, match="distributed.backend=nccl"):
        check_fsdp2_placement("cuda", "cpu")
    root = torch.nn.Sequential(torch.nn.Linear(2, 2, device="meta"))
    with pytest.raises(ValueError, match="weights are on meta but the process group communicates on cpu"):
        wrap_root(root, Comm(rank=0, world=2), "fsdp2")
