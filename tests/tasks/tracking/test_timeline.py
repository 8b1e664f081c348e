"""Time outside the training loops (tasks/tracking/timeline.py): spans between marks, stage overheads, shares."""

import os
import subprocess
import sys
import time

import pytest

from grpoflow.tasks.tracking import timeline


def test_spans_stages_and_outside_share():
    m = {
        "config_loaded": 101.0,
        "imports_done": 104.0,
        "prefect_server_up": 110.0,
        "flow_start": 111.0,
        "parent_run_open": 111.5,
        "stage_start/data": 112.0,
        "stage_end/data": 113.0,
        "stage_start/sft": 113.0,
        "sft/loop_start": 115.0,
        "stage_end/sft": 135.0,
        "stage_start/grpo": 135.0,
        "grpo/generator_start": 136.0,
        "grpo/generator_up": 146.0,
        "stage_end/grpo": 190.0,
    }
    out = timeline.timeline_metrics(m, start=100.0, end=200.0, loops={"sft": 18.0, "grpo": 40.0})
    assert out["startup/config_s"] == 1.0 and out["startup/imports_s"] == 3.0
    assert out["startup/prefect_server_s"] == 6.0 and out["startup/flow_start_s"] == 1.0
    assert out["startup/parent_run_s"] == 0.5 and out["startup/to_first_sft_loop_s"] == 15.0
    assert out["startup/generator_s"] == 10.0
    assert "startup/to_first_grpo_loop_s" not in out  # no mark: no span (e.g. GRPO ran under torchrun)
    assert out["stage/data_s"] == 1.0 and "stage_overhead/data_s" not in out
    assert out["stage/sft_s"] == 22.0 and out["stage_overhead/sft_s"] == 4.0
    assert out["stage_overhead/grpo_s"] == 15.0
    assert out["run/wall_s"] == 100.0 and out["run/loop_s"] == 58.0
    assert out["run/outside_loop_share"] == pytest.approx(0.42)


def test_marks_keep_the_first_time_and_process_start_is_in_the_past():
    timeline.reset()
    timeline.mark("x")
    first = timeline.marks()["x"]
    time.sleep(0.01)
    timeline.mark("x")
    assert timeline.marks()["x"] == first
    start = timeline.process_start_time()
    assert start <= first <= time.time()
    assert time.time() - start < 24 * 3600 or os.getppid() == 1  # this process's start, not the machine's boot
    timeline.reset()


def test_each_run_in_a_process_is_timed_on_its_own_marks():
    """A test runs `grpoflow run` twice in one process; the continuous flow runs a pipeline a cycle. Each run's
    stages are timed from its own marks; the first from the process's start, a later one from its own."""
    timeline.reset()
    timeline.start_run()  # the CLI's command
    timeline.mark("config_loaded")
    timeline.start_flow()
    assert "config_loaded" in timeline.marks()  # the command's start-up is this flow's
    timeline.mark("stage_start/sft")
    timeline.mark("stage_end/sft")
    assert timeline.run_start() == timeline.process_start_time()
    for later in ("command", "cycle"):  # a second CLI command; then a flow with no command before it
        time.sleep(0.05)
        before = time.time()
        if later == "command":
            timeline.start_run()
            timeline.mark("config_loaded")
        timeline.start_flow()
        assert set(timeline.marks()) == ({"config_loaded", "flow_start"} if later == "command" else {"flow_start"})
        assert before <= timeline.run_start() <= timeline.marks()["flow_start"]
        timeline.mark("stage_start/sft")
        time.sleep(0.02)
        timeline.mark("stage_end/sft")
        out = timeline.timeline_metrics(timeline.marks(), timeline.run_start(), time.time(), loops={"sft": 0.01})
        assert 0 < out["stage_overhead/sft_s"] < out["stage/sft_s"] < 1, later
        assert (0 <= out["startup/config_s"] < 0.05) if later == "command" else "startup/config_s" not in out
    timeline.reset()


def test_a_process_execd_into_an_older_one_is_timed_from_its_import():
    """`bash -c 'pip install ... && grpoflow run'`: bash may exec the last command into its own process, whose
    starttime is before pip; the run's start-up must not count the installation."""
    probe = (
        "import time; from grpoflow.tasks.tracking import timeline; print(time.time() - timeline.process_start_time())"
    )
    gap = timeline.EXEC_GAP_S + 2
    out = subprocess.run(
        ["bash", "-c", f'sleep {gap}; exec "{sys.executable}" -c "{probe}"'], capture_output=True, text=True, check=True
    )
    assert float(out.stdout) < timeline.EXEC_GAP_S, out.stdout  # not the shell's start, `gap` s before
    plain = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert 0 <= float(plain.stdout) < timeline.EXEC_GAP_S  # a plain process: its own start
